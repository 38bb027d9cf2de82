"""Plain-Python twin of ``EndpointPicker.pick_pair`` with the ``always``
decider over the ``prefix+queue+kv`` preset (ties to the first endpoint):
the decode endpoint by the pool's pipeline among the endpoints that decode,
then the prefill endpoint among the others that prefill (healthy and
saturation filters; prefix at weight 2 on the shared index, queue depth
and load at weight 1; the highest total, ties to the least loaded), both
started (in flight, blocks recorded), as docs/disaggregation.md describes."""

from routecore._baselines.pick import EndpointPicker
from routecore._baselines.prefix import block_hashes


class SplitPicker(EndpointPicker):
    def __init__(self, endpoints, roles, **kw):
        super().__init__(endpoints, preset="prefix+queue+kv", **kw)
        self.roles = [roles.get(e, "both") for e in self.endpoints]

    def pick_pair(self, tokens):
        """(decode, prefill) endpoint names; prefill None when none can."""
        # The prompt hashed once for both phases.
        hashes = block_hashes(tokens, self.block_size)
        # The decode phase: the pipeline over the endpoints that decode.
        hidden = [i for i, r in enumerate(self.roles) if r == "prefill"]
        kept = [self.states[i]["healthy"] for i in hidden]
        for i in hidden:
            self.states[i]["healthy"] = False
        try:
            decode = self.pick(tokens, hashes)
        finally:
            for i, h in zip(hidden, kept):
                self.states[i]["healthy"] = h
        if decode is None:
            return None, None
        d = self.endpoints.index(decode)
        cand = [
            i
            for i, s in enumerate(self.states)
            if i != d and self.roles[i] != "decode" and s["healthy"]
        ]
        cand = [i for i in cand if not self.saturated(self.states[i])] or cand
        if not cand:
            return decode, None
        states = [self.states[i] for i in cand]
        total = [0.0] * len(cand)
        self.add_prefix(total, hashes, cand, 2.0)
        for values in ([self.queue(s) for s in states], [self.load(s) for s in states]):
            for k, v in enumerate(self.lower_is_better(values)):
                total[k] += v
        best = max(range(len(cand)), key=lambda k: (total[k], -self.load(states[k]), -cand[k]))
        p = cand[best]
        self.index.record(hashes, self.endpoints[p])
        self.states[p]["in_flight"] += 1
        self.states[p]["dispatched"] += 1
        return decode, self.endpoints[p]
