"""Lets benches import the test helpers as `tests.*` (their plain-Python twins
ship in the package as `routecore._baselines`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
