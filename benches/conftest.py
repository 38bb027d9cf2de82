"""Lets benches import their plain-Python twins as `benches.baselines.*`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
