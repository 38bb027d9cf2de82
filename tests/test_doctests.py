"""The examples in routecore's docstrings (what help() shows) run as written.
Every public object has a docstring; only those with an example are run as
doctests (an object without one is not counted as tested)."""

import doctest

import pytest

import routecore

OBJECTS = [getattr(routecore, name) for name in routecore.__all__ if name != "__version__"]
PARSER = doctest.DocTestParser()


def examples(obj) -> doctest.DocTest:
    return PARSER.get_doctest(obj.__doc__ or "", dict(vars(routecore)), obj.__name__, None, 0)


WITH_EXAMPLES = [obj for obj in OBJECTS if examples(obj).examples]


def test_every_public_object_has_a_docstring():
    assert [obj for obj in OBJECTS if not (obj.__doc__ or "").strip()] == []


def test_some_docstrings_have_examples():
    assert WITH_EXAMPLES


@pytest.mark.parametrize("obj", WITH_EXAMPLES, ids=lambda o: getattr(o, "__name__", str(o)))
def test_docstring_examples(obj):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(examples(obj))
    assert runner.tries > 0 and runner.failures == 0
