"""Token-budget routing in plain Python: the same algorithm as routecore's
Calibrator + TokenBudgetRouter (Chen et al. 2026, Algorithm 1), written the way
a Python router would."""

from __future__ import annotations

import math

import numpy as np

from routecore._core import Calibrator as _Core

#: The core's defaults (one source for both).
_DEFAULTS = (_Core.DEFAULT_BETA, _Core.DEFAULT_GAMMA, _Core.DEFAULT_COLD_START)


class Calibrator:
    def __init__(self, beta=_DEFAULTS[0], gamma=_DEFAULTS[1], cold_start=_DEFAULTS[2]):
        self.beta, self.gamma, self.cold_start = beta, gamma, cold_start
        self.stats: dict[str, list[float]] = {}  # category -> [ratio, sigma, count]

    def observe(self, category, prompt_bytes, prompt_tokens):
        c_obs = prompt_bytes / prompt_tokens
        s = self.stats.setdefault(category, [self.cold_start, 0.0, 0])
        s[2] += 1
        w = max(1.0 / s[2], 1.0 - self.beta)
        s[0] += w * (c_obs - s[0])
        s[1] += w * (abs(c_obs - s[0]) - s[1])

    def estimate_tokens(self, prompt_bytes, category):
        s = self.stats.get(category)
        ratio = self.cold_start if s is None else max(s[0] - self.gamma * s[1], 0.5)
        return math.ceil(prompt_bytes / ratio)


class TokenBudgetRouter:
    def __init__(self, pools, calibrator=None):
        # pools: list of (name, max_context, budget, queue_limit)
        self.pools = pools
        self.order = sorted(range(len(pools)), key=lambda i: (pools[i][2], pools[i][1]))
        self.in_flight = [0] * len(pools)
        self.calibrator = calibrator or Calibrator()

    def _overloaded(self, i):
        limit = self.pools[i][3]
        return limit is not None and self.in_flight[i] > limit

    def route(self, prompt_bytes, category, max_output_tokens):
        total = self.calibrator.estimate_tokens(prompt_bytes, category) + max_output_tokens
        pools = self.pools
        target = next((i for i in self.order if pools[i][2] >= total), None)
        if target is None:
            fitting = [i for i in self.order if pools[i][1] >= total]
            if not fitting:
                return -1
            target = max(fitting, key=lambda i: pools[i][1])
        if self._overloaded(target):
            alternates = [
                i
                for i in self.order
                if i != target and pools[i][1] >= total and not self._overloaded(i)
            ]
            if alternates:
                target = min(alternates, key=lambda i: self.in_flight[i])
        self.in_flight[target] += 1
        return target


class NumpyRouter:
    """``route_many`` the way a NumPy user writes it for pools without queue
    limits (nothing spills) and without a compress band, the benched case:
    the estimate of every request at once (``ceil(bytes / ratio[category]) +
    output``, in float64, exact below 2^53), then one ``np.where`` per bound
    from the largest window down to the smallest budget, and the in-flight
    counts by ``np.count_nonzero``. ``ratios[c]`` is the conservative ratio
    of category id ``c``, as the calibrator gives it."""

    def __init__(self, pools, ratios):
        # pools: list of (name, max_context, budget, queue_limit) as TokenBudgetRouter's.
        if any(p[3] is not None for p in pools):
            raise ValueError("NumpyRouter routes pools without queue limits")
        order = sorted(range(len(pools)), key=lambda i: (pools[i][2], pools[i][1]))
        self.widest = max(p[1] for p in pools)
        #: The pool of the largest window (the last in budget order among equals).
        self.largest = [i for i in order if pools[i][1] == self.widest][-1]
        #: (budget, pool), largest budget first: the first in budget order wins ties.
        self.budgets = [(pools[i][2], i) for i in reversed(order)]
        self.ratios = np.asarray(ratios, dtype=np.float64)
        self.in_flight = np.zeros(len(pools), dtype=np.int64)

    def route_many(self, prompt_bytes, category_ids, max_output_tokens):
        total = np.ceil(prompt_bytes / self.ratios[category_ids])
        total += max_output_tokens
        chosen = np.where(total <= self.widest, self.largest, -1)
        for budget, pool in self.budgets:
            chosen = np.where(total <= budget, pool, chosen)
        for pool in range(len(self.in_flight)):
            self.in_flight[pool] += np.count_nonzero(chosen == pool)
        return chosen
