"""The fleet simulator's model in plain Python: one pool of vLLM-style
continuous-batching endpoints stepped iteration by iteration (as the papers'
own eval/simulator.py does), least-request dispatch (the fewest requests
running or waiting, the first on ties: routecore's endpoint picker's preset),
the same rules as routecore's `sim` module: FCFS admission when a slot and the
prompt's 16-token KV blocks are free, decode reservation that preempts the
newest sequence, one prefill chunk of C tokens per iteration shared in
admission order, t_iter = W + H * n_active, the first token sampled by the
iteration that finishes the prompt.

With ``fast_forward`` it also plans runs of identical decode iterations as
one stretch, as routecore's simulator does (every running sequence decoding
and the free blocks holding each to its last token: the iterations until the
first of them finishes all last the same; a request dispatched during the
stretch cuts it at the next iteration boundary). The same outcome in far
fewer events: routecore's algorithm in Python, so that the language and the
algorithm can be timed apart."""

from __future__ import annotations

import heapq
import math
from collections import deque


def blocks(tokens):
    return -(-tokens // 16)


class Seq:
    __slots__ = ("req", "inp", "out", "gen", "prompt", "done", "blocks")

    def __init__(self, req, inp, out):
        self.req, self.inp, self.out = req, inp, out
        self.gen, self.prompt, self.done, self.blocks = 0, inp, 0, 0


class Endpoint:
    def __init__(self, slots, kv_blocks, chunk, fast_forward=False):
        self.slots, self.free, self.chunk = slots, kv_blocks, chunk
        self.fast_forward = fast_forward
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.leaving: list[Seq] = []
        self.stretch = None  # (start, dt, iterations) of a planned stretch

    def load(self):
        return len(self.running) + len(self.waiting)

    def preempt_last(self):
        s = self.running.pop()
        self.free += s.blocks
        s.blocks, s.done, s.prompt = 0, 0, s.inp + s.gen
        self.waiting.appendleft(s)

    def step(self, now, w, h, first_token, admitted):
        """Plans one iteration at `now`; returns its duration or None."""
        while self.waiting:
            head = self.waiting[0]
            need = blocks(head.prompt)
            if len(self.running) >= self.slots or need > self.free:
                break
            self.waiting.popleft()
            self.free -= need
            head.blocks = need
            if math.isnan(admitted[head.req]):
                admitted[head.req] = now
            self.running.append(head)
        if self.fast_forward and (dt := self.plan_stretch(now, w, h)) is not None:
            return dt
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if s.done == s.prompt:
                extra = blocks(s.inp + s.gen) - s.blocks
                while extra > self.free and len(self.running) > i + 1:
                    self.preempt_last()
                if extra > self.free:
                    self.preempt_last()
                    break
                self.free -= extra
                s.blocks += extra
            i += 1
        budget, active = self.chunk, 0
        for s in self.running:
            if s.done < s.prompt:
                if budget == 0:
                    continue
                take = min(budget, s.prompt - s.done)
                s.done += take
                budget -= take
                if s.done < s.prompt:
                    active += 1
                    continue
            active += 1
            s.gen += 1
        if active == 0:
            return None
        dt = w + h * active
        end = now + dt
        keep = []
        for s in self.running:
            if s.done == s.prompt:
                if s.gen == 1 and s.prompt == s.inp:
                    first_token[s.req] = end
                if s.gen >= s.out:
                    self.leaving.append(s)
                    continue
            keep.append(s)
        self.pending = keep
        return dt

    def plan_stretch(self, now, w, h):
        """A stretch of identical decode iterations from ``now``, if every
        running sequence decodes and the free blocks hold each to its end;
        returns its length in seconds."""
        if not self.running or any(s.done < s.prompt for s in self.running):
            return None
        need = sum(blocks(s.inp + s.out - 1) - s.blocks for s in self.running)
        if need > self.free:
            return None
        dt = w + h * len(self.running)
        iterations = min(s.out - s.gen for s in self.running)
        self.stretch = (now, dt, iterations)
        return dt * iterations

    def interrupt(self, now):
        """A request was queued at ``now`` during a stretch: cut it at the first
        iteration boundary at or after ``now``; the new end, if it moved."""
        if self.stretch is None:
            return None
        start, dt, iterations = self.stretch
        done = max(math.ceil((now - start) / dt), 1)
        if done >= iterations:
            return None
        self.stretch = (start, dt, done)
        return start + dt * done

    def end(self, finished, now):
        if self.stretch is not None:
            _, _, iterations = self.stretch
            self.stretch = None
            keep = []
            for s in self.running:
                s.gen += iterations
                grown = blocks(s.inp + s.gen - 1)
                self.free -= grown - s.blocks
                s.blocks = grown
                (self.leaving if s.gen >= s.out else keep).append(s)
            self.pending = keep
        self.running = self.pending
        for s in self.leaving:
            self.free += s.blocks
            finished[s.req] = now
        self.leaving = []


def simulate(arrival, inp, out, endpoints, slots, max_context, w=0.008, h=0.00065, chunk=512,
             fast_forward=False):  # fmt: skip
    """Returns (ttft, e2e) lists, NaN for requests above max_context."""
    n = len(arrival)
    nan = float("nan")
    first, finished, admitted = [nan] * n, [nan] * n, [nan] * n
    kv_blocks = slots * blocks(max_context)
    pool = [Endpoint(slots, kv_blocks, chunk, fast_forward) for _ in range(endpoints)]
    heap: list[tuple[float, int, int]] = []
    version = [0] * endpoints
    k = 0
    while k < n or heap:
        if k < n and (not heap or arrival[k] <= heap[0][0]):
            t = arrival[k]
            if inp[k] + out[k] <= max_context:
                best = min(range(endpoints), key=lambda c: pool[c].load())
                inst = pool[best]
                inst.waiting.append(Seq(k, int(inp[k]), int(out[k])))
                wake = inst.interrupt(t) if inst.busy else t
                if not inst.busy:
                    inst.busy = True
                    inst.pending = inst.running
                if wake is not None:
                    version[best] += 1
                    heapq.heappush(heap, (wake, best, version[best]))
            k += 1
            continue
        t, i, v = heapq.heappop(heap)
        if v != version[i]:
            continue
        inst = pool[i]
        inst.end(finished, t)
        dt = inst.step(t, w, h, first, admitted)
        if dt is None:
            inst.busy = False
        else:
            version[i] += 1
            heapq.heappush(heap, (t + dt, i, version[i]))
    ttft = [f - a for f, a in zip(first, arrival)]
    e2e = [f - a for f, a in zip(finished, arrival)]
    return ttft, e2e
