"""Optimizers: AdamW, or Muon for the hidden matrices with an Adam-style update for the rest
(parallax.txt Appendix F.2 and Table 2b).

Parameters fall in three roles:

* ``hidden``: 2-D weights inside the blocks (and the compression decoder);
* ``embed``: the input embedding / input map and the output head;
* ``scalar``: norms' weights, biases, and any other non-matrix parameter.

``adamw``: one ``torch.optim.AdamW`` with decoupled weight decay on ``hidden`` and ``embed`` and
none on ``scalar``. ``muon``: ``torch.optim.Muon`` (five Newton-Schulz steps, Keller Jordan's
shape scaling) on ``hidden`` and ``torch.optim.Adam``-style updates, betas (0.8, 0.95), eps 1e-7,
on ``embed`` (learning rate x0.3) and ``scalar`` (x0.015). Every group remembers its ``base_lr`` and
``base_wd`` so a schedule can set ``lr`` and ``weight_decay`` each step.
"""
from __future__ import annotations

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
EMBED_LR, SCALAR_LR = 0.3, 0.015


EDGE_MODULES = ("embed", "head", "lm_head", "unembed")


def parameter_roles(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Split the trainable parameters into ``hidden``, ``embed`` and ``scalar`` (see the module text).

    ``embed``: the matrices of every ``nn.Embedding`` and of the model's attributes named in
    :data:`EDGE_MODULES` (the input map and the output head).
    """
    edges = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    edges += [getattr(model, name) for name in EDGE_MODULES if isinstance(getattr(model, name, None), nn.Module)]
    edge = {id(p) for m in edges for p in m.parameters()}
    roles = {"hidden": [], "embed": [], "scalar": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        role = "embed" if id(p) in edge and p.ndim == 2 else "hidden" if p.ndim == 2 else "scalar"
        roles[role].append(p)
    return roles


class Optimizers:
    """Several torch optimizers stepped together (Muon with its Adam fallback); one param-group list."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]):
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)


def _groups(spec: list[tuple[list, float, float]]) -> list[dict]:
    """Param groups from ``(params, lr, weight_decay)``, skipping empty ones, with base values kept."""
    return [dict(params=ps, lr=lr, weight_decay=wd, base_lr=lr, base_wd=wd) for ps, lr, wd in spec if ps]


def build_optimizer(model: nn.Module, name: str = "adamw", *, lr: float = 1e-3, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.95) -> Optimizers:
    """AdamW or Muon (+ Adam fallback) for ``model``; ``lr`` is the peak rate of the main group."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {name!r}")
    roles = parameter_roles(model)
    if name == "adamw":
        groups = _groups([(roles["hidden"] + roles["embed"], lr, weight_decay), (roles["scalar"], lr, 0.0)])
        return Optimizers([torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)])
    opts = []
    if roles["hidden"]:
        opts.append(torch.optim.Muon(_groups([(roles["hidden"], lr, weight_decay)]), lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, ns_steps=5, adjust_lr_fn="original"))
    rest = _groups([(roles["embed"], lr * EMBED_LR, weight_decay), (roles["scalar"], lr * SCALAR_LR, 0.0)])
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=lr, betas=(0.8, 0.95), eps=1e-7))
    return Optimizers(opts)


def apply_schedule(optimizer: Optimizers, lr_scale: float, wd_scale: float = 1.0) -> None:
    """Set every group's ``lr = base_lr * lr_scale`` and ``weight_decay = base_wd * wd_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr_scale
        group["weight_decay"] = group["base_wd"] * wd_scale
