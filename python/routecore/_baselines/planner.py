"""The FleetOpt planner in plain Python: the same models and the same algorithm
as ``routecore.plan`` (prefix sums over the requests sorted by total tokens,
Erlang C by the Poisson ratio with a saddle-point log-pmf; the paper model's
cap-first sizing; the engine model's iteration-time quadratic, each
endpoint's closed prefill loop by mean-value analysis, the per-endpoint slot
wait, the TTFT miss share over the chunk histogram and the galloping search),
written the way a Python planner would: the trace's sort and prefix
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


def engine_load(t, m, s, e, quantile=0.99, point=None):
    """(E[a], E[L_in], E[L_in^2], E[k L], chunk quantile, fewest chunks,
    chunk histogram, Var[a] / E[a]^2) of mixture ``m`` over s..e, plus the
    compressed requests' ``point`` (chunks, weight) when given."""
    if m is None:
        return None
    _, k, k2, kl, p, p2 = m
    a = max(k - 1, 0.0)
    q = t.chunk_rank(s, e, max(0, math.ceil((1 + quantile) / 2 * (e - s)) - 1)) if e > s else 0
    counts = {}
    fewest = None
    if e > s:
        ks, cs = np.unique(t.chunks[s:e], return_counts=True)
        counts = dict(zip(ks.tolist(), map(float, cs.tolist())))
        fewest = int(ks[0])
    if point is not None:
        q = max(q, point[0])
        counts[point[0]] = counts.get(point[0], 0.0) + point[1]
        fewest = point[0] if fewest is None else min(fewest, point[0])
    hist = sorted(counts.items())
    total = sum(w for _, w in hist)
    hist = [(k_, w / total) for k_, w in hist]
    return a, p, p2, kl, q, fewest or 0, hist, iterations_cs2(a, k, k2)


def iterations_cs2(a, k, k2):
    """Var[a] / E[a]^2 from E[k] and E[k^2] (a = k - 1), 0 when E[a] is 0."""
    return max((k2 - k * k) / (a * a), 0.0) if a > 0 else 0.0


def normal_survival(d):
    return 0.5 * math.erfc(d / math.sqrt(2))


def erfcx(x):
    """e^(x^2) erfc(x) for x >= 0; the asymptotic series from 25 on."""
    if x < 25:
        return math.exp(x * x) * math.erfc(x)
    y = 1 / (x * x)
    return (1 - 0.5 * y + 0.75 * y * y) / (x * math.sqrt(math.pi))


def exp_decode_miss(d, beta):
    """E[P(Z > d sqrt(1 + m / (3 tau)))] over m exponential of mean 3 tau / beta."""
    c = beta + d * d / 2
    tail = 0.5 * d * math.exp(-d * d / 2) * erfcx(math.sqrt(c)) / math.sqrt(2 * c)
    return min(max(normal_survival(d) - tail, 0.0), 1.0)


def tpot_met(t, load, w, h, c, tpot, allowed=0.01):
    """At most ``allowed`` of the requests have a TPOT (their decode's mean
    iteration time) above ``tpot`` at mean iteration time ``t``: the
    instantaneous quantile first, then the share over the decodes' lengths
    (a hyperexponential of their mean and variance), each decode's variance
    n_a / (1 + m / (3 E[a]))."""
    if not math.isfinite(t):
        return False
    n_a = max((t - w) / h, 0.0)
    if t + h * NORMAL_Z * math.sqrt(n_a) <= tpot:
        return True
    if t >= tpot:
        return False
    sd = h * math.sqrt(n_a)
    if sd <= 0:
        return True
    d = (tpot - t) / sd
    a, p, cs2 = load[0], load[1], load[7]
    mu = a - p / c - 1
    if mu <= 0:
        return normal_survival(d) <= allowed
    cs2 = cs2 * (a / mu) ** 2
    if cs2 <= 1:
        return exp_decode_miss(d, 3 * a / mu) <= allowed
    p1 = 0.5 * (1 + math.sqrt((cs2 - 1) / (cs2 + 1)))
    p2 = 1 - p1
    miss = p1 * exp_decode_miss(d, 6 * a * p1 / mu) + p2 * exp_decode_miss(d, 6 * a * p2 / mu)
    return miss <= allowed


# z_0.99 by Abramowitz and Stegun 26.2.23, as routecore computes it.
_T = math.sqrt(-2 * math.log(0.01))
NORMAL_Z = _T - (2.515517 + 0.802853 * _T + 0.010328 * _T * _T) / (
    1 + 1.432788 * _T + 0.189269 * _T * _T + 0.001308 * _T**3
)
MAX_LOOP = 64
MAX_GPUS = 1 << 50


def closed_loop(rate, x1, x2, think, max_population):
    """Mean-value analysis of one endpoint's prefill loop: (population, wait,
    busy) where the throughput reaches ``rate``, or None; R(k) = p / q walked
    as routecore walks it (a Moebius map, no division per step)."""
    c = x2 / (2 * x1) - x1
    p, q = x1, 1.0
    prev = prev2 = (0.0, 0.0)

    def through(pq, k):
        if pq[1] > 0:
            r = pq[0] / pq[1]
            return k / (think + r), r
        return 0.0, 0.0

    for k in range(1, max_population + 1):
        kf = float(k)
        if kf * q >= rate * (think * q + p):
            x, r = through((p, q), kf)
            xp, rp = through(prev, kf - 1)
            u, up = xp * x1, through(prev2, kf - 2)[0] * x1
            f = (rate - xp) / (x - xp) if x > xp else 1.0
            at = r if k == 1 else rp + f * (r - rp)
            return rate * (think + at), max(at - x1, 0.0), up + f * (u - up)
        prev2, prev = prev, (p, q)
        p, q = x1 * (1 + kf) * p + x1 * (think + kf * c) * q, p + think * q
        if not 1e-100 <= q <= 1e100:
            p, q = p / q, 1.0
    return None


def engine_state(rate, endpoints, load, n_slots, ctx, w, h, c):
    """(t, occupancy, prefill utilization, KV utilization, prefill wait, busy)."""
    a, p, p2, kl = load[:4]
    qa, qb = 0.5 * h * rate * rate * p / c, 1 - h * rate * a
    disc = qb * qb - 4 * qa * w
    if qb <= 0 or disc < 0:
        t = math.inf
    elif qa > 0:
        t = 2 * w / (qb + math.sqrt(disc))
    else:
        t = w / qb
    x1 = p * t / c
    rho_p = rate * x1
    if not (rho_p < 1 and math.isfinite(t)):
        return t, math.inf, rho_p, math.inf, math.inf, 1.0
    x2 = p2 * (t / c) ** 2
    slots = max(n_slots, 1)
    iterations = a + 0.5 * rho_p
    think = max(iterations * t - x1, 0.0)
    max_pop = min(slots, MAX_LOOP)
    closed = None
    if endpoints > 1 and rate * (think + x1) <= max_pop:
        closed = closed_loop(rate, x1, x2, think, max_pop)
    if x1 <= 0:
        occ, wait, busy = rate * iterations * t, 0.0, 0.0
    elif closed is not None:
        occ, wait, busy = closed
    elif endpoints > 1 and slots <= MAX_LOOP:
        return t, math.inf, rho_p, math.inf, math.inf, 1.0
    else:
        wait = rate * x2 / (2 * (1 - rho_p))
        occ, busy = rate * (iterations * t + wait), rho_p
    kv = rate * (kl * t + p * wait)
    return t, occ, rho_p, kv / (n_slots * ctx), wait, busy


def wait_of(mean, p, residual=math.inf):
    """(p, theta, queued): 0 with probability 1 - p, else the sum of two
    exponentials of means theta and queued (queued 0: one exponential). A
    prefill wait's first phase is the rest of the prompt being prefilled
    (``residual``), the second the prompts queued before it."""
    if mean > 0 and p > 0:
        p = min(p, 1.0)
        theta = mean / p
        first = min(max(residual, 0.0), theta)
        return p, first, theta - first
    return 0.0, 0.0, 0.0


def wait_quantile(wt, r):
    """A y with P(W > y) <= r: one exponential's quantile; for two phases of
    means M >= m the larger term's quantile where m <= M / 2, else each
    phase's r / 2 quantile (the union bound)."""
    p, theta, queued = wt
    if p <= r:
        return 0.0
    if queued > 0:
        big, small = max(theta, queued), min(theta, queued)
        if small <= 0.5 * big:
            return big * math.log(p * big / ((big - small) * r))
        return (big + small) * math.log(2 * p / r)
    return theta * math.log(p / r)


def terms(s, pw):
    """(c, theta): P(W_s + W_p > y) = sum_i c_i exp(-y / theta_i) for y >= 0,
    over the slot's phase and the prefill's two (equal means moved apart by a
    part in a million)."""
    theta = [s[1], pw[1], pw[2]]
    on = [s[0] > 0, pw[0] > 0, pw[0] > 0 and pw[2] > 0]
    for i in range(1, 3):
        for j in range(i):
            if on[i] and on[j] and abs(theta[i] - theta[j]) <= 1e-6 * theta[j]:
                theta[i] = theta[j] * (1 + 1e-6)
    c = [0.0, 0.0, 0.0]

    def add(sub, w):
        for i in sub:
            ci = 1.0
            for j in sub:
                if j != i:
                    ci = ci * theta[i] / (theta[i] - theta[j])
            c[i] += w * ci

    prefill = [1, 2] if on[2] else [1]
    if on[0]:
        add([0], s[0] * (1 - pw[0]))
    if on[1]:
        add(prefill, pw[0] * (1 - s[0]))
    if on[0] and on[1]:
        add([0] + prefill, s[0] * pw[0])
    return c, theta


def survival(ct, y):
    """P(W_s + W_p > y) of two independent waits, from their ``terms``."""
    if y < 0:
        return 1.0
    c, theta = ct
    return sum(c[i] * math.exp(-y / theta[i]) for i in range(3) if c[i] != 0)


def miss(ct, hist, t, ttft, half=0.5):
    """The share of requests whose W + (k + half) t exceeds ttft over the chunk
    histogram (the waits' ``terms`` ``ct``), the exponentials stepped from the
    largest k that fits down."""
    split = 0
    while split < len(hist) and ttft - (hist[split][0] + half) * t >= 0:
        split += 1
    total = sum(prob for _, prob in hist[split:])
    if split == 0:
        return total
    c, theta = ct
    if c == [0.0, 0.0, 0.0]:
        return total
    top = hist[split - 1][0]
    y0 = ttft - (top + half) * t
    e = [math.exp(-y0 / theta[i]) if c[i] != 0 else 0.0 for i in range(3)]
    f = [math.exp(-t / theta[i]) if c[i] != 0 else 0.0 for i in range(3)]
    k = top
    for kk, prob in reversed(hist[:split]):
        gap = k - kk
        e = [e[i] * f[i] ** gap for i in range(3)]
        k = kk
        total += prob * (c[0] * e[0] + c[1] * e[1] + c[2] * e[2])
        if max(e) < 1e-300:
            break
    return total


def slot_wait(gpus, slots, mu, lam, exact, peakedness):
    """The per-endpoint slot wait: Erlang C (or its bound) drained at
    (1 - rho^n) S mu, taken at round(c / z) servers with rho kept, z the held
    slots' peakedness t / W (Hayward's approximation)."""
    rho = lam / mu / (gpus * slots)
    servers = min(max(math.floor(gpus * slots / max(peakedness, 1.0) + 0.5), 1), gpus * slots)
    offered = rho * servers
    ln_pmf = -stirlerr(servers) - bd0(servers, offered) - 0.5 * math.log(2 * math.pi * servers)
    bound = min(2 * math.exp(ln_pmf) / (1 - offered / servers), 1.0)
    if offered <= 0 or bound < 1e-12:
        p = 0.0
    else:
        p = erlang_c(servers, offered) if exact else bound
    drain = (1 - rho**gpus) * slots * mu
    return wait_of(p / drain, p)


def engine_eval(lam, n, load, n_slots, ctx, w, h, c, slo, tpot, quantile=0.99, shift=(0.0, 0.0)):
    """(whether n GPUs meet every constraint of the engine model, the TTFT's
    union-bound quantile at the last screen). ``quantile`` is the TTFT's (the
    TPOT's is 0.99); ``shift`` = (offset, per chunk) is what the TTFT holds
    after this pool's prefill (a disaggregated prefill pool's transfer and
    decode side): ``(k + 1/2) (t + per_chunk) + offset``."""
    q, fewest, hist = load[4:7]
    offset, per_chunk = shift
    rate = lam / n
    t, occ, rho_p, kv, wait, busy = engine_state(rate, n, load, n_slots, ctx, w, h, c)
    if not tpot_met(t, load, w, h, c, tpot):
        return False, math.inf
    if rho_p >= 1 or not occ < n_slots or kv >= 1:
        return False, math.inf
    mu = rate / occ if occ > 0 else 0.0
    # The rest of the prompt being prefilled: E[X^2] / (2 E[X]), X = L_in t / C.
    residual = load[2] / (2 * load[1]) * t / c if load[1] > 0 else 0.0
    prefill = wait_of(wait, busy, residual)
    r = (1 - quantile) / 2

    # A prompt's own chunks: W + H A, A its endpoint's active sequences with
    # it, floor(n_a) or (with probability f) one more; alone (A = 1) it waits
    # for no iteration under way, beside others for half of one.
    n_a = max((t - w) / h, 1.0)
    lo, f = w + h * math.floor(n_a), n_a - math.floor(n_a)
    hi, lo_half = lo + h, (0.0 if n_a < 2 else 0.5)

    def own(g):
        x = g(lo, lo_half)
        return x + f * (g(hi, 0.5) - x) if f > 0 else x

    def after(k, t_own=hi, half=0.5):
        return (k + half) * (t_own + per_chunk) + (0.5 - half) * per_chunk + offset

    def slot(exact):
        if occ <= 0:
            return (0.0, 0.0, 0.0)
        return slot_wait(n, n_slots, mu, lam, exact, max(t / w, 1.0))

    def ttft_q(sw):
        return wait_quantile(sw, r / 2) + wait_quantile(prefill, r / 2) + after(q)

    rough = slot(False)
    ttft = ttft_q(rough)
    if ttft <= slo:
        return True, ttft
    exact = slot(True)
    if exact != rough:
        ttft = ttft_q(exact)
        if ttft <= slo:
            return True, ttft
    allowed = 1 - quantile
    first = max(fewest, 1)
    ct = terms(exact, prefill)
    if own(lambda t, half: survival(ct, slo - after(first, t, half))) > allowed:
        return False, ttft
    return own(
        lambda t, half: miss(ct, hist, t + per_chunk, slo - offset - (0.5 - half) * per_chunk, half)
    ) <= allowed, ttft


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
            if hi >= MAX_GPUS:
                return None
            if ok(hi):
                break
            bad, step = hi, 2 * step
    while hi - bad > 1:
        mid = (bad + hi) // 2
        bad, hi = (bad, mid) if ok(mid) else (mid, hi)
    return hi


def size_engine(lam, load, n_slots, ctx, w, h, c, slo, tpot, hint, quantile=0.99,
                shift=(0.0, 0.0)):  # fmt: skip
    """The smallest GPU count meeting ``engine_eval`` (TTFT ``quantile`` and
    ``shift`` as there)."""
    if lam <= 0 or load is None:
        return 0
    a, p, _, _, q, _, hist, _ = load
    offset, per_chunk = shift
    room = 1 - w / tpot
    bad = int(
        min(max(math.floor(lam * h * a / max(room, 1e-12)), math.floor(lam * p * w / c), 0), 1e15)
    )
    # The prompt alone on its endpoint: no iteration under way, its own chunks at W + H.
    budget, tt = slo - offset - 0.5 * per_chunk, w + h + per_chunk
    alone = (
        q * tt + 0.5 * per_chunk + offset > slo
        and sum(x for k, x in hist if budget - k * tt < 0) > 1 - quantile
    )
    if room <= 0 or alone:
        return bad + 1  # no count serves it: sized at the stability bound
    found = smallest_ok(
        bad,
        hint or bad + 1,
        lambda n: engine_eval(lam, n, load, n_slots, ctx, w, h, c, slo, tpot, quantile, shift)[0],
    )
    return bad + 1 if found is None else found


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
                comp = compressed(t, e, band_end, b)
                point = None
                if comp is not None:
                    point = (math.ceil(comp[4] / c_chunk), float(comp[0]))
                load = engine_load(t, merge(short_mix, comp), s, e, point=point)
                ns = size_engine(alpha_p * lam, load, n_short, b, w, h, c_chunk, slo, tpot,
                                 short_hint)  # fmt: skip
                short_hint = ns
                last = (alpha_p, ns)
            ns = last[1]
            lo = band_end if band_end < t.n else e
            load = engine_load(t, mix(t, band_end, t.n), lo, t.n)
            nl = size_engine((1 - alpha_p) * lam, load, n_long, long_context, w, h, c_chunk, slo,
                             tpot, long_hint)  # fmt: skip
            long_hint = nl
            out[(b, g)] = (ns, nl)
    return homo, out


def disagg_loads(inputs, outputs, c_chunk, quantile=0.99):
    """The engine-model loads (as ``engine_load``'s) of the aggregated, the
    prefill and the decode pools of a disaggregated fleet, in NumPy: every
    request on one pool (k = ceil(L_in / C) + L_out), its prompt alone with
    one output token (k = ceil(L_in / C) + 1, KV L_in + 1), its decode alone
    (k = 1 + L_out, one prompt token, KV L_total); outputs of 0 count as 1."""
    p = np.asarray(inputs, dtype=np.int64)
    o = np.maximum(np.asarray(outputs, dtype=np.int64), 1)
    ch = -(-p // c_chunk)
    rank = max(0, math.ceil((1 + quantile) / 2 * len(p)) - 1)
    q, fewest = int(np.partition(ch, rank)[rank]), int(ch.min())
    ks, cs = np.unique(ch, return_counts=True)
    hist = list(zip(ks.tolist(), (cs / len(p)).tolist()))
    pf = p.astype(float)

    def load(k, kv_tokens, prompt, q, fewest, hist):
        k = k.astype(float)
        a = max(float(k.mean()) - 1, 0.0)
        return (a, float(prompt.mean()), float((prompt * prompt).mean()),
                float((k * kv_tokens).mean()), q, fewest, hist,
                iterations_cs2(a, float(k.mean()), float((k * k).mean())))  # fmt: skip

    one = np.ones_like(pf)
    return (
        load(ch + o, (p + o).astype(float), pf, q, fewest, hist),
        load(ch + 1, (p + 1).astype(float), pf, q, fewest, hist),
        load(1 + o, (p + o).astype(float), one, 1, 1, [(1, 1.0)]),
    )


def plan_disagg(inputs, outputs, lam, slo, tpot, *, quantile=0.99, c_chunk=512, w=0.008,
                h=0.00065, kv_bytes=40 * 2**30, per_token=40 * 1024, context=65536,
                bandwidth=25e9, latency=0.002, decode_tail_share=0.25,
                decode_ttft_share=0.25):  # fmt: skip
    """The disaggregated plan of ``routecore.plan_disaggregated``: the decode
    pool sized first for TPOT and its share of the TTFT (``decode_ttft_share``
    of the target at the quantile ``1 - decode_tail_share (1 - q)``), then the
    prefill pool for the whole TTFT at ``1 - (1 - decode_tail_share) (1 - q)``
    with the KV transfer (``per_token`` bytes a token over ``bandwidth``, plus
    ``latency``) and the decode side's TTFT bound shifted in; the aggregated
    pool beside them. Returns (aggregated GPUs, prefill GPUs, decode GPUs,
    the decode side's TTFT bound, the prefill pool's TTFT bound)."""
    n_slots = slots(kv_bytes, per_token, context)
    agg, pre, dec = disagg_loads(inputs, outputs, c_chunk, quantile)
    pool = (n_slots, context, w, h, c_chunk)
    n_agg = size_engine(lam, agg, *pool, slo, tpot, None, quantile)
    miss_budget = 1 - quantile
    dec_slo, dec_q = slo * decode_ttft_share, 1 - decode_tail_share * miss_budget
    n_dec = size_engine(lam, dec, *pool, dec_slo, tpot, None, dec_q)
    dec_ttft = engine_eval(lam, n_dec, dec, *pool, dec_slo, tpot, dec_q)[1]
    per_chunk = per_token * c_chunk / bandwidth
    shift = (latency - 0.5 * per_chunk + dec_ttft, per_chunk)
    pre_q = 1 - (1 - decode_tail_share) * miss_budget
    n_pre = size_engine(lam, pre, *pool, slo, math.inf, None, pre_q, shift)
    pre_ttft = engine_eval(lam, n_pre, pre, *pool, slo, math.inf, pre_q, shift)[1]
    return n_agg, n_pre, n_dec, dec_ttft, pre_ttft
