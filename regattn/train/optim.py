"""Optimizers: AdamW, or Muon for the hidden matrices with an Adam-style update for the rest
(parallax.txt Appendix F.2 and Table 2b).

Parameters fall in four roles:

* ``hidden``: 2-D weights inside the blocks (and the compression decoder);
* ``embed``: the input embedding / input map and the output head;
* ``gate``: the weights of the gate projections a layer names in its ``GATE_PROJECTIONS`` (a few outputs
  per head that feed a gate unnormalised, as GatedFWA's ``h`` and ``beta``);
* ``scalar``: norms' weights, biases, and any other non-matrix parameter.

``adamw``: one ``torch.optim.AdamW`` with decoupled weight decay on ``hidden``, ``gate`` and ``embed`` and
none on ``scalar``. ``muon``: ``torch.optim.Muon`` (five Newton-Schulz steps, Keller Jordan's
shape scaling) on ``hidden`` and ``torch.optim.Adam``-style updates, betas (0.8, 0.95), eps 1e-7,
on ``embed`` (learning rate x0.3), and on ``gate`` and ``scalar`` (x0.015, no weight decay). The gates
take Adam's update as in GatedFWA's own Muon training (gatedfwa.md Table 7: the gate at the learning rate
of the non-matrix parameters): Muon moves each of a gate matrix's few rows by the full learning rate every
step, and at dim 1024, 16 layers, T 4096 that made the GatedFWA LM diverge after step 50 (docs/LM.md).
Every group remembers its ``base_lr`` and ``base_wd`` so a schedule can set ``lr`` and ``weight_decay``
each step.

``fused=True`` (the task trainer, and the LM on one rank or sharded by FSDP2) takes the fast forms of
the same updates: ``torch.optim.AdamW(fused=True)`` and :class:`BatchedMuon` (the matrices of one shape
orthogonalised together; a sharded matrix gathered whole once a step, where ``torch.optim.Muon`` on a
DTensor would redistribute it inside every Newton-Schulz product). Both skip a step on the device when
``Optimizers.step(found_inf=...)`` is given a non-zero flag, with no host read. The learning rates stay
Python floats: neither optimizer is compiled, so a schedule change recompiles nothing, and a tensor rate
would cost ``torch.optim.Muon`` a host read per matrix (its ``add_(..., alpha=lr)``). A step captured in a
CUDA graph (:func:`capturable`) takes the fused forms' learning rates as device tensors instead.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

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
    gates = {id(p) for m in model.modules() for name in getattr(m, "GATE_PROJECTIONS", ())
             for p in getattr(m, name).parameters()}
    roles = {"hidden": [], "embed": [], "gate": [], "scalar": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim != 2:
            role = "scalar"
        else:
            role = "embed" if id(p) in edge else "gate" if id(p) in gates else "hidden"
        roles[role].append(p)
    return roles


class Optimizers:
    """Several torch optimizers stepped together (Muon with its Adam fallback); one param-group list."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self, found_inf: torch.Tensor | None = None):
        """One step of each optimizer; with ``found_inf`` (a float tensor on the parameters' device, as
        ``torch.amp.GradScaler`` gives it), a non-zero value skips it on the device (fused optimizers only)."""
        for opt in self.optimizers:
            if found_inf is not None:
                opt.grad_scale, opt.found_inf = None, found_inf
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
                    betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.95,
                    fused: bool = False) -> Optimizers:
    """AdamW or Muon (+ Adam fallback) for ``model``; ``lr`` is the peak rate of the main group.

    fused: the fast forms (fused AdamW, :class:`BatchedMuon`), which can skip a step on the device.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {name!r}")
    roles = parameter_roles(model)
    adamw = dict(fused=True) if fused else {}
    if name == "adamw":
        groups = _groups([(roles["hidden"] + roles["gate"] + roles["embed"], lr, weight_decay),
                          (roles["scalar"], lr, 0.0)])
        return Optimizers([torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **adamw)])
    opts = []
    if roles["hidden"]:
        hidden = _groups([(roles["hidden"], lr, weight_decay)])
        opts.append(BatchedMuon(hidden, lr=lr, weight_decay=weight_decay, momentum=momentum) if fused else
                    torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=5,
                                     adjust_lr_fn="original"))
    rest = _groups([(roles["embed"], lr * EMBED_LR, weight_decay),
                    (roles["gate"] + roles["scalar"], lr * SCALAR_LR, 0.0)])
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=lr, betas=(0.8, 0.95), eps=1e-7, **adamw))
    return Optimizers(opts)


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)        # torch.optim.Muon's (Keller Jordan's quintic)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalisation of each matrix of ``g [n, A, B]`` as ``torch.optim.Muon`` computes it (bf16,
    the Frobenius norm scaled to 1, ``steps`` quintic iterations on the wide orientation), batched."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = g.shape[-2] > g.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class BatchedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update (Nesterov momentum, :func:`newton_schulz`, the step scaled by
    ``sqrt(max(1, A / B))``, decoupled weight decay ``lr * weight_decay``), with the matrices of one shape
    stacked so that each Newton-Schulz product runs once for all of them.

    The state is ``torch.optim.Muon``'s (a ``momentum_buffer`` per matrix). A ``found_inf`` attribute (set by
    :meth:`Optimizers.step`) that is non-zero leaves the parameters and the momenta as they were.
    Parameters sharded by FSDP2 (DTensors) keep their momenta sharded: each rank updates its own rows, and
    only the Newton-Schulz input is gathered whole (one all-gather a matrix a step), orthogonalised on every
    rank, and cut back to the rank's rows.
    """

    def __init__(self, params, *, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 ns_steps: int = 5, eps: float = 1e-7):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, eps=eps))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"params: BatchedMuon takes matrices, got a parameter of shape {tuple(p.shape)}")
        self.found_inf = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            for params in by_shape.values():
                self._update(params, group)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        grad, old_buf, old = (torch.stack([local(t) for t in ts]) for ts in ([p.grad for p in params], bufs, params))
        buf = old_buf.lerp(grad, 1 - momentum)
        whole = newton_schulz(whole_matrices(grad.lerp(buf, momentum), params), group["ns_steps"], group["eps"])
        update = local_rows(whole, params)
        rows, cols = params[0].shape
        new = old.mul(1 - lr * group["weight_decay"])
        step = -lr * max(1.0, rows / cols) ** 0.5
        new = new.addcmul_(update, step) if isinstance(step, torch.Tensor) else new.add_(update, alpha=step)
        if self.found_inf is not None:
            skip = self.found_inf != 0
            new, buf = torch.where(skip, old, new), torch.where(skip, old_buf, buf)
        torch._foreach_copy_([local(p) for p in params], list(new.unbind(0)))
        torch._foreach_copy_([local(b) for b in bufs], list(buf.unbind(0)))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage: no grad is recorded here); a tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole_matrices(parts: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``parts [n, ...]``, this rank's part of each of ``params``, as the whole matrices (gathered from the
    ranks for DTensor parameters)."""
    if not isinstance(params[0], DTensor):
        return parts
    return torch.stack([DTensor.from_local(part, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                        .full_tensor() for part, p in zip(parts.unbind(0), params)])


def local_rows(whole: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`whole_matrices`: this rank's part of each matrix of ``whole``, with no communication."""
    if not isinstance(params[0], DTensor):
        return whole
    return torch.stack([distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None).to_local()
                        for w, p in zip(whole.unbind(0), params)])


def apply_schedule(optimizer: Optimizers, lr_scale: float, wd_scale: float = 1.0) -> None:
    """Set every group's ``lr = base_lr * lr_scale`` (in place where it is a device tensor, with no host
    read) and ``weight_decay = base_wd * wd_scale``."""
    for group in optimizer.param_groups:
        lr = group["base_lr"] * lr_scale
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        group["weight_decay"] = group["base_wd"] * wd_scale


def capturable(optimizer: Optimizers, device: torch.device) -> None:
    """Ready the fused optimizers' step for capture in a CUDA graph: every group's learning rate a 0-dim
    tensor on ``device`` (the graph reads it; :func:`apply_schedule` sets it in place) and fused AdamW's groups
    marked ``capturable`` (they keep their step counts on the device either way). The weight decay stays the
    number the graph was captured with."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
        if group.get("fused"):
            group["capturable"] = True
