"""The machine a result was measured on, and result files: ``benchmarks/results/<device>/<suite>.json``."""
from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import torch

RESULTS_DIR = Path("benchmarks") / "results"


def machine_info(device: torch.device | str | None = None) -> dict:
    """GPU name, SM count, memory and the torch / triton / CUDA / cuDNN versions (CPU name on CPU)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {
        "device": "cpu", "name": platform.processor() or platform.machine(), "sm_count": None,
        "memory_gb": None, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, sm_count=props.multi_processor_count,
                    memory_gb=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
        info["device"] = device_slug(props.name)
    return info


def device_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``: the first model token, lower case."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def default_path(suite: str, machine: dict, root: Path | str = ".") -> Path:
    return Path(root) / RESULTS_DIR / machine["device"] / f"{suite}.json"


def make_result(suite: str, machine: dict, config: dict, rows: list[dict]) -> dict:
    """One result document: suite, UTC date, machine, run configuration and measured rows."""
    return {
        "suite": suite,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "config": config,
        "rows": rows,
    }


def write_result(path: Path | str, result: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def read_result(path: Path | str) -> dict:
    result = json.loads(Path(path).read_text())
    for key in ("suite", "machine", "rows"):
        if key not in result:
            raise ValueError(f"{path}: expected a result file with {key!r}, got keys {sorted(result)}")
    return result


def find_results(root: Path | str = ".") -> list[Path]:
    """Every ``benchmarks/results/<device>/<suite>.json`` under ``root``, sorted."""
    return sorted((Path(root) / RESULTS_DIR).glob("*/*.json"))
