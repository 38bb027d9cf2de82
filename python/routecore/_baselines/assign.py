"""RouteBalance's batched assignment in plain Python, the same algorithm as
routecore's BatchScheduler (LPT order, budget filter, Eq. 1 score, ties by
batch size then recency, dead reckoning), written the way a Python scheduler
would; and the kNN estimator's computation in NumPy."""

from __future__ import annotations

import numpy as np


class BatchScheduler:
    def __init__(self, endpoints, weights):
        # endpoints: (model_index, tpot_s, price_in, price_out, max_batch, prefill_s_per_token)
        self.endpoints = endpoints
        total = sum(weights)
        self.wq, self.wl, self.wc = (w / total for w in weights)
        self.last = [0] * len(endpoints)
        self.clock = 0

    def assign(self, quality, out_len, in_tokens, budget, pending, batch):
        pending, batch = list(pending), list(batch)
        order = sorted(range(len(in_tokens)), key=lambda r: -max(out_len[r]))
        chosen = [-1] * len(in_tokens)
        for r in order:
            tokens = in_tokens[r]
            limit = float("inf") if budget is None else budget[r]
            cands = []
            for i, (m, tpot, p_in, p_out, max_batch, prefill) in enumerate(self.endpoints):
                out = out_len[r][m]
                cost = (tokens * p_in + out * p_out) / 1e6
                if cost > limit:
                    continue
                wait = pending[i] / max(batch[i], 1) * tpot if batch[i] >= max_batch else 0.0
                cands.append((i, quality[r][m], tokens * prefill + wait + out * tpot, cost))
            if not cands:
                continue
            max_lat = max(c[2] for c in cands)
            max_cost = max(c[3] for c in cands)
            best, best_key = -1, None
            for i, q, lat, cost in cands:
                score = (
                    self.wq * q
                    + self.wl * (1 - lat / max_lat if max_lat > 0 else 1)
                    + self.wc * (1 - cost / max_cost if max_cost > 0 else 1)
                )
                if best_key is None or score > best_key[0] + 1e-12:
                    better = True
                elif abs(score - best_key[0]) <= 1e-12:
                    better = (batch[i], self.last[i]) < (batch[best], self.last[best])
                else:
                    better = False
                if better:
                    best, best_key = i, (score,)
            pending[best] += out_len[r][self.endpoints[best][0]]
            batch[best] += 1
            self.clock += 1
            self.last[best] = self.clock
            chosen[r] = best
        return chosen


class Knn:
    """Distance-weighted cosine kNN in NumPy: rows normalised at fit; predict
    is one matrix product, an argpartition and a weighted mean."""

    def __init__(self, k, train, quality, out_len):
        self.k = k
        self.train = train / np.linalg.norm(train, axis=1, keepdims=True)
        self.quality, self.out_len = quality, out_len

    def predict(self, queries):
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        sims = queries @ self.train.T
        top = np.argpartition(-sims, self.k - 1, axis=1)[:, : self.k]
        w = 1.0 / (1.0 - np.take_along_axis(sims, top, axis=1).astype(np.float64) + 1e-6)
        w /= w.sum(axis=1, keepdims=True)
        return (
            np.einsum("bk,bkm->bm", w, self.quality[top]),
            np.einsum("bk,bkm->bm", w, self.out_len[top]),
        )
