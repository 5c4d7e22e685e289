"""transformers' ``sdpa`` attention with grouped-query heads left to the kernel, for decoding on the CPU.

transformers' ``sdpa`` attention (``transformers.integrations.sdpa_attention``) repeats a grouped-query model's
key and value heads to the query heads (``repeat_kv``: a copy of the whole cache) whenever an attention mask is
given, because CUDA's fused kernels refuse grouped heads with a mask. The native engine's decode always has a
mask once prompts of different lengths are left-padded, so every decode step copied every layer's whole cache:
``O(T^2)`` copies over a ``T``-token completion, half of a 1,024-token rollout's time on a tiny Qwen2 on CPU.
PyTorch's CPU kernels take the grouped heads with a mask (``enable_gqa=True``) and give the same numbers, bit for
bit: each query head meets the same key and value rows in the same order.

:func:`grouped_kv_attention` switches a model's attention to that variant for the duration of a rollout
(transformers' public ``set_attn_implementation`` with a function registered under :data:`GROUPED_SDPA` through
``AttentionInterface``; masks built as for ``sdpa``). Only a model on ``sdpa`` is switched; every call the
variant does not cover (no mask, no grouping, a device other than the CPU, a position bias, unequal key and
value head sizes) goes to transformers' own ``sdpa`` function unchanged.
"""

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
from torch import nn

__all__ = ["GROUPED_SDPA", "grouped_kv_attention", "sdpa_with_grouped_kv"]

GROUPED_SDPA = "sdpa_grouped_kv"
_registered = False


def sdpa_with_grouped_kv(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention function, grouped heads passed to the kernel when a mask is given (CPU).

    Args:
        module (nn.Module): the attention layer (its ``num_key_value_groups``).
        query (torch.Tensor): ``[B, H, q, D]``.
        key (torch.Tensor): ``[B, H_kv, k, D]``.
        value (torch.Tensor): ``[B, H_kv, k, D]``.
        attention_mask (Optional[torch.Tensor]): ``[B, 1, q, k]`` bool (True: attend) or additive float, or None.
        dropout (float): attention dropout probability. Default is 0.0.
        scaling (Optional[float]): the score scale; None is ``D ** -0.5``. Default is None.
        is_causal (Optional[bool]): as for transformers' function. Default is None.
        **kwargs: passed on to transformers' function where it runs.

    Returns:
        Tuple[torch.Tensor, None]: ``[B, q, H, D]`` the attention output, and no weights.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # With a mask transformers' function never runs causal: the mask says everything.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(GROUPED_SDPA, sdpa_with_grouped_kv)
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
        _registered = True


@contextmanager
def grouped_kv_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model`` (a transformers model on ``sdpa``) attends with :func:`sdpa_with_grouped_kv`.

    A model on another implementation (``eager``, flash, flex) is left as it is.

    Args:
        model (nn.Module): a transformers ``PreTrainedModel``.

    Yields:
        None
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    _register()
    model.set_attn_implementation(GROUPED_SDPA)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
