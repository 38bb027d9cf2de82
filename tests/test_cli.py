"""The routecore command."""

import json
import subprocess
import sys

import pytest

from routecore import __version__
from routecore.cli import main


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"routecore {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "route" in capsys.readouterr().out
    assert main([]) == 2


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "routecore.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and __version__ in out.stdout


def test_route_the_embedded_sample(capsys):
    assert main(["route"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 21
    pools = [x["pool"] for x in lines]
    assert pools.count("long") >= 3 and pools.count(None) == 1
    by_line = {x["line"]: x for x in lines}
    # The long-generation request: a short prompt, max_tokens 8192.
    assert by_line[8]["pool"] == "long" and by_line[8]["est_output_tokens"] == 8192
    assert by_line[15]["rejected"] and by_line[15]["reason"] == "exceeds-max-context"
    # A prompt given as token ids routes on its exact length.
    assert by_line[17]["est_input_tokens"] == 8


@pytest.mark.parametrize("band", ["1.25", "1.5"])
def test_compress_band_compresses_the_borderline_conversation_of_the_sample(band, capsys):
    assert main(["route", "--compress-band", band]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    compressed = [x for x in lines if x["action"] == "compress"]
    assert [x["line"] for x in compressed] == [21]
    c = compressed[0]
    assert c["pool"] == "short" and c["compression"]["status"] == "compressed"
    assert c["compression"]["tokens_after"] <= c["compression"]["target_tokens"] == 8192 - 1024
    assert c["compression"]["compressed_messages"] == [1]  # the notes, not the question
    assert "compressed: 1" in err
    # without the band the same request goes to the long pool, whole
    assert main(["route"]) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[20])
    assert (plain["pool"], plain["action"]) == ("long", "route")


def test_route_stdin_with_custom_pools_and_a_bad_line(monkeypatch, capsys, tmp_path):
    import io

    lines = [
        json.dumps({"prompt": "x" * 400, "max_tokens": 50}),
        "not json",
        "",
        json.dumps({"prompt": "x" * 40_000, "max_tokens": 50}),
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines)))
    assert main(["route", "-", "--pool", "tiny:1024:512:8", "--pool", "big:32768"]) == 1
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x.get("pool") for x in out] == ["tiny", None, "big"]
    assert "malformed JSON" in out[1]["error"]
    f = tmp_path / "reqs.jsonl"
    f.write_text(lines[0] + "\n")
    assert main(["route", str(f)]) == 0


@pytest.mark.parametrize("spec", ["short", "short:abc", ":100", "a:1:2:3:4", "a:100:200"])
def test_bad_pool_specs(spec, capsys):
    assert main(["route", "--pool", spec]) == 2
    assert "pool" in capsys.readouterr().err


def test_missing_file_is_a_clear_error(capsys):
    assert main(["route", "/nonexistent/requests.jsonl"]) == 2
    assert "No such file" in capsys.readouterr().err


def test_calibration_study_command(capsys):
    assert main(["calibration-study", "--requests", "500"]) == 0
    out = capsys.readouterr().out
    assert "| cjk | 2.01 |" in out


def options_of_every_command():
    """(command name, {option: argparse action}) for every subcommand."""
    import argparse

    from routecore.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, {o: a for a in p._actions for o in a.option_strings})
        for name, p in sub.choices.items()
    ]


def test_every_seed_defaults_to_the_one_constant():
    from routecore.commands._args import DEFAULT_SEED

    commands = options_of_every_command()
    seeded = [(name, opts["--seed"]) for name, opts in commands if "--seed" in opts]
    assert {name for name, _ in seeded} >= {"simulate", "plan", "pick-eval", "assign-eval"}
    assert {name: a.default for name, a in seeded} == {name: DEFAULT_SEED for name, _ in seeded}
    assert all(f"(default {DEFAULT_SEED})" in a.help for _, a in seeded)


@pytest.mark.parametrize("name", [n for n, opts in options_of_every_command() if "--plot" in opts])
def test_every_plot_into_a_missing_directory_is_refused_before_any_work(name, tmp_path, capsys):
    argv = {"admission-scenario": ["1"]}.get(name, [])
    assert main([name, *argv, "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "does not exist" in err and err.count("\n") == 1
    assert main([name, *argv, "--plot", str(tmp_path)]) == 2  # a directory is not a file
    assert "expected a file path" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_profile_takes_a_preset_name_or_a_toml_file_in_every_command(command, tmp_path, capsys):
    from routecore.profiles import PRESETS

    opts = dict(options_of_every_command())[command]
    assert all(name in opts["--profile"].help for name in PRESETS)
    toml = tmp_path / "qwen.toml"
    toml.write_text('preset = "qwen3_235b_mi300x"\n')
    extra = ["--duration", "2", "--rate", "20", "--no-verify", "--quiet"]

    def run(*profile: str) -> dict:
        argv = [command, "--json", *profile, *(extra if command == "simulate" else [])]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    by_name = run("--profile", "qwen3_235b_mi300x")
    assert by_name == run("--profile", str(toml))
    assert by_name != run()  # the default preset, llama3_70b_a100
    assert main([command, "--profile", "no_such_preset"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_preset': neither a preset (llama3_70b_a100, qwen3_235b_mi300x)" in err


def test_a_plot_without_the_plot_extra_is_refused_before_any_work(monkeypatch, tmp_path, capsys):
    from routecore import cli
    from routecore._extras import MissingExtra

    def missing():
        raise MissingExtra("this needs the 'plot' extra (matplotlib is not installed)")

    monkeypatch.setattr(cli, "pyplot", missing)
    assert main(["plan", "--plot", str(tmp_path / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "'plot' extra" in err
    assert not (tmp_path / "x.png").exists()
