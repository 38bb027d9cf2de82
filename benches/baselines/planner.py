"""The FleetOpt planner in plain Python: the same model and the same algorithm
as ``routecore.plan`` (prefix sums over the requests sorted by total tokens,
Erlang C by the Poisson ratio with a saddle-point log-pmf, cap-first sizing),
written the way a Python planner would. The P99 prefill of a range is taken by
sorting that range's chunk counts (routecore uses a wavelet matrix)."""

from __future__ import annotations

import bisect
import math

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
    """Requests sorted by total tokens with prefix sums of k, k L, k^2, k^2 L, k^2 L^2."""

    def __init__(self, inputs, outputs, c_chunk):
        rows = sorted(zip(inputs, outputs), key=lambda r: r[0] + r[1])
        self.totals = [i + o for i, o in rows]
        self.chunks = [-(-i // c_chunk) for i, _ in rows]
        self.n = len(rows)
        self.sums = [[0.0] * 5]
        self.tokens = [0.0]
        for (i, o), ch in zip(rows, self.chunks):
            k, L = ch + o, i + o
            p = self.sums[-1]
            self.sums.append([p[0] + k, p[1] + k * L, p[2] + k * k, p[3] + k * k * L,
                              p[4] + k * k * L * L])  # fmt: skip
            self.tokens.append(self.tokens[-1] + L)

    def span(self, lo, hi):
        return bisect.bisect_right(self.totals, lo), bisect.bisect_right(self.totals, hi)

    def service(self, s, e, n_slots, w, h, h_ref, quantile=0.99):
        cnt = e - s
        if cnt == 0:
            return None
        d = [self.sums[e][j] - self.sums[s][j] for j in range(5)]
        a0, a1 = (w + h * n_slots, 0.0) if h_ref is None else (w, h * n_slots / h_ref)
        mean = (a0 * d[0] + a1 * d[1]) / cnt
        second = (a0 * a0 * d[2] + 2 * a0 * a1 * d[3] + a1 * a1 * d[4]) / cnt
        t_iter = a0 + a1 * (self.tokens[e] - self.tokens[s]) / cnt
        ch = sorted(self.chunks[s:e])
        p99 = ch[max(0, math.ceil(quantile * cnt) - 1)]
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


def plan(inputs, outputs, lam, slo, *, b_short, gammas, w=0.008, h=0.00065, h_ref=None,
         c_chunk=512, kv_bytes=40 * 2**30, per_token=40 * 1024, long_context=65536,
         rho_max=0.85):  # fmt: skip
    """Returns (homogeneous GPUs, {(b, gamma): (n_short, n_long)}) for p_c = 1."""
    t = Trace(inputs, outputs, c_chunk)
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
