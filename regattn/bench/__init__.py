"""regattn.bench: time ops against their peers in one process; JSON results, tables, plots, a report.

- :func:`measure` (``timing``): do_bench medians or CUDA-graph replay, peak memory, OOM as a status;
- :mod:`counts`: the FLOP and byte count of each op, its formula in the docstring;
- :func:`machine_info`, :func:`write_result`, :func:`read_result` (``results``);
- :mod:`peers`: torch SDPA backends, FlexAttention, flash-linear-attention, our reference;
- :mod:`suites`: softmax, parallax, gatedfwa, decay, lla, scan, mesanet, nsa; :func:`run_suite` runs one;
- :func:`benchmark_method`: a user's decay method, checked, then timed beside the built-ins;
- ``regattn bench SUITE`` (:mod:`cli`) and ``regattn bench report`` (:mod:`report`).
"""
from regattn.bench.method import benchmark_method
from regattn.bench.results import machine_info, read_result, write_result
from regattn.bench.runner import Case, Setup, format_table, run_suite
from regattn.bench.timing import Measurement, measure

__all__ = ["benchmark_method", "machine_info", "read_result", "write_result", "Case", "Setup", "format_table",
           "run_suite", "Measurement", "measure"]
