"""The README's first set-up command, pasted as written on the machine the
README names, without a container: Debian 12's own CPython 3.11
(``/usr/bin/python3``, which Debian marks as externally managed, so ``pip
install`` into it is refused) first on PATH, in a fresh copy of the clone. It
builds routecore into an environment of its own, runs the main job and leaves
the system interpreter as it was; the environment it made (the quick start's)
runs every Python block of the README and the docs pages; a second build
reuses the first.

The copy lives at a fixed path (``target/setup-check/``) and builds into the
clone's own cargo target directory (the one scripts/setup's build filled), so
only what Debian's interpreter changes is compiled again (pyo3 and routecore:
minutes, not the 15 to 20 of a cold build)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_readme import BLOCKS

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: Where the copy lives between runs.
WORK = ROOT / "target" / "setup-check"
#: A cold build on a busy 2-core machine, with room.
BUILD_TIMEOUT_S = 3600


def externally_managed() -> bool:
    """Whether the system Python carries Debian's EXTERNALLY-MANAGED marker."""
    if not SYSTEM_PYTHON.exists():
        return False
    stdlib = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return (Path(stdlib) / "EXTERNALLY-MANAGED").exists()


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not externally_managed(),
        reason="needs Debian's system Python, marked externally managed, at /usr/bin/python3",
    ),
]


def main_job_command() -> str:
    """The README's first set-up command (the main job), as one shell line."""
    text = (ROOT / "README.md").read_text("utf-8")
    setup = text.split("\n## Set up\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", setup, re.S)
    assert block, "README.md's Set up has no bash block"
    lines = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1, lines
    return lines[0]


def system_site_packages() -> dict[str, list[str]]:
    """What the system interpreter sees installed: each of its site-packages
    directories (the user's included) and the names in it."""
    code = "import json, site; print(json.dumps(site.getsitepackages()))"
    user = "import site; print(site.getusersitepackages())"
    dirs = [
        *json.loads(subprocess.check_output([SYSTEM_PYTHON, "-c", code], text=True)),
        subprocess.check_output([SYSTEM_PYTHON, "-c", user], text=True).strip(),
    ]
    return {d: sorted(os.listdir(d)) if os.path.isdir(d) else [] for d in dirs}


def fresh_copy(dest: Path) -> None:
    """The clone's files (tracked, and untracked ones git does not ignore), with
    their times, into ``dest``, emptied first: what a fresh clone holds."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.check_output(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT
    ).split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():  # a deleted, not yet committed file is listed too
            (dest / src.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / src.relative_to(ROOT))


def debian_environment() -> dict[str, str]:
    """A shell whose ``python3`` is Debian's: the system directories and the
    Rust toolchain on PATH (no other Python), pip's and cargo's settings kept,
    the build into the clone's target directory."""
    cargo = shutil.which("cargo")
    assert cargo, "no cargo on PATH"
    path = f"{Path(cargo).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert shutil.which("python3", path=path) == str(SYSTEM_PYTHON)
    keep = ("HOME", "LANG", "TMPDIR", "RUSTUP_HOME", "CARGO_HOME")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    return {**env, "PATH": path, "CARGO_TARGET_DIR": str(ROOT / "target")}


def run_logged(command: str, cwd: Path, env: dict[str, str], log: Path) -> str:
    """Runs ``command`` in bash, its output into ``log`` (not a terminal: what
    a log file shows); returns the log's text, failing with its tail."""
    with log.open("w") as out:
        code = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S,
        ).returncode
    text = log.read_text("utf-8", errors="replace")
    assert code == 0, f"{command!r} exited {code}:\n{text[-4000:]}"
    return text


def test_the_main_job_command_works_with_debians_python_and_installs_nothing_into_it(tmp_path):
    clone = WORK / "clone"
    fresh_copy(clone)
    env = debian_environment()
    before = system_site_packages()

    text = run_logged(main_job_command(), clone, env, tmp_path / "setup.log")

    # the main job ran: its table
    assert re.search(r"^homogeneous +\d+ +\d+ ", text, re.M), text[-4000:]
    # the build said how long it took; a log gets plain lines, no bar redrawn
    assert re.search(r"^build: done in \d+ s$", text, re.M)
    assert "\r" not in text
    # an environment of its own, made from Debian's Python
    venv_python = clone / ".venv" / "bin" / "python"
    base = subprocess.check_output([venv_python, "-c", "import sys; print(sys.base_prefix)"])
    assert base.decode().strip() == "/usr"
    # and nothing went into the system interpreter
    assert system_site_packages() == before
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import routecore"], capture_output=True)
    assert probe.returncode != 0 and b"No module named 'routecore'" in probe.stderr

    # the quick start's environment runs every Python block of the README and docs
    for index, block in enumerate(BLOCKS):
        cwd = tmp_path / f"block{index}"
        cwd.mkdir()
        ran = subprocess.run(
            [venv_python, "-c", block], cwd=cwd, env=env, capture_output=True, text=True
        )
        assert ran.returncode == 0, f"block {index}:\n{block}\n{ran.stderr[-3000:]}"

    # one build: building again (what scripts/setup does) compiles nothing
    again = run_logged("bash scripts/build", clone, env, tmp_path / "again.log")
    assert "Compiling" not in again and "build: done in" in again
