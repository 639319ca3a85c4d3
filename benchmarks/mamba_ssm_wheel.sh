#!/usr/bin/env bash
# A wheel of mamba-ssm built from its source distribution for one GPU architecture, for flash-linear-attention's
# Mamba2 fast path (regattn.models.baselines). PyPI has mamba-ssm as source only, and its setup.py compiles its
# CUDA extension for nine architectures; this keeps one (sm_90 by default: 157 s on 16 cores with nvcc 13.0).
#
#   benchmarks/mamba_ssm_wheel.sh mamba_ssm-2.3.2.post1.tar.gz OUTDIR [ARCH]     (needs nvcc, torch and ninja)
set -euo pipefail
sdist=$(realpath "$1"); out=$(realpath -m "$2"); arch=${3:-90}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work"
src=$(echo "$work"/mamba_ssm-*)
python3 - "$src/setup.py" "$arch" <<'PY'
import re
import sys

path, keep = sys.argv[1], sys.argv[2]
text = open(path).read()
pair = re.compile(r'cc_flag\.append\("-gencode"\)(\s*)cc_flag\.append\("arch=compute_(\d+)a?,code=sm_\d+a?"\)')
kept = [m.group(2) for m in pair.finditer(text) if m.group(2) == keep]
if not kept:
    sys.exit(f"{path}: no -gencode pair for compute_{keep}")
open(path, "w").write(pair.sub(lambda m: m.group(0) if m.group(2) == keep else f"pass{m.group(1)}pass", text))
PY
MAMBA_FORCE_BUILD=TRUE python3 -m pip wheel --no-build-isolation --no-deps -w "$out" "$src"
