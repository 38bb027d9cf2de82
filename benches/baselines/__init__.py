"""Plain-Python versions of routecore's algorithms, benchmarked beside routecore."""
