"""The README's quick start, run as written: its commands are read from the
README, so the two cannot drift apart. The server runs in its own process on
free ports (the file's 9002 / 9003 / 9464 may be taken here); bench gets a
small budget."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("yaml")

from server_fixtures import Running, Spawned, base_config  # noqa: E402

from routecore.cli import main  # noqa: E402
from routecore.config import load_config  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start() -> list[list[str]]:
    """The ``routecore`` commands of the README's quick start block, as argv
    (comments and a trailing ``&`` removed)."""
    text = README.read_text("utf-8")
    block = re.search(r"\*\*Quick start\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no quick start block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert any(line.startswith("pip install") for line in lines)
    return [shlex.split(line.rstrip("&")) for line in lines if line.startswith("routecore ")]


def test_the_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = quick_start()
    assert [argv[1] for argv in commands] == ["init-config", "serve", "client", "bench"]
    init, serve, client, bench = (argv[1:] for argv in commands)

    assert main(init) == 0
    assert serve[:2] == ["serve", "--config"] and len(serve) == 3
    config = Path(serve[2])
    assert config.exists() and load_config(config).server.metrics_port == 9464

    server = Spawned(config)
    try:
        target = client.index("--target") + 1
        client[target] = server.target
        capsys.readouterr()
        assert main(client) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert "x-gateway-destination-endpoint: 127.0.0.1:80" in out
        assert main([*bench, "--seconds", "0.01", "--only", "route"]) == 0
        assert "route" in capsys.readouterr().out
    finally:
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 0, server.stop()
        server.stop()


@pytest.mark.parametrize("tenants", [[], None])
def test_serve_with_no_tenants_routes_every_request_without_a_key(tenants, tmp_path, capsys):
    # the README's serve section: no tenants (an empty list or no key) is no auth
    config = base_config(tenants=tenants)
    if tenants is None:
        del config["tenants"]
    server = Running(tmp_path / "open.yaml", config)
    try:
        for key in ("", "anything"):
            assert main(["client", "--target", server.target, "--api-key", key, "--json"]) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["routed"] and out["endpoint"].startswith("127.0.0.1:80")
    finally:
        server.stop()
