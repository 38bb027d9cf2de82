"""Lets benches import the test helpers as `tests.*` (their plain-Python twins
ship in the package as `routecore._baselines`); the helpers import each other
by their plain names (as the tests do), so tests/ is on the path too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
