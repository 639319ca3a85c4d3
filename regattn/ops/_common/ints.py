"""Integer arithmetic of kernel launches on the host.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called outside a kernel
each costs about 2 us, several of them a sizeable share of one decode step's host time.
"""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0`` (as ``triton.cdiv``)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length()
