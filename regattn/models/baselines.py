"""Baselines from flash-linear-attention (the ``baselines`` extra: ``pip install 'regattn[baselines]'``).

FLA's own layers, not rewritten here, as mixers ``x [B, T, dim] -> [B, T, dim]`` of the task models
(:func:`regattn.models.mixers.build_mixer`) and of :class:`regattn.models.DecoderLM`. FLA is imported
when a baseline is built; without it, naming one raises ImportError naming the extra.

| name     | FLA 0.6 layer                       | sizes given to it                                                  |
|----------|-------------------------------------|--------------------------------------------------------------------|
| mamba2   | ``fla.layers.Mamba2``               | ``heads`` heads of ``P = 2 dim / heads`` (Mamba2's expansion 2)    |
| gdn      | ``fla.layers.GatedDeltaNet``        | ``heads`` heads of ``D = dim / heads`` for q, k and v (expand_v 1) |
| gla      | ``fla.layers.GatedLinearAttention`` | ``heads`` heads of ``D`` for q, k and v                            |
| deltanet | ``fla.layers.DeltaNet``             | ``heads`` heads of ``D`` for q, k and v                            |

``D`` is ``head_dim`` when given (DecoderLM's ``head_dim``), ``P`` likewise for mamba2. Other
keyword options go to FLA's constructor and override these (``state_size``, ``expand_v``,
``use_short_conv``, ...). FLA's Mamba2 runs its PyTorch chunked scan unless ``mamba_ssm`` is
installed (PyPI has it as source only: ``pip install mamba-ssm --no-build-isolation`` builds its CUDA
extension), and then ``mamba_ssm``'s Triton kernels (:func:`mamba2_call`); its chunk is 64 here (FLA's default
256 makes the scan's per-chunk products four times larger in memory; the result does not depend on it).

FLA's kernels are Triton kernels for the GPU: on the CPU the layers can be built but not run. FLA
also refuses some layers on some machines: its gated backward (``gdn``) raises RuntimeError on Hopper
with triton >= 3.4 and < 3.7.1, where it gives wrong results. :func:`refusal` says whether a
baseline runs on a device; ``regattn sweep`` skips, with that reason, a baseline that does not.

Decoding: the baselines have no generation cache here. In :meth:`DecoderLM.generate` a step reruns
the layer on every token so far (``RecomputeStep``), which gives the uncached
result; FLA's own recurrent cache is not used.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

BASELINES = ("mamba2", "gdn", "gla", "deltanet")
EXTRA = "pip install 'regattn[baselines]'"
PROBE_LENGTH = 128          # longer than 64: GLA's chunked kernels, not its recurrent path for short inputs


class Baseline(nn.Module):
    """An FLA layer (``self.layer``) as a mixer: its output without FLA's ``(attentions, cache)``; ``call``:
    keyword arguments of each call."""

    def __init__(self, name: str, layer: nn.Module, **call):
        super().__init__()
        self.name, self.layer, self.call = name, layer, call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, **self.call)[0]


def fla_layers(name: str):
    """``fla.layers``, or ImportError naming the extra."""
    try:
        return importlib.import_module("fla.layers")
    except ImportError as error:
        raise ImportError(f"mixer {name!r} needs flash-linear-attention: {EXTRA}") from error


def head_width(dim: int, heads: int, head_dim: int | None, expand: int = 1) -> int:
    """The head width: ``head_dim``, else ``expand * dim / heads`` (ValueError when it is not whole)."""
    if head_dim is not None:
        return head_dim
    if (expand * dim) % heads:
        raise ValueError(f"heads: expected a divisor of {expand} * dim = {expand * dim}, got {heads}")
    return expand * dim // heads


def build_baseline(name: str, dim: int, heads: int, *, head_dim: int | None = None, **options) -> Baseline:
    """The baseline ``name`` of :data:`BASELINES` at width ``dim`` with ``heads`` heads (see the module text)."""
    if name not in BASELINES:
        raise ValueError(f"mixer: expected one of {BASELINES}, got {name!r}")
    fla = fla_layers(name)
    if name == "mamba2":
        P = head_width(dim, heads, head_dim, expand=2)
        sizes = dict(hidden_size=dim, num_heads=heads, head_dim=P, expand=heads * P / dim, chunk_size=64)
        return Baseline(name, fla.Mamba2(**{**sizes, **options}), **mamba2_call())
    D = head_width(dim, heads, head_dim)
    if name == "gdn":
        sizes = dict(hidden_size=dim, num_heads=heads, head_dim=D, expand_v=1.0)
        return Baseline(name, fla.GatedDeltaNet(**{**sizes, **options}))
    ratio = heads * D / dim
    sizes = dict(hidden_size=dim, num_heads=heads, expand_k=ratio, expand_v=ratio)
    layer = fla.GatedLinearAttention if name == "gla" else fla.DeltaNet
    return Baseline(name, layer(**{**sizes, **options}))


def mamba2_call() -> dict:
    """The arguments of each call of FLA's Mamba2: ``use_cache=True`` where ``mamba_ssm`` is installed but
    ``causal_conv1d`` is not. In training FLA's Mamba2 then takes its unfused path (FLA's Triton convolution and
    ``mamba_ssm``'s Triton chunked scan, each with its backward) in place of ``mamba_ssm``'s fused kernel, which
    calls ``causal_conv1d``'s CUDA functions and fails without them; with no cache passed in, none is kept."""
    module = importlib.import_module("fla.layers.mamba2")
    return {"use_cache": True} if module.is_fast_path_available and module.causal_conv1d_fn is None else {}


def refusal(name: str, dim: int, heads: int, device, *, batch: int = 2, inputs=(("tokens", PROBE_LENGTH),),
            eval_batch: int | None = None, **options) -> str | None:
    """Why the baseline ``name`` does not run on ``device`` at these sizes, or None when it does.

    On CUDA: its first pass in a model (:func:`regattn.models.stack.first_passes`) on ``[batch, length]`` inputs for
    each ``(kind, length)`` of ``inputs``; the RuntimeError FLA raises for a kernel it will not run there is the
    reason. Elsewhere: FLA's kernels need a CUDA device. Give ``batch``, ``inputs`` and ``eval_batch`` the
    training's batch size, its tasks' inputs (:func:`regattn.tasks.task_input`) and evaluation batch size, so that
    the kernels FLA compiles and tunes here are the ones its runs take: Triton compiles a kernel apart for each
    divisibility of its integer arguments and each dtype (after a check on 128 tokens, a Mamba2 run on MAD recall's
    inputs of 127 compiled its 135 kernels again).
    """
    from regattn.models.stack import first_passes         # imported here: regattn.models.stack imports this module
    if torch.device(device).type != "cuda":
        return f"flash-linear-attention's kernels need a CUDA device, got {device}"
    try:
        first_passes(name, dim, heads, device, batch=batch, inputs=inputs, eval_batch=eval_batch, **options)
    except RuntimeError as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())}"
    return None


def refusals(mixers: list[str], *, dim: int, heads: int, device, options: dict[str, dict],
             batch: int = 2, inputs=(("tokens", PROBE_LENGTH),), eval_batch: int | None = None) -> dict[str, str]:
    """``{mixer: reason}`` for each baseline among ``mixers`` that does not run on ``device`` (:func:`refusal`);
    ``options``: each mixer's own options (none where it is not a key)."""
    out = {}
    for name in (m for m in mixers if m in BASELINES):
        reason = refusal(name, dim, heads, device, batch=batch, inputs=inputs, eval_batch=eval_batch,
                         **options.get(name, {}))
        if reason is not None:
            out[name] = reason
    return out
