"""Python versions of routecore's algorithms, each the twin a routecore call is
timed beside: by ``routecore bench`` on the user's machine and by the
pytest-benchmark suite in the repository's benches/. A twin is the fastest way
a Python user would compute the same answer with the usual libraries (NumPy
where it vectorises, caches where the algorithm allows, routecore's algorithm
where the algorithm is the point), checked to give routecore's answers. Not
part of the API."""
