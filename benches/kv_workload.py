"""The KV-event workload of the precise prefix index's benchmarks (issue 28):
``endpoints`` engines, each a vLLM-like LRU cache of ``capacity`` blocks of
16 tokens, serve 8,192-token prompts, each one of 32 shared system prompts
(1,024-4,096 tokens) followed by tokens of its own, sent to an endpoint
chosen at random, until ``stored`` blocks were stored. Every engine
publishes what its cache does as vLLM's KV events, one batch per prompt
served: a ``BlockRemoved`` per block it evicts (the least recently used,
a prompt's blocks freed last one first, as vLLM frees them), a
``BlockStored`` (with its parent) per run of new blocks. Engine block hashes
chain like vLLM's, from a salt of each engine, so they differ between engines
(as vLLM's do without a shared ``PYTHONHASHSEED``). Deterministic in
``seed``.

The queries are 8,192-token prompts that no engine saw: each system prompt
followed by new tokens (the prefix hit of a new conversation), and the last
32 prompts served (a prompt one engine holds whole, if it has not evicted
it).

``python benches/kv_workload.py OUT.json --endpoints 64`` writes the workload
as JSON for the benchmark crate benches/kv-dynamo (see its README).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

BLOCK = 16
PROMPT_TOKENS = 8192
SYSTEM_PROMPTS = 32
SYSTEM_TOKENS = (1024, 4096)
STORED = 100_000
#: Blocks all engines cache together (per engine at least two prompts).
FLEET_BLOCKS = 65_536
VOCAB = 50_000


@dataclass
class Workload:
    endpoints: list[str]
    block_size: int
    #: (endpoint index, sequence number, events as vLLM encodes them).
    batches: list[tuple[int, int, list]] = field(default_factory=list)
    #: New 8,192-token prompts, one per system prompt.
    queries: list[np.ndarray] = field(default_factory=list)
    #: The last prompts served.
    served: list[np.ndarray] = field(default_factory=list)
    stored: int = 0
    removed: int = 0
    #: The engines as the last batch left them (their caches: the truth).
    engines: list[_Engine] = field(default_factory=list, repr=False)

    def truth(self, prompt: np.ndarray) -> dict[str, int]:
        """Per endpoint, how many of `prompt`'s leading blocks its engine caches."""
        return {n: e.leading(prompt, self.block_size) for n, e in zip(self.endpoints, self.engines)}

    def to_json(self) -> dict:
        return {
            "endpoints": self.endpoints,
            "block_size": self.block_size,
            "batches": self.batches,
            "queries": [q.tolist() for q in self.queries],
            "served": [q.tolist() for q in self.served],
            "stored": self.stored,
            "removed": self.removed,
        }


class _Engine:
    """One engine's LRU block cache (engine hash -> True, oldest first)."""

    def __init__(self, index: int, capacity: int) -> None:
        self.salt = index.to_bytes(8, "little")
        self.capacity = capacity
        self.cache: OrderedDict[int, bool] = OrderedDict()
        self.seq = 0

    def hash(self, parent: int, block: bytes) -> int:
        digest = hashlib.blake2b(parent.to_bytes(8, "little") + block, key=self.salt, digest_size=8)
        # 63 bits: an integer every msgpack decoder reads as a signed one too.
        return int.from_bytes(digest.digest(), "little") >> 1

    def leading(self, prompt: np.ndarray, bs: int) -> int:
        """How many of `prompt`'s leading blocks the cache holds."""
        data = prompt.astype("<u4").tobytes()
        parent = 0
        for b in range(len(prompt) // bs):
            parent = self.hash(parent, data[4 * bs * b : 4 * bs * (b + 1)])
            if parent not in self.cache:
                return b
        return len(prompt) // bs

    def serve(self, prompt: np.ndarray, bs: int) -> tuple[list, int, int]:
        """The events of serving `prompt`, and the blocks stored and removed."""
        data = prompt.astype("<u4").tobytes()
        events: list = []
        stored = removed = 0
        run: list | None = None
        parent = 0
        first = True
        hashes: list[int] = []
        for b in range(len(prompt) // bs):
            h = self.hash(parent, data[4 * bs * b : 4 * bs * (b + 1)])
            if h in self.cache:
                self.cache.move_to_end(h)
                run = None
            else:
                if len(self.cache) >= self.capacity:
                    old, _ = self.cache.popitem(last=False)
                    events.append(["BlockRemoved", [old], "GPU"])
                    removed += 1
                self.cache[h] = True
                if run is None:
                    run = [
                        "BlockStored",
                        [],
                        None if first else parent,
                        [],
                        bs,
                        None,
                        "GPU",
                        None,
                    ]
                    events.append(run)
                run[1].append(h)
                run[3].extend(prompt[bs * b : bs * (b + 1)].tolist())
                stored += 1
            parent, first = h, False
            hashes.append(h)
        # Freed last block first, as vLLM frees a request's blocks: a prompt's
        # deepest blocks are evicted first and a parent outlives its children.
        for h in reversed(hashes):
            self.cache.move_to_end(h)
        return events, stored, removed


def generate(
    endpoints: int,
    stored: int = STORED,
    capacity: int | None = None,
    seed: int = 0,
) -> Workload:
    """The workload for `endpoints` engines of `capacity` blocks each
    (default: `FLEET_BLOCKS` shared out, at least two prompts each)."""
    rng = np.random.default_rng(seed)
    prompt_blocks = PROMPT_TOKENS // BLOCK
    capacity = capacity or max(2 * prompt_blocks, FLEET_BLOCKS // endpoints)
    systems = [
        rng.integers(0, VOCAB, int(rng.integers(SYSTEM_TOKENS[0], SYSTEM_TOKENS[1] + 1)), np.uint32)
        for _ in range(SYSTEM_PROMPTS)
    ]

    def prompt() -> np.ndarray:
        system = systems[int(rng.integers(SYSTEM_PROMPTS))]
        tail = rng.integers(0, VOCAB, PROMPT_TOKENS - len(system), np.uint32)
        return np.concatenate([system, tail])

    w = Workload([f"vllm-{i}" for i in range(endpoints)], BLOCK)
    engines = [_Engine(i, capacity) for i in range(endpoints)]
    served: list[np.ndarray] = []
    while w.stored < stored:
        p = prompt()
        e = int(rng.integers(endpoints))
        events, s, r = engines[e].serve(p, BLOCK)
        w.batches.append((e, engines[e].seq, events))
        engines[e].seq += 1
        w.stored += s
        w.removed += r
        served = [*served[-(SYSTEM_PROMPTS - 1) :], p]
    w.served = served
    w.engines = engines
    w.queries = [
        np.concatenate([s, rng.integers(0, VOCAB, PROMPT_TOKENS - len(s), np.uint32)])
        for s in systems
    ]
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--endpoints", type=int, default=64)
    ap.add_argument("--stored", type=int, default=STORED)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    w = generate(a.endpoints, stored=a.stored, seed=a.seed)
    with open(a.out, "w") as f:
        json.dump(w.to_json(), f)
    print(f"{a.out}: {len(w.batches)} batches, {w.stored} blocks stored, {w.removed} removed")


if __name__ == "__main__":
    main()
