"""The FleetOpt planner in plain Python: the same models and the same algorithm
as ``routecore.plan`` (prefix sums over the requests sorted by total tokens,
Erlang C by the Poisson ratio with a saddle-point log-pmf; the paper model's
cap-first sizing, the engine model's fixed point, prefill queue and galloping
search), written the way a Python planner would: the trace's sort and prefix
sums in NumPy (built once per trace, as routecore builds its table once per
workload), the sweep's scalar arithmetic in Python floats. The prefill
quantile of a range is taken by ``np.partition`` of that range's chunk counts
(routecore uses a wavelet matrix)."""

from __future__ import annotations

import math

import numpy as np

LN_SQRT_2PI = 0.9189385332046728


def stirlerr(n):
    if n < 16:
        return math.lgamma(n + 1) - (n + 0.5) * math.log(n) + n - LN_SQRT_2PI
    nn = n * n
    return (1 / 12 - (1 / 360 - (1 / 1260 - (1 / 1680 - 1 / 1188 / nn) / nn) / nn) / nn) / n


def bd0(x, m):
    if abs(x - m) < 0.1 * (x + m):
        v = (x - m) / (x + m)
        s = (x - m) * v
        ej = 2 * x * v
        j = 1
        while True:
            ej *= v * v
            s1 = s + ej / (2 * j + 1)
            if s1 == s:
                return s1
            s = s1
            j += 1
    return x * math.log(x / m) + m - x


def erlang_c(c, a):
    """Erlang C for 0 < a < c."""
    ln_pmf = -stirlerr(c) - bd0(c, a) - 0.5 * math.log(2 * math.pi * c)
    pmf = math.exp(ln_pmf)
    term, above, i = pmf, 0.0, 1
    while True:
        term *= a / (c + i)
        above += term
        if term <= 1e-17:
            break
        i += 1
    b = math.exp(ln_pmf - math.log1p(-above))
    rho = a / c
    return b / (1 - rho * (1 - b))


def p99_wait(c, mu, cs2, lam):
    if lam >= c * mu:
        return math.inf
    a = lam / mu
    if (
        2 * math.exp(-stirlerr(c) - bd0(c, a) - 0.5 * math.log(2 * math.pi * c)) / (1 - a / c)
        <= 0.005
    ):
        return 0.0
    cc = erlang_c(c, a)
    return 0.0 if cc <= 0.01 else math.log(cc / 0.01) * (1 + cs2) / (2 * (c * mu - lam))


class Trace:
    """Requests sorted by total tokens (stable) with prefix sums of k, k L, k^2,
    k^2 L, k^2 L^2, L_in, L_in^2 (float64, exact: every term is below 2^53, and
    ``np.cumsum`` adds in order) and of L; ``c_chunk`` is the prefill chunk."""

    def __init__(self, inputs, outputs, c_chunk):
        i, o = np.asarray(inputs, dtype=np.int64), np.asarray(outputs, dtype=np.int64)
        order = np.argsort(i + o, kind="stable")
        i, o = i[order], o[order]
        self.c_chunk = c_chunk
        self.totals = i + o
        self.chunks = -(-i // c_chunk)
        self.n = len(i)
        k, big_l, fi = (self.chunks + o).astype(float), self.totals.astype(float), i.astype(float)
        terms = np.stack([k, k * big_l, k * k, k * k * big_l, k * k * big_l * big_l, fi, fi * fi])
        self.sums = np.zeros((self.n + 1, 7))
        np.cumsum(terms, axis=1, out=self.sums[1:].T)
        self.tokens = np.concatenate([[0.0], np.cumsum(big_l)])

    def span(self, lo, hi):
        s, e = np.searchsorted(self.totals, [lo, hi], side="right").tolist()
        return s, e

    def diff(self, s, e):
        """The seven sums over requests ``s..e``, as Python floats."""
        return (self.sums[e] - self.sums[s]).tolist()

    def token_sum(self, s, e):
        return float(self.tokens[e] - self.tokens[s])

    def chunk_rank(self, s, e, rank):
        """The ``rank``-th smallest chunk count of requests ``s..e``."""
        return int(np.partition(self.chunks[s:e], rank)[rank])

    def service(self, s, e, n_slots, w, h, h_ref, quantile=0.99):
        cnt = e - s
        if cnt == 0:
            return None
        d = self.diff(s, e)
        a0, a1 = (w + h * n_slots, 0.0) if h_ref is None else (w, h * n_slots / h_ref)
        mean = (a0 * d[0] + a1 * d[1]) / cnt
        second = (a0 * a0 * d[2] + 2 * a0 * a1 * d[3] + a1 * a1 * d[4]) / cnt
        t_iter = a0 + a1 * self.token_sum(s, e) / cnt
        p99 = self.chunk_rank(s, e, max(0, math.ceil(quantile * cnt) - 1))
        return mean, max(0.0, second / mean**2 - 1), t_iter, p99 * t_iter


def size_pool(lam, svc, n_slots, rho_max, slo):
    if lam <= 0 or svc is None:
        return 0, True
    mean, cs2, t_iter, prefill = svc
    mu_gpu = n_slots / mean
    n = max(1, math.ceil(lam / (rho_max * mu_gpu)))
    budget = slo - prefill - t_iter
    if budget < 0:
        return n, False

    def wait(k):
        return p99_wait(k * n_slots, 1 / mean, cs2, lam)

    if wait(n) <= budget:
        return n, True
    bad, hi = n, 2 * n
    while wait(hi) > budget:
        bad, hi = hi, 2 * hi
    while hi - bad > 1:
        mid = (bad + hi) // 2
        bad, hi = (bad, mid) if wait(mid) <= budget else (mid, hi)
    return hi, True


def slots(kv_bytes, per_token, ctx):
    return math.floor(kv_bytes / (per_token * ctx) * (1 + 1e-12))


def plan(t, lam, slo, *, b_short, gammas, w=0.008, h=0.00065, h_ref=None,
         kv_bytes=40 * 2**30, per_token=40 * 1024, long_context=65536,
         rho_max=0.85):  # fmt: skip
    """The paper model over trace ``t``: (homogeneous GPUs, {(b, gamma): (n_short,
    n_long)}) for p_c = 1."""
    n_long = slots(kv_bytes, per_token, long_context)
    s_all, e_all = 0, t.n
    homo, _ = size_pool(lam, t.service(s_all, e_all, n_long, w, h, h_ref), n_long, rho_max, slo)
    out = {}
    for b in b_short:
        s, e = t.span(-1, b)
        n_short = slots(kv_bytes, per_token, b)
        short_svc = t.service(s, e, n_short, w, h, h_ref)
        for g in gammas:
            gb = math.floor(g * b)
            _, band_end = t.span(b, gb)
            alpha_p = band_end / t.n
            ns, _ = size_pool(alpha_p * lam, short_svc, n_short, rho_max, slo)
            long_svc = t.service(band_end, t.n, n_long, w, h, h_ref)
            nl, _ = size_pool((1 - alpha_p) * lam, long_svc, n_long, rho_max, slo)
            out[(b, g)] = (ns, nl)
    return homo, out


def mix(t, s, e):
    """(weight, E[k], E[k^2], E[k L], E[L_in], E[L_in^2]) of a span, or None."""
    cnt = e - s
    if cnt == 0:
        return None
    d = t.diff(s, e)
    return (cnt, d[0] / cnt, d[2] / cnt, d[1] / cnt, d[5] / cnt, d[6] / cnt)


def merge(a, b):
    if a is None or b is None:
        return a or b
    w = a[0] + b[0]
    return (w, *((a[0] * x + b[0] * y) / w for x, y in zip(a[1:], b[1:])))


def compressed(t, s, e, b):
    """The band's requests cut to L_total = b, L_out at its mean."""
    cnt = e - s
    if cnt == 0:
        return None
    out = max(t.token_sum(s, e) / cnt - t.diff(s, e)[5] / cnt, 0.0)
    p = max(b - out, 1.0)
    k = math.ceil(p / t.c_chunk) + out
    return (cnt, k, k * k, k * b, p, p * p)


def engine_load(t, m, s, e, quantile=0.99):
    """(E[a], cs2 of a, E[L_in], E[L_in^2], E[k L], chunk quantile over s..e)."""
    if m is None:
        return None
    _, k, k2, kl, p, p2 = m
    a = max(k - 1, 0.0)
    cs2 = max((k2 - k * k) / (a * a), 0.0) if a > 0 else 0.0
    q = t.chunk_rank(s, e, max(0, math.ceil((1 + quantile) / 2 * (e - s)) - 1))
    return a, cs2, p, p2, kl, q


def engine_ok(lam, n, load, n_slots, ctx, w, h, c, slo, tpot, quantile=0.99):
    """Whether n GPUs meet every constraint of the engine model."""
    a, cs2, p, p2, kl, q = load
    rate = lam / n
    x = h * rate * a
    if x >= 1:
        return False
    t = w / (1 - x)
    z = NORMAL_Z
    if t + h * z * math.sqrt(max((t - w) / h, 0.0)) > tpot:
        return False
    rho_p = rate * p * t / c
    if rho_p >= 1:
        return False
    wait = rate * p2 * (t / c) ** 2 / (2 * (1 - rho_p))
    occ = rate * (a * t + wait)
    if occ >= n_slots or rate * (kl * t + p * wait) >= n_slots * ctx:
        return False
    r = (1 - quantile) / 2
    wq = wait / rho_p * math.log(rho_p / r) if rho_p > r else 0.0
    slot = p99_wait(n * n_slots, rate / occ, cs2, lam) if occ > 0 else 0.0
    return slot + wq + (q + 1) * t <= slo


# z_0.99 by Abramowitz and Stegun 26.2.23, as routecore computes it.
_T = math.sqrt(-2 * math.log(0.01))
NORMAL_Z = _T - (2.515517 + 0.802853 * _T + 0.010328 * _T * _T) / (
    1 + 1.432788 * _T + 0.189269 * _T * _T + 0.001308 * _T**3
)


def smallest_ok(bad, start, ok):
    hi, step = max(start, bad + 1), 1
    if ok(hi):
        while hi - bad > 1:
            probe = hi - min(step, hi - bad - 1)
            if ok(probe):
                hi, step = probe, 2 * step
            else:
                bad = probe
                break
    else:
        bad = hi
        while True:
            hi = bad + step
            if ok(hi):
                break
            bad, step = hi, 2 * step
    while hi - bad > 1:
        mid = (bad + hi) // 2
        bad, hi = (bad, mid) if ok(mid) else (mid, hi)
    return hi


def size_engine(lam, load, n_slots, ctx, w, h, c, slo, tpot, hint):
    if lam <= 0 or load is None:
        return 0
    a, _, p, _, _, q = load
    room = 1 - w / tpot
    if room <= 0 or (q + 1) * w >= slo:
        return None
    bad = int(max(math.floor(lam * h * a / room), math.floor(lam * p * w / c), 0))
    return smallest_ok(
        bad,
        hint or bad + 1,
        lambda n: engine_ok(lam, n, load, n_slots, ctx, w, h, c, slo, tpot),
    )


def plan_engine(t, lam, slo, tpot, *, b_short, gammas, w=0.008, h=0.00065,
                kv_bytes=40 * 2**30, per_token=40 * 1024, long_context=65536):  # fmt: skip
    """The engine model over trace ``t``: (homogeneous GPUs, {(b, gamma): (n_short,
    n_long)}), p_c = 1."""
    c_chunk = t.c_chunk
    n_long = slots(kv_bytes, per_token, long_context)
    homo = size_engine(lam, engine_load(t, mix(t, 0, t.n), 0, t.n), n_long, long_context, w, h,
                       c_chunk, slo, tpot, None)  # fmt: skip
    out = {}
    short_hint = long_hint = None
    for b in b_short:
        s, e = t.span(-1, b)
        n_short = slots(kv_bytes, per_token, b)
        short_mix = mix(t, s, e)
        last = None
        for g in gammas:
            _, band_end = t.span(b, math.floor(g * b))
            alpha_p = band_end / t.n
            if last is None or last[0] != alpha_p:
                m = merge(short_mix, compressed(t, e, band_end, b))
                ns = size_engine(alpha_p * lam, engine_load(t, m, s, e), n_short, b, w, h, c_chunk,
                                 slo, tpot, short_hint)  # fmt: skip
                short_hint = ns or short_hint
                last = (alpha_p, ns)
            ns = last[1]
            load = engine_load(t, mix(t, band_end, t.n), band_end, t.n)
            nl = size_engine((1 - alpha_p) * lam, load, n_long, long_context, w, h, c_chunk, slo,
                             tpot, long_hint)  # fmt: skip
            long_hint = nl or long_hint
            out[(b, g)] = (ns, nl)
    return homo, out
