"""Quota admission in plain Python: the same algorithm as routecore's
AdmissionController (Cunningham 2026, section 4.3 checks; equations 1-3),
written the way a Python gateway would."""

from __future__ import annotations

import math
from collections import deque

WEIGHT = {"dedicated": 1000.0, "guaranteed": 1000.0, "elastic": 100.0, "spot": 1.0}
WEIGHT["preemptible"] = 0.1


class Entitlement:
    def __init__(self, name, service_class, slo_ms, tokens_per_s, kv_bytes, concurrency):
        self.name, self.service_class, self.slo_ms = name, service_class, slo_ms
        self.tokens_per_s, self.kv_bytes, self.concurrency = tokens_per_s, kv_bytes, concurrency
        self.in_flight: dict[int, tuple[float, int]] = {}
        self.tokens_in_flight = 0
        self.window: deque[list] = deque()  # [at, ticket, tokens]
        self.window_tokens = 0
        self.served_rate, self.served_at = tokens_per_s, None
        self.debt = self.burst = 0.0
        self.latency = None
        self.priority = 0.0


class AdmissionController:
    def __init__(self, concurrency, tokens_per_s, ents, default_max_tokens=4096, window_s=60.0):
        self.concurrency, self.tokens_per_s = concurrency, tokens_per_s
        self.ents = {e.name: e for e in ents}
        self.default_max_tokens, self.window_s = default_max_tokens, window_s
        self.in_flight = 0
        self.next_ticket = 1
        self.tickets: dict[int, Entitlement] = {}
        self.mean_slo = sum(e.slo_ms for e in ents) / len(ents)
        for e in ents:
            self._reprioritise(e)

    def _reprioritise(self, e):
        e.priority = (
            WEIGHT[e.service_class]
            / (1 + 2.0 * e.slo_ms / self.mean_slo)
            / (1 + e.burst)
            * (1 + 4.0 * e.debt)
        )

    def _rate(self, e):
        n = len(e.in_flight)
        if n == 0:
            return 0.0
        slot_rate = self.tokens_per_s / self.concurrency
        latency = e.latency if e.latency is not None else e.tokens_in_flight / n / slot_rate
        return n / max(latency, 0.05)

    def admit(self, name, input_tokens, max_tokens, now):
        e = self.ents.get(name)
        if e is None:
            return (401, "unknown-entitlement", None, None)
        tokens = input_tokens + (self.default_max_tokens if max_tokens is None else max_tokens)
        room = self.in_flight < self.concurrency
        may_burst = room and e.service_class != "guaranteed"
        if len(e.in_flight) >= e.concurrency and not may_burst:
            return (429, "concurrency", max(1 / self._rate(e), 0.05), None)
        while e.window and e.window[0][0] + self.window_s <= now:
            e.window_tokens -= e.window.popleft()[2]
        limit = e.tokens_per_s * self.window_s
        excess = e.window_tokens + tokens - limit
        if excess > 0 and not may_burst:
            if tokens > limit:
                return (413, "exceeds-token-budget", None, None)
            freed = 0
            for at, _, t in e.window:
                freed += t
                if freed >= excess:
                    return (429, "token-budget", max(at + self.window_s - now, 0.05), None)
        if not room:
            busy = [o for o in self.ents.values() if o.in_flight]
            if e.priority <= min(o.priority for o in busy):
                rate = sum(self._rate(o) for o in busy)
                return (429, "quota-contention", max(1 / rate, 0.05), None)
        ticket = self.next_ticket
        self.next_ticket += 1
        e.in_flight[ticket] = (now, tokens)
        e.tokens_in_flight += tokens
        e.window.append([now, ticket, tokens])
        e.window_tokens += tokens
        self.tickets[ticket] = e
        self.in_flight += 1
        return (200, "admitted", None, ticket)

    def complete(self, ticket, actual_input, actual_output, latency_s, now):
        e = self.tickets.pop(ticket)
        actual = actual_input + actual_output
        decay = 1.0 if e.served_at is None else math.exp(-(now - e.served_at) / self.window_s)
        e.served_rate = e.served_rate * decay + actual / self.window_s
        e.served_at = now
        delta = max(e.served_rate / e.tokens_per_s - 1, 0) + max(
            len(e.in_flight) / e.concurrency - 1, 0
        )
        e.burst = 0.9 * e.burst + 0.1 * delta
        if e.service_class in ("dedicated", "guaranteed", "elastic"):
            e.debt = 0.7 * e.debt + 0.3 * (e.tokens_per_s - e.served_rate) / e.tokens_per_s
        e.latency = latency_s if e.latency is None else 0.7 * e.latency + 0.3 * latency_s
        self._give_back(e, ticket, actual)
        self._reprioritise(e)

    def release(self, ticket, now):
        """Ends an admitted request that was never served: its slot and its
        window charge are given back, and nothing is learned."""
        self._give_back(self.tickets.pop(ticket), ticket, 0)

    def _give_back(self, e, ticket, actual):
        """Takes ``ticket`` out of flight, its window charge set to ``actual``."""
        _, tokens = e.in_flight.pop(ticket)
        e.tokens_in_flight -= tokens
        for charge in reversed(e.window):
            if charge[1] == ticket:
                e.window_tokens += actual - charge[2]
                charge[2] = actual
                break
        self.in_flight -= 1
