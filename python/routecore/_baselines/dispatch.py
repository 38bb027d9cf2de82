"""Plain-Python twin of ``Dispatcher.acquire`` and a lease's release: the same
steps (route, admit, pick; what the earlier steps took given back when a later
one refuses) over the plain-Python router, admission controller and picker."""


class Refused(Exception):
    """A step refused: ``step`` and the HTTP ``status``."""

    def __init__(self, step, status):
        super().__init__(f"{step} refused the request: {status}")
        self.step, self.status = step, status


class Dispatcher:
    """``router``: a ``budget.TokenBudgetRouter``; ``pickers``: one
    ``pick.EndpointPicker`` per pool, in the router's pool order;
    ``admission``: an ``admission.AdmissionController``."""

    def __init__(self, router, pickers, admission):
        self.router, self.pickers, self.admission = router, pickers, admission

    def acquire(self, prompt_bytes, category, max_output_tokens, entitlement, now, tokens=None):
        """A lease ``(pool, ticket, endpoint, input_tokens, now)``; ``Refused``
        with nothing held."""
        router = self.router
        pool = router.route(prompt_bytes, category, max_output_tokens)
        if pool < 0:
            raise Refused("route", 413)
        input_tokens = router.calibrator.estimate_tokens(prompt_bytes, category)
        try:
            status, _, _, ticket = self.admission.admit(
                entitlement, input_tokens, max_output_tokens, now
            )
            if ticket is None:
                raise Refused("admission", status)
            try:
                endpoint = self.pickers[pool].pick(tokens)
                if endpoint is None:
                    raise Refused("endpoint", 503)
            except BaseException:
                self.admission.release(ticket, now)
                raise
        except BaseException:
            router.in_flight[pool] -= 1
            raise
        return pool, ticket, endpoint, input_tokens, now

    def release(self, lease, input_tokens, output_tokens, now):
        """Gives back what ``lease`` holds, with the request's usage."""
        pool, ticket, endpoint, _, started = lease
        picker = self.pickers[pool]
        picker.states[picker.endpoints.index(endpoint)]["in_flight"] -= 1
        self.admission.complete(ticket, input_tokens, output_tokens, now - started, now)
        self.router.in_flight[pool] -= 1
