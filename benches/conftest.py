"""Lets benches import the test helpers as `tests.*` (their plain-Python twins
ship in the package as `routecore._baselines`), and the helpers import each
other as the tests do (`from server_fixtures import ...`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
