"""setup_errors.py: a setup error of a test marked xfail is reported as an
error, not as the expected failure."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("vLLM exited: address already in use")

@pytest.fixture
def declined():
    pytest.xfail("the fixture itself says xfail")

@pytest.mark.xfail(strict=True, reason="needs a branch")
def test_setup_fails(broken):
    pass

@pytest.mark.xfail(strict=True, reason="needs a branch")
def test_body_fails():
    assert False

@pytest.mark.xfail(strict=True, reason="needs a branch")
def test_fixture_xfails(declined):
    pass
"""


@pytest.mark.parametrize("hook", [True, False])
def test_a_setup_error_is_an_error_not_an_xfail(pytester: pytest.Pytester, hook: bool) -> None:
    pytester.makepyfile(TESTS)
    result = pytester.runpytest(*(["-p", "setup_errors"] if hook else []))
    if hook:
        result.assert_outcomes(errors=1, xfailed=2)
        result.stdout.fnmatch_lines(["*ERROR at setup of test_setup_fails*", "*address already*"])
    else:  # pytest alone: the broken setup passes for the expected failure
        result.assert_outcomes(xfailed=3)
