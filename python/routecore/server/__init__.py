"""routecore serve: the gRPC server (Envoy ext_proc, RouteCore API, health, metrics)."""
