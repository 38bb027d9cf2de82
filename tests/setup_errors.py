"""A pytest hook that conftest.py loads: an error while a test is set up is
an error, also for a test marked xfail.

pytest's xfail mark turns an exception anywhere in the test, its fixtures'
setup included, into "XFAIL": a real stack that failed to start (an engine
whose port another process took) looked like the expected failure of the
marked tests. An ``xfail()`` called by a fixture itself stays an xfail.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if (
        call.when == "setup"
        and call.excinfo is not None
        and hasattr(report, "wasxfail")
        and not call.excinfo.errisinstance(pytest.xfail.Exception)
    ):
        report.outcome = "failed"
        del report.wasxfail
    return report
