"""The decode steps of a rollout's two KV-cache layouts (:mod:`~torchtune_grpo.generation._rollout_caches`).

:func:`prefix_decode_step` decodes the shared-prefix layout, :func:`decode_step` the per-row one. Both have fixed
shapes (what CUDA graphs capture) and never read a value back to the host; :class:`RolloutResources` is what a
layout takes from the engine that runs it.
"""

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from torchtune_grpo.generation._cache import KVCachePool
from torchtune_grpo.generation._prefix_attention import lean_decode_layer, PrefixDecodeMask

__all__ = ["additive_mask", "decode_step", "prefix_decode_step", "RolloutResources"]


class RolloutResources(NamedTuple):
    """What a rollout's layout takes from the engine that runs it (kept by the engine across rollouts).

    Attributes:
        cache (KVCachePool): the key/value storage.
        write_slot (torch.Tensor): ``[1]`` long, the caches' write position: one buffer per device for the
            engine's lifetime (a CUDA graph records its address).
        compile_step (Callable[[Callable], Callable]): a decode step function -> the function to call (the
            compiled step, or the step itself when decoding runs eagerly).
        share_prefill (bool): prefill each prompt once and share its cache with its group.
        row_write_slot (torch.Tensor): ``[N, 1]`` long, each row's write position in a multi-turn session's
            later turns (likewise one buffer per device and row count).
    """

    cache: KVCachePool
    write_slot: torch.Tensor
    compile_step: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]
    share_prefill: bool
    row_write_slot: torch.Tensor


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep``, ``-inf`` elsewhere, in ``dtype``: what SDPA turns a boolean mask into."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def decode_step(
    model: nn.Module,
    token: torch.Tensor,
    pos: torch.Tensor,
    pad: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    write_slot: torch.Tensor,
    direct: bool = False,
    mask_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """One decode step with fixed shapes and no host synchronisation (what CUDA graphs capture).

    The model must have the engine's caches attached and its ``unembed`` replaced by last-position logits.

    Args:
        model (nn.Module): the torchtune decoder.
        token (torch.Tensor): ``[N]`` the tokens just sampled.
        pos (torch.Tensor): 0-d long: the cache slot ``token`` goes to; or ``[N]``: each row's (a session's
            later turns, with ``write_slot`` ``[N, 1]``).
        pad (torch.Tensor): ``[N]`` long: left-padding slots of each row.
        valid (torch.Tensor): ``[N, W]`` bool: slots that hold a real (non-pad) token, over the window.
        slot_ids (torch.Tensor): ``[W]`` ``arange(W)``.
        write_slot (torch.Tensor): ``[1]`` long: the caches' write position (a static buffer, set here).
        direct (bool): run the decoder's layers without module hooks (see :func:`can_skip_module_hooks`).
            Default is False.
        mask_dtype (Optional[torch.dtype]): give attention an additive mask of this dtype (0 where a slot
            is seen, ``-inf`` where not), built once per step, instead of a boolean one: the same numbers
            (SDPA turns a boolean mask into exactly this), but on CPU SDPA otherwise converts the boolean
            mask again in every layer, which costs more than the attention itself at small widths.
            Default is None (boolean).

    Returns:
        torch.Tensor: ``[N, V]`` float32 next-token logits.
    """
    write_slot.copy_(pos.view(write_slot.shape))
    mask = (valid & (slot_ids <= pos.view(-1, 1))).unsqueeze(1)  # [N, 1, W]: real tokens up to and incl. pos
    if mask_dtype is not None:
        mask = additive_mask(mask, mask_dtype)
    input_pos = (pos - pad).view(-1, 1)  # [N, 1]: position ids skip the padding
    return _run_decoder(model, token, mask, input_pos, direct)


def prefix_decode_step(
    model: nn.Module,
    token: torch.Tensor,
    step: torch.Tensor,
    lengths: torch.Tensor,
    prefix_mask: torch.Tensor,
    write_slot: torch.Tensor,
    completion_slots: Optional[torch.Tensor] = None,
    direct: bool = False,
    lean: bool = False,
) -> torch.Tensor:
    """:func:`decode_step` for the shared-prefix cache (:class:`SharedPrefixKVCache` attached).

    Args:
        model (nn.Module): the torchtune decoder.
        token (torch.Tensor): ``[N]`` the tokens just sampled.
        step (torch.Tensor): 0-d long: the completion slot ``token`` goes to (0 for the first token); or
            ``[N]``: each row's (a session's later turns, with ``write_slot`` ``[N, 1]``).
        lengths (torch.Tensor): ``[N]`` long: each row's prompt length (its position ids continue there).
        prefix_mask (torch.Tensor): ``[B, 1, 1, Pw]`` additive mask of the prompt slots.
        write_slot (torch.Tensor): ``[1]`` long: the caches' write position (a static buffer, set here).
        completion_slots (Optional[torch.Tensor]): ``[Wc]`` ``arange(Wc)`` for a fixed completion window
            (compiled steps; slots after ``step`` are masked), or None when the caches' window is exactly
            ``step + 1`` slots. Default is None.
        direct (bool): run the decoder's layers without module hooks. Default is False.
        lean (bool): with ``direct``, run each layer as :func:`lean_decode_layer` (see
            :func:`lean_decode_eligible`). Default is False.

    Returns:
        torch.Tensor: ``[N, V]`` float32 next-token logits.
    """
    write_slot.copy_(step.view(write_slot.shape))
    completion = None
    if completion_slots is not None:  # [1 or N, 1, 1, Wc]
        seen = completion_slots <= step.view(-1, 1)
        completion = additive_mask(seen, prefix_mask.dtype).view(-1, 1, 1, completion_slots.size(0))
    mask = PrefixDecodeMask(prefix_mask, completion)
    input_pos = (lengths + step).view(-1, 1)
    if not (direct and lean):
        return _run_decoder(model, token, mask, input_pos, direct)
    h = _layer_input(model, model.tok_embeddings.forward(token.unsqueeze(1)))
    for layer in model.layers:
        h = lean_decode_layer(layer, h, mask, input_pos)
    return model.unembed(h)


def _run_decoder(
    model: nn.Module, token: torch.Tensor, mask: object, input_pos: torch.Tensor, direct: bool
) -> torch.Tensor:
    if not direct:
        return model(token.unsqueeze(1), mask=mask, input_pos=input_pos)
    # TransformerDecoder.forward without hooks: embeddings, layers, (replaced) unembed.
    h = _layer_input(model, model.tok_embeddings(token.unsqueeze(1)))
    for layer in model.layers:
        h = layer.forward(h, mask=mask, input_pos=input_pos)
    return model.unembed(h)


def _layer_input(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    # The layers' forward is called without FSDP2's hooks, so nothing casts their input: under mixed
    # precision (fp32 embeddings, bf16 layers; torchtune_grpo/runtime/precision.py) do it here.
    return h.to(next(model.layers[0].parameters()).dtype)
