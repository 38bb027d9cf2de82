"""Plain-Python endpoint picker: the `queue+kv`, `prefix+queue+kv`,
`precise-prefix+queue+kv` and `prefix` presets (healthy and saturation
filters; prefix, queue-depth and KV-use scorers, weights 3, 2, 2, or the
prefix scorer alone; the highest total, ties to the first, or to the least
loaded for `prefix`) with the same rules as routecore.EndpointPicker, over
per-endpoint dicts of scraped state. The precise preset reads `held`: the
block hashes each endpoint's engine holds (what its KV events said), for the
endpoints whose event stream is live."""

from routecore._baselines.prefix import PrefixIndex, block_hashes

WEIGHTS = {
    "queue+kv": {"prefix": 0.0, "queue": 2.0, "kv": 2.0},
    "prefix+queue+kv": {"prefix": 3.0, "queue": 2.0, "kv": 2.0},
    "precise-prefix+queue+kv": {"prefix": 3.0, "queue": 2.0, "kv": 2.0},
    "prefix": {"prefix": 1.0, "queue": 0.0, "kv": 0.0},
}


class EndpointPicker:
    def __init__(
        self,
        endpoints,
        preset="prefix+queue+kv",
        block_size=16,
        imbalance_abs_count=16,
        std_factor=2.0,
        max_waiting=5.0,
        max_kv_usage=0.8,
        held=None,
    ):
        self.preset = preset
        self.held = held or {}
        self.w = WEIGHTS[preset]
        self.endpoints = list(endpoints)
        self.states = [
            {
                "healthy": True,
                "in_flight": 0,
                "dispatched": 0,
                "waiting": None,
                "running": None,
                "kv_usage": None,
            }
            for _ in self.endpoints
        ]
        self.index = PrefixIndex() if self.w["prefix"] else None
        self.block_size = block_size
        self.imbalance = imbalance_abs_count
        self.std_factor = std_factor
        self.max_waiting, self.max_kv = max_waiting, max_kv_usage

    def set_state(self, endpoint, waiting, running, kv_usage):
        s = self.states[self.endpoints.index(endpoint)]
        s.update(waiting=waiting, running=running, kv_usage=kv_usage, dispatched=0)

    @staticmethod
    def load(s):
        if s["waiting"] is None or s["running"] is None:
            return s["in_flight"]
        return s["waiting"] + s["running"] + s["dispatched"]

    @staticmethod
    def queue(s):
        return s["in_flight"] if s["waiting"] is None else s["waiting"] + s["dispatched"]

    def saturated(self, s):
        q = None if s["waiting"] is None else s["waiting"] + s["dispatched"]
        return (q is not None and q > self.max_waiting) or (
            s["kv_usage"] is not None and s["kv_usage"] > self.max_kv
        )

    @staticmethod
    def lower_is_better(values):
        lo, hi = min(values), max(values)
        return [(hi - v) / (hi - lo) if hi > lo else 1.0 for v in values]

    def add_prefix(self, total, hashes, cand, weight):
        """Adds the prefix scorer's score of each candidate, times ``weight``."""
        states = [self.states[i] for i in cand]
        matched = self.index.match(hashes, [self.endpoints[i] for i in cand])
        loads = [self.load(s) for s in states]
        if hashes and max(loads) - min(loads) <= self.imbalance:
            mean = sum(loads) / len(loads)
            std = (sum((x - mean) ** 2 for x in loads) / len(loads)) ** 0.5
            limit = mean + self.std_factor * std
            for k, i in enumerate(cand):
                m = matched[self.endpoints[i]]
                if m > 0 and loads[k] <= limit and self.endpoints[i] not in self.held:
                    total[k] += weight * m / len(hashes)
        for k, i in enumerate(cand):
            held = self.held.get(self.endpoints[i])
            if held is not None and hashes:  # no load guard on what an engine holds
                m = next((j for j, h in enumerate(hashes) if h not in held), len(hashes))
                total[k] += weight * m / len(hashes)

    def pick(self, tokens=None, hashes=None):
        """The chosen endpoint's name; ``hashes``: the prompt's block hashes
        when the caller has them already (else hashed from ``tokens``)."""
        cand = [i for i, s in enumerate(self.states) if s["healthy"]]
        if self.preset != "prefix":
            kept = [i for i in cand if not self.saturated(self.states[i])]
            cand = kept or cand
        if not cand:
            return None
        states = [self.states[i] for i in cand]
        total = [0.0] * len(cand)
        if self.index is not None:
            if hashes is None:
                hashes = block_hashes(tokens, self.block_size) if tokens is not None else []
            self.add_prefix(total, hashes, cand, self.w["prefix"])
        if self.w["queue"]:
            for k, q in enumerate(self.lower_is_better([self.queue(s) for s in states])):
                total[k] += self.w["queue"] * q
        if self.w["kv"]:
            for k, s in enumerate(states):
                kv = s["kv_usage"]
                total[k] += self.w["kv"] * (0.5 if kv is None else min(max(1.0 - kv, 0.0), 1.0))
        if self.preset == "prefix":
            key = lambda k: (total[k], -self.load(states[k]), -cand[k])  # noqa: E731
        else:
            key = lambda k: (total[k], -cand[k])  # noqa: E731
        best = max(range(len(cand)), key=key)
        chosen = cand[best]
        if self.index is not None:
            self.index.record(hashes, self.endpoints[chosen])
        s = self.states[chosen]
        s["in_flight"] += 1
        s["dispatched"] += 1
        return self.endpoints[chosen]
