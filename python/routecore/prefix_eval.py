"""A workload with real prefix structure and a per-pod LRU KV-cache model, to
compare prefix-cache-aware routing with least-request, random and
consistent-hash routing.

The workload (``generate_workload``, seeded, deterministic):

- ``apps`` applications, each with its own system prompt of
  ``system_tokens`` tokens (uniform in the range);
- ``users`` users, each using one application (uniformly assigned);
- ``concurrency`` conversations are open at any time; a request picks one of
  them uniformly, appends a user message of ``user_tokens`` tokens to its
  context and sends ``system prompt + history + message``; the reply of
  ``reply_tokens`` tokens joins the history, so the context grows turn by
  turn; after ``turns`` turns (uniform in the range) the conversation closes
  and a new one opens for a random user;
- arrivals are Poisson at ``rate`` requests/s; token ids are uniform in
  ``[0, vocab)``.

The model (``evaluate``): each pod keeps an LRU cache of ``cache_blocks`` KV
blocks of ``block_size`` tokens, keyed by the chained block hashes
(``block_hashes``). A request's prompt tokens served from cache are its
leading full blocks the pod already holds, up to the first miss (vLLM's
automatic prefix caching); afterwards the pod holds every full block of the
prompt and its reply. A request runs for ``prefill_s_per_token`` per
uncached prompt token plus ``decode_s_per_token`` per output token; the load
of a pod is its count of running requests. Reported: the prefix hit rate
(prompt tokens served from cache / prompt tokens) and the load balance (max /
mean running over pods, averaged over arrivals), per policy.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from routecore._core import PrefixCacheRouter, block_hashes_many

POLICIES = ("prefix-cache", "least-request", "random", "consistent-hash")


@dataclass
class Workload:
    """Requests in arrival order.

    ``tokens[offsets[i]:offsets[i + 1]]`` is request ``i``'s prompt followed
    by its reply; the first ``prompt_tokens[i]`` of them are the prompt.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray
    conversation: np.ndarray
    app: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def prompt(self, i: int) -> np.ndarray:
        start = self.offsets[i]
        return self.tokens[start : start + self.prompt_tokens[i]]


def generate_workload(
    requests: int = 2000,
    apps: int = 8,
    users: int = 200,
    concurrency: int = 64,
    system_tokens: tuple[int, int] = (512, 2048),
    user_tokens: tuple[int, int] = (20, 300),
    reply_tokens: tuple[int, int] = (50, 400),
    turns: tuple[int, int] = (1, 8),
    rate: float = 20.0,
    vocab: int = 50_000,
    seed: int = 0,
) -> Workload:
    """The workload described in the module docstring."""
    if requests < 1 or apps < 1 or users < 1 or concurrency < 1 or rate <= 0 or vocab < 1:
        raise ValueError("requests, apps, users, concurrency, rate and vocab must be positive")
    for name, (lo, hi) in [
        ("system_tokens", system_tokens),
        ("user_tokens", user_tokens),
        ("reply_tokens", reply_tokens),
        ("turns", turns),
    ]:
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    rng = np.random.default_rng(seed)

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, vocab, n, dtype=np.uint32)

    def length(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    system = [ids(length(system_tokens)) for _ in range(apps)]
    user_app = rng.integers(0, apps, users)
    next_id = 0

    def open_conversation() -> dict:
        nonlocal next_id
        app = int(user_app[rng.integers(0, users)])
        next_id += 1
        return {"id": next_id - 1, "app": app, "context": [system[app]], "left": length(turns)}

    open_ = [open_conversation() for _ in range(concurrency)]
    parts, prompt_len, out_len, conv, app = [], [], [], [], []
    for _ in range(requests):
        k = int(rng.integers(0, concurrency))
        c = open_[k]
        c["context"].append(ids(length(user_tokens)))
        prompt = np.concatenate(c["context"])
        reply = ids(length(reply_tokens))
        c["context"].append(reply)
        parts += [prompt, reply]
        prompt_len.append(len(prompt))
        out_len.append(len(reply))
        conv.append(c["id"])
        app.append(c["app"])
        c["left"] -= 1
        if c["left"] == 0:
            open_[k] = open_conversation()
    sizes = np.array(prompt_len) + np.array(out_len)
    return Workload(
        tokens=np.concatenate(parts),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        prompt_tokens=np.array(prompt_len, dtype=np.int64),
        output_tokens=np.array(out_len, dtype=np.int64),
        arrival_s=np.cumsum(rng.exponential(1.0 / rate, requests)),
        conversation=np.array(conv, dtype=np.int64),
        app=np.array(app, dtype=np.int64),
    )


def _hash64(key: bytes) -> int:
    """A 64-bit hash of ``key`` (BLAKE2b, from the standard library)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class ConsistentHash:
    """A hash ring with ``vnodes`` points per pod (a 64-bit hash of
    ``pod-p#i``); a key goes to the first point at or after its hash."""

    def __init__(self, pods: int, vnodes: int = 100):
        points = sorted(
            (_hash64(f"pod-{p}#{v}".encode()), p) for p in range(pods) for v in range(vnodes)
        )
        self.hashes = [h for h, _ in points]
        self.pods = [p for _, p in points]

    def pod(self, key: bytes) -> int:
        i = int(np.searchsorted(self.hashes, _hash64(key)))
        return self.pods[i % len(self.pods)]


Chooser = Callable[[int, np.ndarray, float], int]


def make_policy(name: str, pods: int, workload: Workload, block_size: int, seed: int) -> Chooser:
    """``choose(request index, running counts, now) -> pod``."""
    if name == "prefix-cache":
        router = PrefixCacheRouter([f"pod-{p}" for p in range(pods)], block_size=block_size)
        return lambda i, running, now: router.endpoints.index(
            router.route(workload.prompt(i), running, now)[0]
        )
    if name == "least-request":
        return lambda i, running, now: int(np.argmin(running))
    if name == "random":
        rng = np.random.default_rng(seed)
        return lambda i, running, now: int(rng.integers(0, pods))
    if name == "consistent-hash":
        ring = ConsistentHash(pods)
        return lambda i, running, now: ring.pod(str(workload.conversation[i]).encode())
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")


@dataclass
class Result:
    policy: str
    hit_rate: float
    load_max_over_mean: float
    busiest_pod_share: float


def evaluate(
    workload: Workload,
    policy: str,
    pods: int = 8,
    block_size: int = 16,
    cache_blocks: int = 8192,
    prefill_s_per_token: float = 0.0002,
    decode_s_per_token: float = 0.02,
    seed: int = 0,
) -> Result:
    """Runs the workload through one policy in the LRU cache model."""
    if pods < 1 or block_size < 1 or cache_blocks < 1:
        raise ValueError("pods, block_size and cache_blocks must be positive")
    hashes, hash_offsets = block_hashes_many(workload.tokens, workload.offsets, block_size)
    choose = make_policy(policy, pods, workload, block_size, seed)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pods)]
    running = np.zeros(pods, dtype=np.int64)
    done: list[tuple[float, int]] = []
    served = np.zeros(pods, dtype=np.int64)
    hit = total = 0
    ratios = []
    for i in range(len(workload)):
        now = float(workload.arrival_s[i])
        while done and done[0][0] <= now:
            running[heapq.heappop(done)[1]] -= 1
        pod = choose(i, running.copy(), now)
        cache = caches[pod]
        blocks = hashes[hash_offsets[i] : hash_offsets[i + 1]].tolist()
        prompt_blocks = int(workload.prompt_tokens[i]) // block_size
        matched = 0
        while matched < prompt_blocks and blocks[matched] in cache:
            matched += 1
        # Last block first, so a prefix's first blocks are evicted last (as
        # vLLM frees a finished request's blocks tail first).
        for h in reversed(blocks):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > cache_blocks:
            cache.popitem(last=False)
        cached = matched * block_size
        hit += cached
        total += int(workload.prompt_tokens[i])
        duration = prefill_s_per_token * (
            int(workload.prompt_tokens[i]) - cached
        ) + decode_s_per_token * int(workload.output_tokens[i])
        running[pod] += 1
        served[pod] += 1
        heapq.heappush(done, (now + duration, pod))
        ratios.append(running.max() / running.mean())
    return Result(
        policy=policy,
        hit_rate=hit / total,
        load_max_over_mean=float(np.mean(ratios)),
        busiest_pod_share=float(served.max() / served.mean()),
    )


def markdown_table(results: Sequence[Result]) -> str:
    lines = [
        "| policy | prefix hit rate | load: max / mean running | busiest pod: requests / mean |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.load_max_over_mean:.2f} "
            f"| {r.busiest_pod_share:.2f} |"
        )
    return "\n".join(lines)
