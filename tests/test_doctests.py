"""The examples in routecore's docstrings (what help() shows) run as written."""

import doctest

import pytest

import routecore

OBJECTS = [getattr(routecore, name) for name in routecore.__all__ if name != "__version__"]


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: getattr(o, "__name__", str(o)))
def test_docstring_examples(obj):
    doc = obj.__doc__ or ""
    assert doc.strip(), f"{obj} has no docstring"
    parser = doctest.DocTestParser()
    test = parser.get_doctest(doc, dict(vars(routecore)), obj.__name__, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0
