"""Floating-point bounds for tests, stated in units of last place (ulp) of what is compared.

Two fp32 computations of the same quantity in a different order (another kernel, another BLAS blocking, the
CPU's AVX-512, AVX2 or scalar code: ``ATEN_CPU_CAPABILITY``) each round once per operation. A sum of ``n``
terms rounded in two orders differs by up to about ``n`` ulp of its magnitude in the worst case, and by about
``sqrt(n)`` ulp typically (rounding errors of random sign). A test's bound is therefore a number of ulp of the
largest value compared, worked out next to the test from the operations between the two results.
"""

import torch

__all__ = ["ulps"]


def ulps(reference: torch.Tensor, n: float, dtype: torch.dtype = torch.float32) -> float:
    """``n`` units in the last place of ``dtype`` at the magnitude of ``reference`` (its largest absolute value).

    Args:
        reference (torch.Tensor): what the bound is about (any shape).
        n (float): how many units in the last place.
        dtype (torch.dtype): the precision the compared values were computed in. Default is float32.

    Returns:
        float: an absolute tolerance, ``n * eps(dtype) * max|reference|``.
    """
    return float(n * torch.finfo(dtype).eps * reference.detach().abs().max().to(torch.float64))
