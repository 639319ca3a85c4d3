"""Launch a Triton kernel with less host work: its compiled binary, called directly once Triton has chosen it.

``kernel[grid](*args)`` spends most of a small launch's host time in its dispatch: it binds and specializes the
arguments, builds a cache key, checks the kernel's globals, gathers launch metadata, then calls the binary. On the
H200's host that took about 20 of the 27 us of a Parallax decode launch (B 1: its two launches took 54 us through
Triton's dispatch, 14 us calling the binaries; benchmarks/results/h200/tiles/parallax-decode-host.json).

:func:`launch` keeps Triton's own binding and specialization, so each call runs the binary Triton picked for
arguments specialized alike (pointer alignment and integer divisibility included), and skips the rest.

The first call of each specialization, and every call that Triton must see, go through ``kernel[grid]``: in the
interpreter, while torch.compile traces (it captures Triton launches itself), with Triton's debug or
instrumentation modes or a launch hook set, and for what is not a plain ``triton.jit`` function.

:func:`launch_tuned` does the same for an autotuned kernel once its autotuner has chosen a config for the call's
key: an eager fp16 ELSA forward at B1 H16 T4096 D64 spent about 320 us of host time a call on the H200 (its kernel
175 us), a third of it in the autotuner's and Triton's dispatch. :func:`launch_any` takes whichever of the two a
kernel is for (the ops whose kernels are autotuned on a GPU and plain in the interpreter or with fixed tiles).
"""
from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_BINARIES: dict = {}  # kernel -> {(device, specialization, options): compiled kernel}
_CHOSEN: dict = {}  # (autotuner, key) -> the config it chose


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled binary where it can (see the module's notes);
    ``grid`` a tuple or, as for ``kernel[grid]``, a function of the named arguments."""
    binder, device = _binder(kernel)
    if binder is None:
        kernel[grid](*args, **kwargs)
        return
    _launch_binary(kernel, binder, device, _grid_of(grid, kernel, args, kwargs), *args, **kwargs)


def _grid_of(grid, kernel, args, kwargs) -> tuple:
    """The launch grid: ``grid`` itself, or a function's value on the named arguments as ``kernel[grid]`` takes it."""
    return grid({**dict(zip(kernel.arg_names, args)), **kwargs}) if callable(grid) else grid


def _launch_binary(kernel, binder, device, grid: tuple, *args, **kwargs) -> None:
    """:func:`launch` once ``_binder`` has given the kernel's binder on ``device``."""
    bound, specialization, options = binder(*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()))
    binaries = _BINARIES.setdefault(kernel, {})
    compiled = binaries.get(key)
    if compiled is None:  # Triton compiles (or finds) the binary and launches it; later calls alike take it
        compiled = kernel[grid](*args, **kwargs)
        binaries[key] = compiled.result() if hasattr(compiled, "result") else compiled
        return
    g0, g1, g2 = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(g0, g1, g2, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *bound.values())


def launch_tuned(tuned, grid, *args, **kwargs) -> None:
    """``tuned[grid](*args, **kwargs)`` for an autotuned kernel (``triton.heuristics`` under the autotuner allowed).

    The first call of each key (the values of the names in the autotuner's key, and the first argument's dtype,
    which the kernels' other tensors follow) runs the autotuner; later calls launch the config it chose through
    its compiled binary (as :func:`launch`), its pre-hook and the heuristics applied as the autotuner and Triton
    apply them."""
    kernel, rules = _under_heuristics(tuned)
    binder, device = _binder(kernel)
    if binder is None:  # the calls Triton must see (see the module's notes)
        tuned[grid](*args, **kwargs)
        return
    key = (tuned, *tuned_key(tuned, args, kwargs))
    config = _CHOSEN.get(key)
    if config is None:
        tuned[grid](*args, **kwargs)
        _CHOSEN[key] = tuned.best_config
        return
    meta = {**kwargs, **config.all_kwargs()}
    named = dict(zip(tuned.arg_names, args))
    if config.pre_hook is not None:
        config.pre_hook({**named, **meta})
    for values in rules:
        for name, rule in values.items():
            meta[name] = rule({**named, **meta})
    _launch_binary(kernel, binder, device, _grid_of(grid, kernel, args, meta), *args, **meta)


@functools.cache
def _under_heuristics(tuned) -> tuple:
    """``(the jit function under an autotuner, the rules of the heuristics layers between them, outer first)``."""
    kernel, rules = tuned.fn, []
    while isinstance(kernel, Heuristics):
        rules.append(kernel.values)
        kernel = kernel.fn
    return kernel, tuple(rules)


def launch_any(kernel, grid, *args, **kwargs) -> None:
    """:func:`launch_tuned` for an autotuned kernel, else :func:`launch`."""
    (launch_tuned if isinstance(kernel, Autotuner) else launch)(kernel, grid, *args, **kwargs)


def tuned_key(tuned, args, kwargs) -> tuple:
    """What :func:`launch_tuned` keys a call by: the values of the autotuner's key names, then ``args[0]``'s dtype."""
    return (*(args[i] for i in _key_positions(tuned, len(args))), *(kwargs[k] for k in tuned.keys if k in kwargs),
            getattr(args[0], "dtype", None))


@functools.cache
def _key_positions(tuned, n_args: int) -> tuple:
    """The positions of the autotuner's key names among ``n_args`` positional arguments."""
    names = tuned.arg_names[:n_args]
    return tuple(names.index(k) for k in tuned.keys if k in names)


def _binder(kernel) -> tuple:
    """``(Triton's argument binder of kernel on the current device, the device)``, or ``(None, None)`` where
    the call goes through ``kernel[grid]``."""
    if torch.compiler.is_compiling() or not (isinstance(kernel, JITFunction) and _cuda() and _plain_runtime()
                                              and not kernel.pre_run_hooks):
        return None, None
    device = driver.active.get_current_device()
    entry = kernel.device_caches[device]  # (kernel cache, key cache, target, backend, binder) since Triton 3.3
    if isinstance(entry, tuple) and len(entry) == 5 and callable(entry[4]):
        return entry[4], device
    return None, None


@functools.cache
def _cuda() -> bool:
    """A CUDA device to launch on (else Triton has no driver: compiling for a target on a machine without one)."""
    return torch.cuda.is_available()


def _plain_runtime() -> bool:
    """No interpreter, debug or instrumentation mode, launch hook or pipeline inspection set in Triton's knobs."""
    rt = knobs.runtime
    return not (rt.interpret or rt.debug or knobs.compilation.instrumentation_mode or _hooked(rt.launch_enter_hook)
                or _hooked(rt.launch_exit_hook) or getattr(rt, "add_stages_inspection_hook", None) is not None)


def _hooked(hook) -> bool:
    """A launch hook is set: a function, or a chain of them (Triton 3.5 on) that is not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))
