"""Floating-point bounds for tests, stated in units of last place (ulp) of what is compared.

Two fp32 computations of the same quantity in a different order (another kernel, another BLAS blocking, the
CPU's AVX-512, AVX2 or scalar code: ``ATEN_CPU_CAPABILITY``) each round once per operation. A sum of ``n``
terms rounded in two orders differs by up to about ``n`` ulp of its magnitude in the worst case, and by about
``sqrt(n)`` ulp typically (rounding errors of random sign). A test's bound is therefore a number of ulp of the
largest value compared, worked out next to the test from the operations between the two results.
"""

import torch

__all__ = ["logit_ulps", "ulps"]


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


def logit_ulps(model: torch.nn.Module, sequences, n: float) -> float:
    """``n`` fp32 ulp of the largest logit ``model`` gives on ``sequences`` (token-id lists, each run alone).

    Logprobs and entropies are differences of logits and a logsumexp over them: their rounding error is a number
    of ulp of the logits, not of the (possibly small) logprob, so bounds on them are stated at this magnitude.

    Args:
        model (torch.nn.Module): a decoder returning ``[1, T, V]`` logits for ``[1, T]`` tokens.
        sequences: lists of token ids.
        n (float): how many units in the last place.

    Returns:
        float: an absolute tolerance, ``n * eps(float32) * max |logit|``.
    """
    device = next(model.parameters()).device
    with torch.no_grad():
        largest = max(model(torch.tensor([list(s)], device=device)).abs().max().cpu() for s in sequences)
    return ulps(largest, n)
