"""Optional dependencies fail with an error that names the extra to install."""

import sys
from pathlib import Path

import pytest

from routecore._extras import MissingExtra, pyplot, require
from routecore.cli import main

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib


def declared(extra: str) -> list[str]:
    """The requirements of ``extra`` in pyproject.toml, as the index compares names."""
    with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as f:
        return [r.lower() for r in tomllib.load(f)["project"]["optional-dependencies"][extra]]


@pytest.mark.parametrize("extra", ["plot", "server", "tokenizer"])
def test_require_names_the_extra_and_commands_that_install_it(extra):
    with pytest.raises(MissingExtra) as missing:
        require(extra, "json", "no_such_module_for_routecore")
    message = str(missing.value)
    assert f"the '{extra}' extra (no_such_module_for_routecore is not installed)" in message
    # the extra's packages by name, as the installed routecore declares them ...
    packages = message.split(": pip install ", 1)[1].split(", or ", 1)[0]
    assert sorted(packages.lower().split()) == sorted(f"'{r}'" for r in declared(extra))
    # ... or the extra from the clone; never `routecore[...]`: no such package on PyPI
    assert message.endswith(f"in routecore's clone pip install '.[{extra}]'")
    assert "routecore[" not in message
    assert [m.__name__ for m in require(extra, "json")] == ["json"]


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match="matplotlib is not installed"):
        pyplot()


def test_serve_without_the_server_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "grpc", None)
    assert main(["serve", "--config", "examples/routecore.yaml"]) == 2
    err = capsys.readouterr().err
    assert "pip install '.[server]'" in err and "grpc is not installed" in err
    assert "'grpcio>=" in err and err.count("\n") == 1
