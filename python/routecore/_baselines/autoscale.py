"""The autoscaler's live window and sizing step in plain Python: per pool a
ring of sub-windows holding exact sums and ``collections.Counter``s of the
prefill chunks (a running total ``Counter`` for the quantile, as routecore
keeps running histogram totals), and the engine model's sizing from the
planner's own twin (``_baselines.planner.size_engine``). Exact chunk
quantiles (routecore's histogram is exact below 32 chunks, the bench's
range). Damping is left out: both sides' undamped model counts are
compared."""

from __future__ import annotations

import math
from collections import Counter
from itertools import accumulate

from routecore._baselines.planner import iterations_cs2, size_engine


class Window:
    """One pool's sliding window: ``subs`` sub-windows of ``window_s / subs``
    seconds; ``c`` the prefill chunk."""

    def __init__(self, window_s, subs, c, now=0.0):
        self.sub_s, self.c, self.start, self.last, self.epoch = window_s / subs, c, now, now, 0
        self.sums = [[0.0] * 7 for _ in range(subs)]
        self.chunks = [Counter() for _ in range(subs)]
        self.total = Counter()

    def _advance(self, now):
        self.last = max(self.last, now)
        e = int((self.last - self.start) // self.sub_s)
        n = len(self.sums)
        for epoch in range(self.epoch + 1, min(e, self.epoch + n) + 1):
            i = epoch % n
            if self.sums[i][0]:
                self.total.subtract(self.chunks[i])
                self.chunks[i].clear()
                self.sums[i] = [0.0] * 7
        self.epoch = max(self.epoch, e)

    def observe(self, now, prompt, output):
        self._advance(now)
        i = self.epoch % len(self.sums)
        chunks = -(-prompt // self.c)
        k = chunks + output
        s = self.sums[i]
        s[0] += 1
        s[1] += k
        s[2] += k * k
        s[3] += k * (prompt + output)
        s[4] += prompt
        s[5] += prompt * prompt
        s[6] += output
        self.chunks[i][chunks] += 1
        self.total[chunks] += 1

    def load(self, now, quantile=0.99):
        """(rate, the planner twin's engine load) at ``now``; load None when empty."""
        self._advance(now)
        n, k, k2, kl, p, p2, _ = (sum(col) for col in zip(*self.sums))
        if not n:
            return 0.0, None
        oldest = self.start + max(self.epoch + 1 - len(self.sums), 0) * self.sub_s
        rate = n / max(self.last - oldest, self.sub_s)
        counts = sorted((c, m) for c, m in self.total.items() if m > 0)
        target = max(math.ceil((1 + quantile) / 2 * n), 1)
        cum = accumulate(m for _, m in counts)
        q = next(c for (c, _), seen in zip(counts, cum, strict=True) if seen >= target)
        hist = [(c, m / n) for c, m in counts]
        a = max(k / n - 1, 0.0)
        cs2 = iterations_cs2(a, k / n, k2 / n)
        return rate, (a, p / n, p2 / n, kl / n, q, hist[0][0], hist, cs2)


def step(windows, pools, profile, now):
    """Every pool's undamped model count: ``pools`` dicts with context,
    min/max_endpoints, slo_ttft_s, slo_tpot_s; ``profile`` a routecore
    Profile (its W, H, chunk and slots)."""
    out = []
    for w, pool in zip(windows, pools, strict=True):
        rate, load = w.load(now)
        if load is None:
            out.append(pool.get("min_endpoints", 1))
            continue
        n_slots = profile.slots(pool["context"])
        shape = (n_slots, pool["context"], profile.w_s, profile.h_s, profile.c_chunk)
        out.append(size_engine(rate, load, *shape, pool["slo_ttft_s"], pool["slo_tpot_s"], None))
    return out
