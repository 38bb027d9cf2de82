"""Every ```python block of README.md and of the docs pages (docs/*.md) runs
as written, in a fresh namespace, and imports only what the environment the
set-up and quick start build installs (routecore and the extras scripts/build
names)."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose blocks are run: the README, then the docs pages by name.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: (page, its n-th block, the block's source), every block of every page.
SOURCES = [
    (page.relative_to(ROOT), n, block)
    for page in PAGES
    for n, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text("utf-8"), re.S))
]
BLOCKS = [block for _, _, block in SOURCES]


def test_readme_has_examples():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(SOURCES)), ids=[f"{p}:{n}" for p, n, _ in SOURCES])
def test_readme_example_runs(index, tmp_path, monkeypatch):
    page, n, block = SOURCES[index]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"{page} python block {n}", "exec"), {})


def normalized(name: str) -> str:
    """A distribution name as the index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return normalized(match.group(1))


def installed_by(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: them and what they require,
    transitively (their own extras left out), as this environment's metadata says."""
    seen: set[str] = set()
    todo = [requirement_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [requirement_name(r) for r in requires if "extra" not in r.partition(";")[2]]
    return seen


def imported(block: str) -> set[str]:
    """The top-level modules ``block`` imports, beside the standard library and routecore."""
    names = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"routecore"}


def test_every_block_imports_only_what_the_quick_starts_environment_installs():
    build = (ROOT / "scripts" / "build").read_text("utf-8")
    extras = re.search(r"--extras ([\w,-]+)", build).group(1).split(",")
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    wanted = [*project["dependencies"]]
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    installed = installed_by(wanted)
    providers = metadata.packages_distributions()
    missing = {
        (f"{page}:{n}", module)
        for page, n, block in SOURCES
        for module in imported(block)
        if not {normalized(d) for d in providers.get(module, [])} & installed
    }
    assert missing == set(), f"imports no extra of {extras} installs"


def test_no_page_installs_routecore_from_an_index():
    # there is no routecore on PyPI: install from the clone, or a wheel built from it
    for page in PAGES:
        text = page.read_text("utf-8")
        assert not re.search(r"pip install '?routecore", text), page


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped but
    for hyphens, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_leads_somewhere():
    # the README's sections moved into docs/: a link to a page, a figure or a
    # heading must follow them (a '#section' of the old README finds nothing)
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text("utf-8")):
            if re.match(r"\w+://", target):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.is_file():
                broken.append((page.name, target))
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text("utf-8"), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    broken.append((page.name, target))
    assert broken == []
