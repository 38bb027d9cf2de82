"""Plain-Python versions of routecore's algorithms, each the twin a routecore call
is timed beside: by ``routecore bench`` on the user's machine and by the
pytest-benchmark suite in the repository's benches/. Not part of the API."""
