"""Plain-Python flow-control queue with routecore.FlowQueue's discipline for
round-robin bands with FCFS flows (no limits, no TTL): weighted deficit
round robin across bands (the same turns, deficits and skipped rounds), a
deque of active flows per band (one request per turn), a deque of tickets
per flow. A cancelled request is dropped from the dict of waiting ones and
skipped when it surfaces; a flow emptied that way leaves its band's turns by
a new epoch, stale turn entries skipped the same way."""

import math
from collections import deque


class FlowQueue:
    def __init__(self, bands):
        """``bands``: (name, share) pairs, highest priority first."""
        self.names = [name for name, _ in bands]
        self.index = {name: b for b, name in enumerate(self.names)}
        self.share = [float(share) for _, share in bands]
        n = len(bands)
        self.flows = [{} for _ in range(n)]  # flow -> deque of tickets (stale included)
        self.live = [{} for _ in range(n)]  # flow -> waiting count
        self.epoch = [{} for _ in range(n)]  # flow -> epoch of its current turn entry
        self.turns = [deque() for _ in range(n)]  # (flow, epoch), stale included
        self.count = [0] * n
        self.deficit = [0.0] * n
        self.waiting = {}  # ticket -> (band, flow, cost, item, enqueued at)
        self.cursor, self.open, self.next = 0, False, 0

    def __len__(self):
        return len(self.waiting)

    def enqueue(self, band, flow, item, cost=1.0, now=0.0):
        b = self.index[band]
        t = self.next
        self.next += 1
        self.waiting[t] = (b, flow, cost, item, now)
        tickets = self.flows[b].get(flow)
        if tickets is None:
            tickets = self.flows[b][flow] = deque()
        tickets.append(t)
        live = self.live[b]
        live[flow] = live.get(flow, 0) + 1
        if live[flow] == 1:
            e = self.epoch[b].get(flow, 0) + 1
            self.epoch[b][flow] = e
            self.turns[b].append((flow, e))
        self.count[b] += 1
        return t

    def _head(self, b):
        """(flow, ticket) at the front of band b, stale entries dropped."""
        turns, epoch, flows, waiting = self.turns[b], self.epoch[b], self.flows[b], self.waiting
        while turns:
            flow, e = turns[0]
            if epoch[flow] != e:
                turns.popleft()
                continue
            tickets = flows[flow]
            while tickets[0] not in waiting:
                tickets.popleft()
            return flow, tickets[0]
        return None

    def _band(self):
        n = len(self.share)
        visits = 0
        while True:
            b = self.cursor
            head = self._head(b) if self.count[b] else None
            if head is not None:
                if not self.open:
                    self.deficit[b] += self.share[b]
                    self.open = True
                cost = self.waiting[head[1]][2]
                if cost <= self.deficit[b] + 1e-9 * cost:
                    return b, head
            else:
                self.deficit[b] = 0.0
            self.cursor = (b + 1) % n
            self.open = False
            visits += 1
            if visits == n:
                self._skip_rounds()
                visits = 0

    def _skip_rounds(self):
        fewest, closest = math.inf, 0
        heads = [self._head(b) if self.count[b] else None for b in range(len(self.share))]
        for b, head in enumerate(heads):
            if head is not None:
                missing = self.waiting[head[1]][2] - self.deficit[b]
                rounds = max(math.ceil(missing / self.share[b]), 1)
                if rounds < fewest:
                    fewest, closest = rounds, b
        for b, head in enumerate(heads):
            if head is not None:
                self.deficit[b] += (fewest - 1) * self.share[b]
        cost = self.waiting[heads[closest][1]][2]
        self.deficit[closest] = max(self.deficit[closest], cost - self.share[closest])

    def _leave(self, t, b, flow, cost):
        self.count[b] -= 1
        self.live[b][flow] -= 1
        if self.count[b] == 0:
            self.deficit[b] = 0.0
        return self.waiting.pop(t)

    def dispatch(self, now=0.0):
        if not self.waiting:
            return None
        b, (flow, t) = self._band()
        cost = self.waiting[t][2]
        self.deficit[b] -= cost
        self.turns[b].popleft()
        self.flows[b][flow].popleft()
        _, _, _, item, at = self._leave(t, b, flow, cost)
        if self.live[b][flow]:
            e = self.epoch[b][flow] + 1
            self.epoch[b][flow] = e
            self.turns[b].append((flow, e))
        return t, self.names[b], "dispatched", item, now - at

    def cancel(self, t, now=0.0):
        b, flow, cost, item, at = self.waiting[t]  # KeyError: not waiting
        self._leave(t, b, flow, cost)
        if not self.live[b][flow]:
            self.epoch[b][flow] += 1  # its turn entry goes stale
        return t, self.names[b], "cancelled", item, now - at
