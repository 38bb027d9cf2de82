"""Plain-Python prefix-cache-aware routing: the same chained xxh3 block hashes
(one `xxhash` call per block), a dict + OrderedDict LRU index, and the same
decision rule as routecore.PrefixCacheRouter."""

from collections import OrderedDict

import numpy as np
import xxhash


def block_hashes(tokens: np.ndarray, block_size: int, seed: int = 0) -> list[int]:
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    out, prev = [], seed
    for start in range(0, len(data) - step + 1, step):
        prev = xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + data[start : start + step], seed
        )
        out.append(prev)
    return out


class PrefixIndex:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.blocks: OrderedDict[int, set[str]] = OrderedDict()

    def match(self, hashes: list[int], endpoints: list[str]) -> dict[str, int]:
        matched = dict.fromkeys(endpoints, 0)
        alive = set(endpoints)
        for i, h in enumerate(hashes):
            holders = self.blocks.get(h)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            for p in alive:
                matched[p] = i + 1
        return matched

    def record(self, hashes: list[int], endpoint: str) -> None:
        for h in reversed(hashes):
            holders = self.blocks.get(h)
            if holders is None:
                if len(self.blocks) >= self.capacity:
                    self.blocks.popitem(last=False)
                holders = self.blocks[h] = set()
            holders.add(endpoint)
            self.blocks.move_to_end(h)


class PrefixCacheRouter:
    def __init__(self, endpoints, block_size=16, imbalance_abs_count=16, std_factor=2.0):
        self.endpoints = list(endpoints)
        self.running = [0] * len(self.endpoints)
        self.block_size = block_size
        self.imbalance = imbalance_abs_count
        self.std_factor = std_factor
        self.index = PrefixIndex()

    def route(self, tokens) -> tuple[str, float]:
        hashes = block_hashes(tokens, self.block_size)
        run = self.running
        n = len(run)
        least = min(range(n), key=lambda i: (run[i], i))
        matched = self.index.match(hashes, self.endpoints)
        endpoint = least
        if max(run) - min(run) <= self.imbalance:
            mean = sum(run) / n
            std = (sum((r - mean) ** 2 for r in run) / n) ** 0.5
            limit = mean + self.std_factor * std
            order = sorted(
                (i for i in range(n) if matched[self.endpoints[i]] > 0),
                key=lambda i: (-matched[self.endpoints[i]], run[i], i),
            )
            endpoint = next((i for i in order if run[i] <= limit), least)
        self.index.record(hashes, self.endpoints[endpoint])
        run[endpoint] += 1
        fraction = matched[self.endpoints[endpoint]] / len(hashes) if hashes else 0.0
        return self.endpoints[endpoint], fraction
