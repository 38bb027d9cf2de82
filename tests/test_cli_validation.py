"""Every numeric option of every ``routecore`` command refuses a meaningless value
with one line on stderr and a non-zero exit, never a traceback (issue 12)."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

import pytest

from routecore.cli import main
from routecore.commands import _args, route

BIG = "99999999999999999999"

# (command line before the option, option, bad values)
CASES = [
    (["serve", "--config", "x.yaml"], "--port", ["-1", "0", "70000", "abc", "1.5"]),
    (["serve", "--config", "x.yaml"], "--metrics-port", ["-1", "65536"]),
    (["simulate"], "--short-gpus", ["-1", "0"]),
    (["simulate"], "--long-gpus", ["-5", BIG]),
    (["simulate"], "--homogeneous-gpus", ["0"]),
    (["simulate"], "--seed", ["-1", str(2**64)]),
    (["simulate"], "--rate", ["0", "-1", "nan", "inf"]),
    (["simulate"], "--duration", ["0", "-inf"]),
    (["simulate"], "--b-short", ["0", BIG]),
    (["simulate"], "--gamma", ["0.5", "nan"]),
    (["simulate"], "--rho-max", ["0", "1.5"]),
    (["simulate"], "--slo-ttft", ["0"]),
    (["simulate"], "--slo-tpot", ["-1"]),
    (["simulate"], "--verify-target", ["0", "2"]),
    (["simulate"], "--verify-rounds", ["-1"]),
    (["simulate"], "--warmup", ["1", "-0.1"]),
    (["plan"], "--h-ref-tokens", ["-1", "0"]),
    (["plan"], "--b-short", [BIG, "-5"]),
    (["plan"], "--rate", ["nan", "0"]),
    (["plan"], "--slo-ttft", ["-1", "0", "nan"]),
    (["plan"], "--price", ["0", "inf"]),
    (["plan"], "--p-c", ["1.5", "nan"]),
    (["plan"], "--phi", ["0"]),
    (["plan"], "--long-context", ["0"]),
    (["plan"], "--slo-tpot", ["0", "nan"]),
    (["plan-fidelity"], "--rate", ["0", "nan"]),
    (["plan-fidelity"], "--slo-ttft", ["-1"]),
    (["plan-fidelity"], "--duration", ["0"]),
    (["plan-fidelity"], "--max-requests", ["0"]),
    (["plan-fidelity"], "--min-pool-requests", ["-1", "x"]),
    (["plan"], "--verify-duration", ["-1", "inf"]),
    (["plan"], "--seed", ["-1"]),
    (["route"], "--default-max-tokens", ["0", "-1", str(2**31)]),
    (["route"], "--compress-band", ["0.9", "nan"]),
    (["route"], "--pool", [f"a:{BIG}", "a:-1"]),
    (["compress"], "--reduction", ["1", "-0.1", "nan"]),
    (["compress"], "--budget", ["0"]),
    (["compress"], "--bytes-per-token", ["0", "inf"]),
    (["pick-eval"], "--requests", ["0"]),
    (["pick-eval"], "--endpoints", ["-1"]),
    (["pick-eval"], "--sessions", ["0"]),
    (["pick-eval"], "--system-prompts", ["0"]),
    (["pick-eval"], "--shared-fraction", ["1.5"]),
    (["pick-eval"], "--rate", ["0"]),
    (["pick-eval"], "--kv-blocks", ["-1"]),
    (["pick-eval"], "--max-num-seqs", ["0"]),
    (["pick-eval"], "--warmup", ["1"]),
    (["pick-eval"], "--scrape-interval", ["-0.1", "nan"]),
    (["pick-eval"], "--seed", ["-1"]),
    (["pick-eval"], "--policy", ["herd"]),
    (["assign-eval"], "--rate", ["0"]),
    (["assign-eval"], "--requests", ["-1"]),
    (["assign-eval"], "--seed", ["-1"]),
    (["assign-eval"], "--max-batch", ["0"]),
    (["assign-eval"], "--interval", ["nan"]),
    (["calibration-study"], "--seed", ["-1"]),
    (["calibration-study"], "--requests", ["0"]),
    (["admission-scenario", "1"], "--every", ["0"]),
]


def assert_one_line_error(err: str, command: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"routecore {command}: error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("before", "option", "value"),
    [(before, option, value) for before, option, values in CASES for value in values],
)
def test_a_bad_numeric_option_is_one_line_and_exit_2(before, option, value, capsys):
    assert main([*before, f"{option}={value}"]) == 2
    err = capsys.readouterr().err
    assert_one_line_error(err, before[0])
    assert option in err


def test_a_value_refused_deeper_in_rust_is_one_line_too(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("One sentence here. Another one there.\n" * 50)
    # Passes argparse (a positive number), refused by the compressor's ratio check.
    assert main(["compress", str(text), "--bytes-per-token", "1000"]) == 2
    assert_one_line_error(capsys.readouterr().err, "compress")


@pytest.mark.parametrize("error", [OverflowError("int too big"), KeyError("pool 'x'\nline 2")])
def test_overflow_and_key_errors_from_a_command_are_one_line(error, monkeypatch, capsys):
    def run(args):
        raise error

    monkeypatch.setattr(route, "run", run)
    assert main(["route"]) == 2
    assert_one_line_error(capsys.readouterr().err, "route")


def test_serve_port_out_of_range_as_a_process():
    # Before: --port 70000 listened on 4464 and --port -1 on 65535.
    for port in ("70000", "-1"):
        out = subprocess.run(
            [sys.executable, "-m", "routecore.cli", "serve", "--config", "x", "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2
        assert_one_line_error(out.stderr, "serve")


@pytest.mark.parametrize(
    ("parse", "good", "bad"),
    [
        (_args.port, ["1", "65535"], ["0", "65536", "-1", "x", "1e3"]),
        (_args.random_seed, ["0", str(2**64 - 1)], ["-1", str(2**64)]),
        (_args.token_count, ["1", str(2**30)], ["0", str(2**30 + 1)]),
        (_args.positive_int, ["1", str(2**63 - 1)], ["0", str(2**63)]),
        (_args.non_negative_int, ["0"], ["-1"]),
        (_args.positive_float, ["1e-9", "3.5"], ["0", "-0.0", "nan", "inf", "x"]),
        (_args.fraction, ["0", "1", "0.5"], ["-0.01", "1.01", "nan"]),
        (_args.proper_fraction, ["0", "0.99"], ["1", "-1"]),
        (_args.positive_fraction, ["1", "0.01"], ["0", "1.5"]),
        (_args.band, ["1", "1.25"], ["0.99", "inf"]),
    ],
)
def test_the_type_helpers_accept_their_range_and_nothing_else(parse, good, bad):
    for text in good:
        value = parse(text)
        assert value == (int(text) if isinstance(value, int) else float(text))
        assert math.isfinite(value)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            parse(text)
