"""The benchmark suites, one module each; ``SUITES`` maps a name to its module."""
from __future__ import annotations

import importlib

NAMES = ("softmax", "parallax", "gatedfwa", "decay", "lla", "scan", "mesanet", "nsa")


def get(name: str):
    if name not in NAMES:
        raise ValueError(f"suite: expected one of {', '.join(NAMES)}, got {name!r}")
    return importlib.import_module(f"regattn.bench.suites.{name}")
