"""Plain-Python precise prefix index: the twin of routecore.KvEventIndex.

It applies vLLM's KV events as msgpack decodes them (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` arrays) and answers, per endpoint, how
many of a prompt's leading blocks its engine holds, with the same rules:
blocks keyed by routecore's chained xxh3 block hashes of the events' token
ids (a LoRA adapter's from a seed of its own), one dict from our hash to the
endpoints holding it as a bitmask, a dict per endpoint from the engine's
hash to ours (in store order: past ``capacity_blocks``, after an event, the
least recently stored eighth goes), a block held while the engine holds it
under any of its hashes. A query hashes the prompt block by block while some
endpoint still holds every block so far (one walk for all endpoints).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

MEDIUM_GPU = "GPU"


def lora_seed(seed: int, lora: str | None) -> int:
    return seed if lora is None else xxhash.xxh3_64_intdigest(lora.encode(), seed)


class KvIndex:
    def __init__(
        self,
        endpoints: Sequence[str],
        block_size: int = 16,
        seed: int = 0,
        capacity_blocks: int = 262144,
    ) -> None:
        self.names = list(endpoints)
        self.ids = {e: i for i, e in enumerate(self.names)}
        self.block_size = block_size
        self.seed = seed
        self.capacity = capacity_blocks
        #: our hash -> the endpoints holding it, a bit per endpoint id.
        self.holders: dict[int, int] = {}
        #: per endpoint, engine hash -> our hash, least recently stored first.
        self.blocks: list[dict[int, int]] = [{} for _ in self.names]
        #: per endpoint, our hash -> how many of its engine hashes name it.
        self.names_of: list[dict[int, int]] = [{} for _ in self.names]

    def _hold(self, p: int, ours: int) -> None:
        n = self.names_of[p]
        n[ours] = n.get(ours, 0) + 1
        if n[ours] == 1:
            self.holders[ours] = self.holders.get(ours, 0) | 1 << p

    def _release(self, p: int, ours: int) -> None:
        n = self.names_of[p]
        n[ours] -= 1
        if n[ours] == 0:
            del n[ours]
            rest = self.holders[ours] & ~(1 << p)
            if rest:
                self.holders[ours] = rest
            else:
                del self.holders[ours]

    def _clear(self, p: int) -> None:
        for ours in self.names_of[p]:
            rest = self.holders[ours] & ~(1 << p)
            if rest:
                self.holders[ours] = rest
            else:
                del self.holders[ours]
        self.blocks[p].clear()
        self.names_of[p].clear()

    def apply(self, endpoint: str, events: Iterable[list]) -> None:
        """Applies one batch's events (msgpack-decoded arrays)."""
        p = self.ids[endpoint]
        blocks = self.blocks[p]
        bs = self.block_size
        for e in events:
            tag = e[0]
            if tag == "BlockStored":
                hashes, parent, tokens, size = e[1], e[2], e[3], e[4]
                medium = e[6] if len(e) > 6 else None
                lora = e[7] if len(e) > 7 and e[7] is not None else None
                if lora is None and len(e) > 5 and e[5] is not None:
                    lora = f"#{e[5]}"
                if size != bs or (medium not in (None, MEDIUM_GPU)):
                    continue
                if len(tokens) != len(hashes) * bs:
                    continue
                seed = lora_seed(self.seed, lora)
                if parent is None:
                    prev = seed
                elif parent in blocks:
                    prev = blocks[parent]
                else:
                    continue
                data = np.asarray(tokens, dtype="<u4").tobytes()
                step = 4 * bs
                for i, h in enumerate(hashes):
                    prev = xxhash.xxh3_64_intdigest(
                        prev.to_bytes(8, "little") + data[i * step : (i + 1) * step], seed
                    )
                    old = blocks.pop(h, None)
                    blocks[h] = prev
                    if old != prev:
                        if old is not None:
                            self._release(p, old)
                        self._hold(p, prev)
                # Per event: a batch never holds more than one event's blocks
                # past the capacity.
                if len(blocks) > self.capacity:
                    keep = self.capacity - self.capacity // 8
                    for h in list(blocks)[: len(blocks) - keep]:
                        self._release(p, blocks.pop(h))
            elif tag == "BlockRemoved":
                if len(e) > 2 and e[2] not in (None, MEDIUM_GPU):
                    continue
                for h in e[1]:
                    ours = blocks.pop(h, None)
                    if ours is not None:
                        self._release(p, ours)
            elif tag == "AllBlocksCleared":
                self._clear(p)

    def leading_blocks(self, token_ids: np.ndarray, adapter: str | None = None) -> dict[str, int]:
        """Per endpoint, how many of the prompt's leading blocks it holds."""
        seed = lora_seed(self.seed, adapter)
        data = np.asarray(token_ids, dtype="<u4").tobytes()
        step = 4 * self.block_size
        held = dict.fromkeys(self.names, 0)
        alive = (1 << len(self.names)) - 1
        prev, n = seed, 0
        holders = self.holders
        for start in range(0, len(data) - step + 1, step):
            prev = xxhash.xxh3_64_intdigest(
                prev.to_bytes(8, "little") + data[start : start + step], seed
            )
            kept = alive & holders.get(prev, 0)
            gone = alive & ~kept
            while gone:
                low = gone & -gone
                if n:
                    held[self.names[low.bit_length() - 1]] = n
                gone ^= low
            alive = kept
            if not alive:
                return held
            n += 1
        while alive:
            low = alive & -alive
            held[self.names[low.bit_length() - 1]] = n
            alive ^= low
        return held
