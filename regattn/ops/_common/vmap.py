"""``torch.func.vmap`` rules for the ops whose work is a kernel (a custom op or an ``autograd.Function``, which
``vmap`` refuses without a rule of their own): the mapped dim is folded into the op's batch dim and the kernel
runs once, as for an ensemble of models stacked with ``torch.func.stack_module_state``.

    torch.library.register_vmap(op, fold_rule(op, batched=(0, 1, 2), outputs=(0, 1)))
    class Fn(torch.autograd.Function):
        vmap = staticmethod(fold_rule(lambda *a: Fn.apply(*a), batched=(0, 1), outputs=(0,)))

The rule calls the op again below the ``vmap`` level, on plain tensors, so autograd records it as any call and
its backward needs no rule.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def fold_rule(call: Callable, *, batched: Sequence[int], outputs: Sequence[int | None],
              whole: Sequence[int] = ()) -> Callable:
    """A vmap rule (``torch.library.register_vmap``'s, or an ``autograd.Function``'s ``vmap``) for ``call``.

    batched: the positions of the arguments whose dim 0 is the batch (every other tensor argument is shared
    by the whole batch: a weight, a constant). outputs: each output's batch dim (None: not batched, as an
    empty placeholder). whole: arguments that describe the whole batch (``cu_seqlens``). Where only ``batched``
    arguments are vmapped and no ``whole`` one is given, they are folded into their dim 0 and the op runs once;
    otherwise (a weight of each copy, packed sequences) the op runs once per copy.
    """
    batched = frozenset(batched)

    def rule(info, in_dims, *args):
        n = info.batch_size
        single = len(outputs) == 1
        if (any(d is not None and i not in batched for i, d in enumerate(in_dims))
                or any(args[i] is not None for i in whole)):
            runs = [call(*(a.select(d, m) if d is not None else a for a, d in zip(args, in_dims))) for m in range(n)]
            runs = [(r,) if single else r for r in runs]
            out = tuple(torch.stack(parts) if dim is not None else parts[0]
                        for dim, parts in zip(outputs, zip(*runs)))
            dims = tuple(0 if dim is not None else None for dim in outputs)
        else:
            folded = [fold(a, d, n) if i in batched else a for i, (a, d) in enumerate(zip(args, in_dims))]
            out = call(*folded)
            out = tuple(o if dim is None else o.unflatten(dim, (n, -1)) for o, dim in zip((out,) if single else out,
                                                                                       outputs))
            dims = tuple(outputs)
        return (out[0], dims[0]) if single else (out, dims)

    return rule


def fold(x, dim: int | None, n: int):
    """``x`` with its vmapped dim ``dim`` (None: none; the tensor is the same for all ``n``) merged into dim 0."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(n, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.flatten(0, 1)
