"""Choosing the endpoint inside a pool: ``router.policy`` of the configuration.

- ``least-request``: the endpoint with the fewest requests in flight (ties to
  the one listed first).
- ``prefix``: the core's :class:`~routecore.PrefixCacheRouter` (AIBrix's
  prefix-cache-aware algorithm, with its least-request fallback and guards)
  over the request's token ids, or over its body bytes when it has none:
  clients that resend one system prompt and history send the same leading
  bytes.
- ``vtc``: the core's :class:`~routecore.VtcRouter` (AIBrix ``vtc-basic``),
  the tenant's name as the user, corrected with the real usage at the end.

Every chooser counts its own requests in flight; :meth:`choose` counts one,
:meth:`release` removes it (and corrects state with the usage when known).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from routecore._core import PrefixCacheRouter, VtcRouter


@dataclass(frozen=True)
class Request:
    """What the choosers read from a request."""

    #: Token ids or the body bytes (prefix); None when neither is known.
    key: bytes | np.ndarray | None
    user: str
    est_input_tokens: int
    est_output_tokens: int


class LeastRequest:
    def __init__(self, endpoints: list[str], block_size: int) -> None:
        self.load = dict.fromkeys(endpoints, 0)

    def choose(self, req: Request, now: float) -> str | None:
        if not self.load:
            return None
        endpoint = min(self.load, key=self.load.__getitem__)
        self.load[endpoint] += 1
        return endpoint

    def release(
        self, endpoint: str, req: Request, usage: tuple[int, int] | None, now: float
    ) -> None:
        self.load[endpoint] -= 1


class Prefix(LeastRequest):
    def __init__(self, endpoints: list[str], block_size: int) -> None:
        super().__init__(endpoints, block_size)
        self.router = PrefixCacheRouter(endpoints, block_size=block_size) if endpoints else None

    def choose(self, req: Request, now: float) -> str | None:
        if self.router is None:
            return None
        if req.key is None:
            return super().choose(req, now)
        endpoint, _ = self.router.route(req.key, now=now)
        self.load[endpoint] += 1
        return endpoint

    def release(
        self, endpoint: str, req: Request, usage: tuple[int, int] | None, now: float
    ) -> None:
        super().release(endpoint, req, usage, now)
        if req.key is not None and self.router is not None:
            self.router.complete(endpoint)


class Vtc(LeastRequest):
    def __init__(self, endpoints: list[str], block_size: int) -> None:
        super().__init__(endpoints, block_size)
        self.router = VtcRouter(endpoints) if endpoints else None

    def choose(self, req: Request, now: float) -> str | None:
        if self.router is None:
            return None
        endpoint = self.router.route(req.user, req.est_input_tokens, req.est_output_tokens, now=now)
        self.load[endpoint] += 1
        return endpoint

    def release(
        self, endpoint: str, req: Request, usage: tuple[int, int] | None, now: float
    ) -> None:
        super().release(endpoint, req, usage, now)
        actual = usage if usage is not None else (req.est_input_tokens, 0)
        self.router.complete(
            endpoint,
            req.user,
            req.est_input_tokens,
            req.est_output_tokens,
            actual[0],
            actual[1],
            now=now,
        )


POLICIES = {"least-request": LeastRequest, "prefix": Prefix, "vtc": Vtc}
