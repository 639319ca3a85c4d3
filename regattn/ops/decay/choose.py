"""``method="auto"``: the measured tables per GPU kind and the fallback rule.

No method wins everywhere (leetdecoding.txt Section 5), so ``auto`` looks the input up in a table
of timings measured on the same kind of GPU (``tables/<kind>.json``, written by
``regattn tune decay``, see ``tune.py``) and takes the fastest method at the nearest measured point:
nearest in ``log2(B*H*T)`` (the work), then ``log2 T`` (the sequential length), then
``log2(R*D)``, preferring points of the same dtype and the same decay setting.

Fallback rule where no table exists for the GPU: ``lightning2`` (tensor-core blocks, linear in T,
sequence-parallel when batch*heads is small). On the CPU (the torch reference): ``vanilla`` up to
T = 128, ``lightning2`` up to T = 2048, ``block_based`` beyond (``cpu_auto_method``).
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch

from regattn.ops.decay import registry

TABLES = Path(__file__).parent / "tables"


def cpu_auto_method(T: int) -> str:
    """The torch method for ``auto`` off the GPU, from timings on a 2-core CPU (H=4, R=D=64)."""
    if T <= 128:
        return "vanilla"
    if T <= 2048:
        return "lightning2"
    return "block_based"


def gpu_kind(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3" -> "h100"``: the first model token (letters then digits) of the name."""
    words = re.findall(r"[a-z]+\d+[a-z]*", name.lower().replace("nvidia", ""))
    return words[0] if words else re.sub(r"\W+", "_", name.lower()).strip("_")


@functools.lru_cache(maxsize=None)
def load_table(kind: str) -> dict | None:
    path = TABLES / f"{kind}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _distance(entry: dict, B: int, T: int, H: int, R: int, D: int, dtype: str, decay: bool) -> float:
    work = abs(math.log2(B * H * T) - math.log2(entry["B"] * entry["H"] * entry["T"]))
    length = abs(math.log2(T) - math.log2(entry["T"]))
    size = abs(math.log2(R * D) - math.log2(entry["R"] * entry["D"]))
    return work + 0.5 * length + 0.25 * size + (0.0 if entry["dtype"] == dtype else 4.0) \
        + (0.0 if entry["decay"] == decay else 0.1)


def fastest(entry: dict) -> str | None:
    """The fastest registered method of one table entry (None when all were OOM or unknown)."""
    timed = [(ms, m) for m, ms in entry["ms"].items() if isinstance(ms, (int, float)) and m in registry.method_names()]
    return min(timed)[1] if timed else None


def pick_from_table(table: dict, B: int, T: int, H: int, R: int, D: int, dtype: torch.dtype,
                    decay: bool) -> str | None:
    """The fastest method at the table point nearest to this input (None when no point has one)."""
    name = str(dtype).replace("torch.", "")
    for entry in sorted(table["entries"], key=lambda e: _distance(e, B, T, H, R, D, name, decay)):
        best = fastest(entry)
        if best is not None:
            return best
    return None


def choose_method(B: int, T: int, H: int, R: int, D: int, dtype: torch.dtype, decay: bool,
                  device: torch.device) -> str:
    """The method ``auto`` runs for this input (see the module docstring for the rule)."""
    if device.type != "cuda":
        return cpu_auto_method(T)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _choose_on_gpu(B, T, H, R, D, dtype, decay, index)


@functools.lru_cache(maxsize=4096)
def _choose_on_gpu(B, T, H, R, D, dtype, decay, index) -> str:
    table = load_table(gpu_kind(torch.cuda.get_device_name(index)))
    picked = None if table is None else pick_from_table(table, B, T, H, R, D, dtype, decay)
    return picked or "lightning2"


def forget_tables() -> None:
    """Read the tables again on the next lookup (after ``regattn tune decay`` wrote one)."""
    load_table.cache_clear()
    _choose_on_gpu.cache_clear()
