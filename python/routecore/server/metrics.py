"""Prometheus metrics of one server, in their own registry (served on their own port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

#: Decision latency buckets, in seconds (50 us to 50 ms).
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict = {}
        r = self.registry
        self.decisions = Counter(
            "routecore_decisions", "Requests routed, per pool", ["pool"], registry=r
        )
        self.spillovers = Counter(
            "routecore_spillovers", "Requests spilled off their target pool", ["pool"], registry=r
        )
        self.rejections = Counter(
            "routecore_rejections",
            "Requests refused, per service class and reason",
            ["service_class", "reason"],
            registry=r,
        )
        self.calibration_ratio = Gauge(
            "routecore_calibration_ratio",
            "Learned bytes per token, per category",
            ["category"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "routecore_decision_seconds",
            "Time to decide one request (parse, admit, choose pool and endpoint)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "routecore_in_flight",
            "Requests in flight, per pool and endpoint",
            ["pool", "endpoint"],
            registry=r,
        )
        self.timeouts = Counter(
            "routecore_timeouts",
            "Requests released because their response never came back",
            ["pool"],
            registry=r,
        )
        self.absurd_usage = Counter(
            "routecore_absurd_usage",
            "Responses whose usage cannot be real (ignored for learning), per pool",
            ["pool"],
            registry=r,
        )
        self.protocol_errors = Counter(
            "routecore_protocol_errors",
            "ext_proc streams ended for breaking the protocol (e.g. repeated request headers)",
            registry=r,
        )
        self.failures = Counter(
            "routecore_failures",
            "Internal failures, per failure mode applied (open or closed)",
            ["mode"],
            registry=r,
        )

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: the lookup is on every request's path."""
        key = (metric._name, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Starts the /metrics HTTP server; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
