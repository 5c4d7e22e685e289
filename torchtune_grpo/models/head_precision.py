"""The fused logprob head's matrix products: in the weight's dtype (``fp32``) or bf16 with fp32 accumulation.

``logprob_head`` in the config names one of :data:`HEAD_PRECISIONS`; :func:`set_head_precision` marks a model's
output projection with it and :func:`~torchtune_grpo.models.logprobs.chunked_logprobs` reads the mark. With
``bf16`` each chunk's hidden states and the weight are rounded to bf16 and multiplied with fp32 accumulation
and an fp32 result: ``torch.mm(..., out_dtype=torch.float32)`` on CUDA (torch >= 2.8: tensor cores), the same
products upcast to fp32 where that kernel does not exist (the CPU). bf16 x bf16 products are exact in fp32, so
both differ from a float64 evaluation of the rounded inputs only by fp32 summation order.
"""

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HEAD_PRECISIONS", "bf16_mm", "head_matmul_kernel", "project_chunk", "resolve_head_precision", "set_head_precision",
]

#: The fused head's matrix-product precisions (``logprob_head``): the weight's dtype, or bf16 inputs with fp32
#: accumulation and output.
HEAD_PRECISIONS = ("fp32", "bf16")
_HEAD_ATTR = "logprob_head_precision"
# Per (device type, "mm" | "addmm"): whether torch's fp32-output bf16 kernels (``torch.mm(..., out_dtype=
# torch.float32)``, CUDA in torch >= 2.8) ran there; False: the same products on bf16-rounded inputs upcast to
# fp32 (the CPU's only way).
_NATIVE_OUT_DTYPE: Dict[Tuple[str, str], bool] = {}


def set_head_precision(model: nn.Module, precision: str) -> None:
    """Make ``model``'s fused logprob head multiply in ``precision`` (one of :data:`HEAD_PRECISIONS`).

    Args:
        model (nn.Module): a torchtune decoder (its ``output`` projection is marked; FSDP2-wrapped or not).
        precision (str): ``"fp32"`` (the weight's dtype) or ``"bf16"`` (bf16 inputs, fp32 accumulation).

    Raises:
        ValueError: naming the ``logprob_head`` key and the valid values.
    """
    if precision not in HEAD_PRECISIONS:
        raise ValueError(f"logprob_head must be one of {HEAD_PRECISIONS}, got {precision!r}")
    setattr(model.output, _HEAD_ATTR, precision)


def head_matmul_kernel(device: torch.device) -> str:
    """How the ``bf16`` head multiplied on ``device``'s type: ``"out_dtype"`` (torch's fp32-output bf16 kernels,
    ``"out_dtype+add"`` when the weight gradient's in-place form fell back to a product plus an add),
    ``"upcast"`` (bf16-rounded inputs multiplied in fp32: the same products at the fp32 rate) or ``"unused"``."""
    kind = torch.device(device).type
    mm, addmm = _NATIVE_OUT_DTYPE.get((kind, "mm")), _NATIVE_OUT_DTYPE.get((kind, "addmm"))
    if mm is None:
        return "unused"
    if not mm:
        return "upcast"
    return "out_dtype+add" if addmm is False else "out_dtype"


def _native(kind: str, op: str, fn: Callable[[], torch.Tensor]) -> Optional[torch.Tensor]:
    """``fn()`` (a product with ``out_dtype``) unless it failed before on this device type; None when it fails."""
    if _NATIVE_OUT_DTYPE.get((kind, op), True):
        try:
            result = fn()
            _NATIVE_OUT_DTYPE[(kind, op)] = True
            return result
        except (RuntimeError, NotImplementedError, TypeError):
            _NATIVE_OUT_DTYPE[(kind, op)] = False  # no such kernel here (the CPU's case)
    return None


def bf16_mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` (``out += a @ b`` with fp32 ``out``) for bf16 ``a``, ``b``: fp32 accumulation, fp32 result."""
    kind = a.device.type
    f32 = torch.float32
    if out is not None:
        done = _native(kind, "addmm", lambda: torch.addmm(out, a, b, out_dtype=f32, out=out))
        if done is not None:
            return done
    product = _native(kind, "mm", lambda: torch.mm(a, b, out_dtype=f32))
    if product is None:
        if out is not None:
            return out.addmm_(a.float(), b.float())
        product = torch.mm(a.float(), b.float())
    return product if out is None else out.add_(product)


def resolve_head_precision(project: Callable[[torch.Tensor], torch.Tensor], precision: Optional[str]) -> str:
    """``precision`` if given, else what :func:`set_head_precision` marked ``project`` with (``fp32`` unmarked)."""
    precision = precision if precision is not None else getattr(project, _HEAD_ATTR, "fp32")
    if precision not in HEAD_PRECISIONS:
        raise ValueError(f"logprob_head must be one of {HEAD_PRECISIONS}, got {precision!r}")
    return precision


def project_chunk(h: torch.Tensor, weight: torch.Tensor, bf16_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """A chunk's logits ``[C, D] -> [C, V]`` in fp32: in the weight's dtype, or bf16 inputs with fp32 accumulation."""
    if bf16_weight is None:
        return F.linear(h, weight).float()
    return bf16_mm(h.to(torch.bfloat16), bf16_weight.t())
