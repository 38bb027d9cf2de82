"""Optional dependencies fail with an error that names the extra to install."""

import sys

import pytest

from routecore._extras import MissingExtra, pyplot, require
from routecore.cli import main


def test_require_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'routecore\[plot\]'"):
        require("plot", "json", "no_such_module_for_routecore")
    assert [m.__name__ for m in require("plot", "json")] == ["json"]


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match="matplotlib is not installed"):
        pyplot()


def test_serve_without_the_server_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "grpc", None)
    assert main(["serve", "--config", "examples/routecore.yaml"]) == 2
    err = capsys.readouterr().err
    assert "routecore[server]" in err and "grpc is not installed" in err
