"""The README's quick start, run as written: its lines are read from the
README, so the two cannot drift apart. The block runs in bash, in a stand-in
for the clone, with ``routecore`` recording each command line and the
directory it runs in; the test then runs each one there, the server in its
own process on free ports (the file's 9002 / 9003 / 9464 may be taken here),
bench with a small budget, and finds the clone as it was."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("yaml")

from server_fixtures import Running, Spawned, base_config  # noqa: E402

from routecore.cli import main  # noqa: E402
from routecore.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def quick_start_block() -> str:
    """The README's quick start block, as bash runs it."""
    block = re.search(r"\*\*Quick start\*\*.*?```bash\n(.*?)```", README.read_text("utf-8"), re.S)
    assert block, "README.md has no quick start block"
    return block.group(1)


def recorded_commands(clone: Path, tmp: Path) -> list[tuple[Path, list[str]]]:
    """Runs the quick start block in bash from ``clone`` (temporary files
    under ``tmp``) with ``routecore`` a function that records its directory
    and arguments, in the background as written; returns them in order."""
    record = tmp / "commands.jsonl"
    recorder = (
        f"routecore() {{ {sys.executable} -c 'import json, os, sys; "
        f'print(json.dumps([os.getcwd(), sys.argv[1:]]))\' "$@" >> {record}; }}\n'
        "kill() { :; }\n"  # the recorder in the background, not a server: waited for
    )
    script = recorder + quick_start_block() + "\nwait\n"
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp)}
    subprocess.run(["bash", "-c", script], cwd=clone, env=env, check=False, capture_output=True)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return sorted(((Path(cwd), argv) for cwd, argv in lines), key=lambda c: ORDER.index(c[1][0]))


#: The commands of the quick start, in the order it runs them.
ORDER = ["init-config", "serve", "client", "bench"]


def test_the_quick_start_runs_as_written_and_leaves_the_clone_as_it_was(
    tmp_path, monkeypatch, capsys
):
    clone, tmp = tmp_path / "clone", tmp_path / "tmp"
    clone.mkdir(), tmp.mkdir()
    (clone / ".venv").symlink_to(ROOT / ".venv")  # the environment the set-up built
    commands = recorded_commands(clone, tmp)
    assert [argv[0] for _, argv in commands] == ORDER
    (cwd, init), (_, serve), (_, client), (_, bench) = commands
    assert all(c == cwd for c, _ in commands)

    monkeypatch.chdir(cwd)
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
    # everything it wrote is in the scratch directory: the clone is as it was
    assert [p.name for p in clone.iterdir()] == [".venv"]


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
