"""Copies of a model trained as one: a learning-rate sweep's runs in one forward, one backward and one
optimizer step.

    members = Members(model, 3)                 # three copies of model's initial parameters
    out = members(inputs, select=select)        # [3, B, ...]: each copy on the same batch
    opt = build_member_optimizer(members, "muon", lrs=[5e-3, 1e-3, 5e-4], weight_decay=0.1)
    model_1 = members.member(1)                 # a plain model holding copy 1's parameters

The runs of a sweep that differ only in the learning rate see the same batches from the same initial
parameters, so they can share every launch: each parameter is stacked ``[n, ...]``, the forward is
``torch.func.vmap`` over ``torch.func.functional_call``, and each kernel op folds the copies into its batch
(:mod:`regattn.ops._common.vmap`). The MAD model's step is some 300 to 550 short kernels; n copies take the same
count, each n times the work. Gradients stay each copy's own (a copy's loss reaches only its parameters), and
:class:`regattn.train.step.TrainStep` clips each copy's gradient by its own norm and skips a copy's update when
its loss or norm is not finite.

The optimizer is the run's: Muon's matrices of every copy are orthogonalised together (:class:`BatchedMuon`
with a learning rate per copy), and Adam's parameters of copy ``m`` are views ``p[m]`` stepped by copy ``m``'s
fused AdamW, at its rates. The mixers whose ops all have vmap rules are :data:`MEMBER_MIXERS`.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, vmap

from regattn.layers.norm import RMSNorm
from regattn.train.optim import EMBED_LR, SCALAR_LR, BatchedMuon, Optimizers, make_groups, parameter_roles

MEMBER_MIXERS = ("softmax", "swa", "parallax", "gatedfwa", "decay", "mesanet", "linear")


class Members(nn.Module):
    """``n`` copies of ``model``: each parameter ``[n, *shape]`` (every copy starting from ``model``'s values);
    ``model`` itself keeps its buffers and is called with each copy's parameters."""

    def __init__(self, model: nn.Module, n: int):
        super().__init__()
        if n < 1:
            raise ValueError(f"n: expected at least 1 copy, got {n}")
        self.n = n
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.stacked = nn.ParameterList(
            nn.Parameter(p.detach().unsqueeze(0).repeat(n, *[1] * p.ndim)) for p in
            (model.get_parameter(name) for name in self.names))
        self.__dict__["template"] = model           # not a submodule: its own parameters are not trained
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.stacked = True                # each copy's weight applied after one fused norm

    def _apply(self, fn, recurse=True):
        self.template._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True):
        self.template.train(mode)
        return super().train(mode)

    def forward(self, inputs: torch.Tensor, select: torch.Tensor | None = None) -> torch.Tensor:
        """The copies' outputs ``[n, *out]`` on the same ``inputs``."""
        def one(params, inputs, select):
            return functional_call(self.template, dict(zip(self.names, params)), (inputs,), dict(select=select))
        return vmap(one, in_dims=(0, None, None), randomness="same")(tuple(self.stacked), inputs, select)

    def member(self, index: int, into: nn.Module | None = None) -> nn.Module:
        """A plain model with copy ``index``'s parameters: ``into`` (a model like the template) overwritten, or a
        new copy of the template."""
        into = copy.deepcopy(self.template) if into is None else into
        with torch.no_grad():
            for name, p in zip(self.names, self.stacked):
                into.get_parameter(name).copy_(p[index])
        return into


def member_roles(members: Members) -> dict[str, list[nn.Parameter]]:
    """:func:`regattn.train.optim.parameter_roles` of the template, each parameter its stacked form."""
    stacked = {id(members.template.get_parameter(name)): p for name, p in zip(members.names, members.stacked)}
    return {role: [stacked[id(p)] for p in params] for role, params in parameter_roles(members.template).items()}


class MemberAdamW:
    """Each copy's share of stacked parameters ``p [n, ...]`` stepped by the copy's own fused
    ``torch.optim.AdamW`` (``optimizers[m]``, built on the views ``p.detach()[m]`` of ``params``), whose
    gradients are the views ``p.grad[m]``; ``found_inf[m]`` skips copy ``m``."""

    def __init__(self, params: list[nn.Parameter], optimizers: list[torch.optim.AdamW]):
        self.params, self.optimizers = params, optimizers
        self.found_inf = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for m, opt in enumerate(self.optimizers):
            views = [v for group in opt.param_groups for v in group["params"]]
            for view, p in zip(views, self.params, strict=True):
                view.grad = None if p.grad is None else p.grad[m]
            opt.grad_scale, opt.found_inf = None, None if self.found_inf is None else self.found_inf[m]
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)


def build_member_optimizer(members: Members, name: str, *, lrs: list[float], weight_decay: float = 0.1,
                           betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.95) -> Optimizers:
    """:func:`regattn.train.optim.build_optimizer`'s ``fused`` optimizer for each copy, copy ``m`` at peak rate
    ``lrs[m]``: one :class:`BatchedMuon` over every copy's matrices (its ``lr`` a tensor of the copies' rates)
    and a :class:`MemberAdamW`."""
    if len(lrs) != members.n:
        raise ValueError(f"lrs: expected one rate per copy ({members.n}), got {len(lrs)}")
    roles = member_roles(members)
    device = members.stacked[0].device
    if name == "adamw":
        adam = [(roles["hidden"] + roles["gate"] + roles["embed"], 1.0, weight_decay), (roles["scalar"], 1.0, 0.0)]
        adam_betas, eps, opts = betas, 1e-8, []
    elif name == "muon":
        rates = torch.tensor(lrs, dtype=torch.float32, device=device)
        hidden = make_groups([(roles["hidden"], rates.clone(), weight_decay)])
        for group in hidden:
            group["base_lr"] = rates                # the schedule writes lr = base_lr * factor in place
        opts = [BatchedMuon(hidden, lr=rates, weight_decay=weight_decay, momentum=momentum)] if hidden else []
        adam = [(roles["embed"], EMBED_LR, weight_decay), (roles["gate"] + roles["scalar"], SCALAR_LR, 0.0)]
        adam_betas, eps = (0.8, 0.95), 1e-7
    else:
        raise ValueError(f"optimizer: expected 'adamw' or 'muon', got {name!r}")
    adam = [spec for spec in adam if spec[0]]
    if adam:
        per_copy = [torch.optim.AdamW(make_groups([([p.detach()[m] for p in ps], lr * scale, wd) for ps, scale, wd in adam]),
                                      lr=lr, betas=adam_betas, eps=eps, fused=True) for m, lr in enumerate(lrs)]
        opts.append(MemberAdamW([p for ps, _, _ in adam for p in ps], per_copy))
    return Optimizers(opts)


def clip_copies(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for each copy of stacked parameters ``[n, ...]`` on its own: copy
    ``m``'s gradients scaled by ``min(1, max_norm / (norm_m + 1e-6))``. Returns the norms ``[n]``."""
    grads = [p.grad for p in params if p.grad is not None]
    n = grads[0].shape[0]
    norms = torch.stack(torch._foreach_norm([g[m] for g in grads for m in range(n)])).view(len(grads), n)
    norms = norms.float().norm(dim=0)
    if max_norm != float("inf"):
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for m in range(n):
            torch._foreach_mul_([g[m] for g in grads], scale[m])
    return norms
