"""Plain-Python VTC (vtc-basic) routing: per-user deques of window buckets and
the same score as routecore.VtcRouter, with min / max over users computed on
every call (the straightforward way). With `max_users`, a new user beyond it
forgets the least recently active one, chosen as routecore does (oldest latest
bucket, then smallest name) by a scan over the users."""

import math
from collections import deque


class VtcRouter:
    BUCKETS = 10

    def __init__(
        self,
        endpoints,
        window_s=300.0,
        input_weight=1.0,
        output_weight=2.0,
        min_tokens=1000.0,
        max_tokens=8000.0,
        fairness_weight=1.0,
        utilization_weight=1.0,
        max_endpoint_load=100.0,
        max_users=None,
    ):
        self.endpoints = list(endpoints)
        self.running = [0] * len(self.endpoints)
        self.width = window_s / self.BUCKETS
        self.iw, self.ow = input_weight, output_weight
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.fw, self.uw, self.load = fairness_weight, utilization_weight, max_endpoint_load
        self.max_users = max_users
        self.users: dict[str, deque] = {}

    def _count(self, buckets, oldest):
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()
        return sum(t for _, t in buckets)

    def route(self, user, input_tokens, output_tokens, now=0.0):
        bucket = math.floor(now / self.width)
        oldest = bucket - self.BUCKETS + 1
        counts = {u: self._count(b, oldest) for u, b in self.users.items()}
        active = [c for u, c in counts.items() if self.users[u]]
        lo, hi = (min(active), max(active)) if active else (self.min_tokens, self.max_tokens)
        size = max(self.min_tokens, (lo + hi) / 2)
        n = len(self.endpoints)
        x = min(counts.get(user, 0.0) / size, n - 1)
        scores = [
            self.fw * abs(i - x) + self.uw * min(self.running[i] / self.load, 1.0) for i in range(n)
        ]
        endpoint = scores.index(min(scores))
        if user not in self.users and self.max_users and len(self.users) >= self.max_users:
            b = self.users
            del b[min(b, key=lambda u: (b[u][-1][0] if b[u] else -math.inf, u))]
        b = self.users.setdefault(user, deque())
        charge = self.iw * input_tokens + self.ow * output_tokens
        if b and b[-1][0] == bucket:
            b[-1][1] += charge
        else:
            b.append([bucket, charge])
        self.running[endpoint] += 1
        return self.endpoints[endpoint]
