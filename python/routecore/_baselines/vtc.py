"""Plain-Python VTC (vtc-basic) routing with routecore.VtcRouter's algorithm:
per-user deques of window buckets and totals, expired once per bucket period
(not on every call), the smallest and largest total from two heaps, and the
user forgotten at ``max_users`` (oldest latest bucket, then smallest name)
from a heap of (latest bucket, name); stale heap entries are skipped when
they surface. The same score as routecore: ``1 - cost / max_cost``, the
first endpoint on ties."""

import heapq
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
        max_users=100_000,
    ):
        self.endpoints = list(endpoints)
        self.running = [0] * len(self.endpoints)
        self.width = window_s / self.BUCKETS
        self.iw, self.ow = input_weight, output_weight
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.fw, self.uw, self.load = fairness_weight, utilization_weight, max_endpoint_load
        self.max_users = max_users
        self.bucket = -math.inf
        self.users: dict[str, deque] = {}  # name -> deque of [bucket, tokens]
        self.totals: dict[str, float] = {}
        # (total, name) and (-total, name), stale entries included.
        self.lows: list[tuple[float, str]] = []
        self.highs: list[tuple[float, str]] = []
        self.recency: list[tuple[int, str]] = []  # (latest bucket, name), stale included

    def _advance(self, now):
        bucket = math.floor(now / self.width)
        if bucket <= self.bucket:
            return
        self.bucket, oldest = bucket, bucket - self.BUCKETS + 1
        for name, b in list(self.users.items()):
            while b and b[0][0] < oldest:
                b.popleft()
            if b:
                self.totals[name] = sum(t for _, t in b)
            else:
                del self.users[name], self.totals[name]
        self.lows = [(t, u) for u, t in self.totals.items()]
        self.highs = [(-t, u) for u, t in self.totals.items()]
        heapq.heapify(self.lows)
        heapq.heapify(self.highs)
        self.recency = [(b[-1][0], u) for u, b in self.users.items()]
        heapq.heapify(self.recency)

    def _top(self, heap, sign):
        """The current total at the top of ``heap`` (signed by ``sign``), or None."""
        while heap and self.totals.get(heap[0][1]) != sign * heap[0][0]:
            heapq.heappop(heap)
        return sign * heap[0][0] if heap else None

    def _forget_least_recent(self):
        while True:
            bucket, name = heapq.heappop(self.recency)
            if name in self.users and self.users[name][-1][0] == bucket:
                break
        del self.users[name], self.totals[name]

    def route(self, user, input_tokens, output_tokens, now=0.0):
        self._advance(now)
        lo, hi = self._top(self.lows, 1), self._top(self.highs, -1)
        if lo is None:
            lo, hi = self.min_tokens, self.max_tokens
        size = max(self.min_tokens, (lo + hi) / 2)
        n = len(self.endpoints)
        x = min(self.totals.get(user, 0.0) / size, n - 1)
        max_cost = self.fw * (n - 1) + self.uw
        scores = [
            1 - (self.fw * abs(i - x) + self.uw * min(self.running[i] / self.load, 1.0)) / max_cost
            for i in range(n)
        ]
        endpoint = scores.index(max(scores))
        self.running[endpoint] += 1
        self._charge(user, self.iw * input_tokens + self.ow * output_tokens)
        return self.endpoints[endpoint]

    def _charge(self, user, tokens):
        b = self.users.get(user)
        if b is None:
            if tokens <= 0:
                return
            if len(self.users) >= self.max_users:
                self._forget_least_recent()
            b = self.users[user] = deque()
        if b and b[-1][0] == self.bucket:
            b[-1][1] += tokens
        else:
            b.append([self.bucket, tokens])
            heapq.heappush(self.recency, (self.bucket, user))
        total = self.totals[user] = sum(t for _, t in b)
        heapq.heappush(self.lows, (total, user))
        heapq.heappush(self.highs, (-total, user))
