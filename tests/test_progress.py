"""Progress on stderr: a bar redrawn in place on a terminal, plain lines in a
log (a bar joined by carriage returns is one endless line in a file)."""

from __future__ import annotations

import io
import re
import sys

import pytest

from routecore.cli import main
from routecore.commands.simulate import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def feed(progress: Progress, total: int, step: int) -> None:
    """The calls a simulation makes: counts done as it goes, then (total, total)."""
    for done in range(0, total, step):
        progress(done, total)
    progress(total, total)


def test_in_a_log_each_quarter_is_one_plain_line(capsys):
    feed(Progress("pool-routing", True), 1000, 7)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        f"pool-routing   {pct:3d}% of 1000 requests" for pct in (25, 50, 75, 100)
    ]


def test_on_a_terminal_one_bar_is_redrawn_in_place(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    feed(Progress("fleetopt", True), 100, 10)
    out = terminal.getvalue()
    assert out.count("\r") == 11 and out.count("\n") == 1
    assert out.endswith("fleetopt       [##############################] 100.0%\n")


def test_quiet_writes_nothing(capsys):
    feed(Progress("homogeneous", False), 100, 10)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--duration", "4", "--rate", "20"],
        ["pick-eval", "--requests", "300", "--policy", "random", "--policy", "prefix"],
    ],
)
def test_every_command_with_progress_writes_plain_lines_to_a_log(argv, capsys):
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert re.search(r"^\S+ +100% of \d+ requests$", err, re.M)
