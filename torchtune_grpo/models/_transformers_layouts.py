"""The training layouts (packed rows, shared-prompt rows) on transformers' own modules: explicit attention masks.

A layout (:class:`~torchtune_grpo.training.packed_rows.PackedMask`,
:class:`~torchtune_grpo.training.shared_prompt_rows.SharedPromptMask`) describes which slot of a row may attend
which with one :class:`SlotPairs` (its ``pairs(input_pos)``): each slot's segment, whether every segment of its
row sees it (a shared prompt's real tokens), and its position id. From it this module builds the 4-D mask transformers'
attention takes as given (``masking_utils`` returns a 4-D mask as it is), in the format the attention
implementation reads: bool (True = attend) for ``sdpa``, additive float (0 / the dtype's minimum) for ``eager``,
whose attention adds the mask to the scores (gpt-oss's eager path too, before appending its sinks).

Causality and sliding windows are by POSITION, not by slot: in a shared-prompt row a completion's slots come
after other completions' slots, but its positions continue from the prompt, and a window of ``w`` lets a token at
position ``p`` see positions ``> p - w`` (transformers' ``sliding_window_overlay``: ``kv > q - w``).

Which mask each layer gets is the family's own rule, checked in transformers 5.19's modeling files:

- families whose base model accepts a dict of masks (``if not isinstance(causal_mask_mapping := attention_mask,
  dict)``) get one per ``config.layer_types`` value: ``full_attention`` unwindowed, ``sliding_attention`` with
  ``config.sliding_window`` (qwen2 too: Qwen2.5's ``use_sliding_window`` windows the layers from
  ``max_window_layers`` on, as ``sliding_attention`` entries of ``layer_types``);
- the others take one mask for every layer, windowed exactly when the family windows it
  (``config.sliding_window is not None`` for mistral, ministral3, phi3, qwen3_moe, mixtral; never for llama,
  olmoe, olmo2 and granite).

Linear-attention layers (Qwen3.5's ``linear_attention``, Gated DeltaNet, whose state runs along the row and whose
torch path takes no sequence boundaries) get no mask: they take the row's sequences apart
(:mod:`._transformers_recurrent`). Explicit masks by position elsewhere (a multi-turn session's history with
holes) refuse them, as a running state cannot skip a hole.

Anything else is refused by name (:func:`layouts_unsupported`), and the training layouts then fall back to one
row per sequence: an attention implementation other than ``sdpa`` or ``eager``, bidirectional attention, or a
family not checked here.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Union

import torch

from torchtune_grpo.models._transformers_recurrent import (
    LINEAR_ATTENTION, recurrent_layers, SequenceRows, split_sequences,
)

__all__ = [
    "SlotPairs", "config_unsupported", "decode_mask_unsupported", "decode_step_mask", "layouts_unsupported",
    "layout_attention_mask", "masks_by_layer_type",
]

# model_type -> how its base model takes masks: "per_type" (a dict keyed by layer type) or "one" (one 4-D mask).
_MASK_STYLE = {
    "qwen3": "per_type", "qwen2": "per_type", "gemma3_text": "per_type", "gemma4_text": "per_type",
    "olmo3": "per_type", "smollm3": "per_type", "gpt_oss": "per_type", "qwen3_5_text": "per_type",
    "qwen3_5_moe_text": "per_type", "gemma2": "per_type", "cohere2": "per_type",
    "llama": "one", "olmoe": "one", "olmo2": "one", "granite": "one",  # never windowed
    "mistral": "one", "ministral3": "one", "phi3": "one", "qwen3_moe": "one", "mixtral": "one",
}
_NEVER_WINDOWED = {"llama", "olmoe", "olmo2", "granite"}
_ATTENTION_TYPES = ("full_attention", "sliding_attention")
# Layer types that are not softmax attention over the row, and why a row of several sequences breaks them.
_RECURRENT = {LINEAR_ATTENTION: "Gated DeltaNet"}
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")
# The native engine's rollout attention (models/_grouped_attention.py): ``sdpa``'s masks, grouped heads.
_GROUPED_SDPA = "sdpa_grouped_kv"


class SlotPairs(NamedTuple):
    """Which slot of a row attends which, as both backends' masks are built from it. ``R`` rows, ``S`` slots.

    Slot ``q`` attends slot ``k`` when both are in the same segment (or ``k`` is ``shared`` and ``q`` is not
    padding), ``position[k] <= position[q]``, and, under a window ``w``, ``position[q] - position[k] < w``.
    Every slot attends itself (a padding slot only itself), so no softmax row is empty.

    Attributes:
        segment (torch.Tensor): ``[R, S]`` long, the slot's segment in its row; -1: padding.
        shared (torch.Tensor): ``[R, S]`` bool, a slot every segment of its row sees (a shared prompt's real
            tokens).
        position (torch.Tensor): ``[R, S]`` long position ids.
    """

    segment: torch.Tensor
    shared: torch.Tensor
    position: torch.Tensor

    def allowed(self, window: Optional[int] = None) -> torch.Tensor:
        """``[R, S, S]`` bool: ``[r, q, k]`` True where slot ``q`` attends slot ``k`` (window ``w`` or None)."""
        seg_q, seg_k = self.segment[:, :, None], self.segment[:, None, :]
        real_q = seg_q >= 0
        sees = real_q & ((seg_q == seg_k) | self.shared[:, None, :])
        position = self.position.to(torch.int32)  # positions < 2^31; half the memory of the [R, S, S] difference
        distance = position[:, :, None] - position[:, None, :]  # [R, S, S]: q's position minus k's
        sees = sees & (distance >= 0)
        if window is not None:
            sees = sees & (distance < window)
        s = self.segment.size(1)
        return sees | torch.eye(s, dtype=torch.bool, device=sees.device)


def _config(model: Any) -> Any:
    return model.causal_lm.config


def layouts_unsupported(model: Any) -> Optional[str]:
    """Why the packed and shared-prompt layouts cannot run on ``model`` (a ``TransformersDecoder``), or None.

    Args:
        model (Any): a :class:`~torchtune_grpo.models.TransformersDecoder`.

    Returns:
        Optional[str]: a reason naming the layer type, attention implementation or family; None when the
        layouts' masks are this family's own.
    """
    config = _config(model)
    recurrent = sum(kind in _RECURRENT for kind in getattr(config, "layer_types", None) or ())
    if recurrent and len(recurrent_layers(model.causal_lm)) != recurrent:
        return (f"its {recurrent} linear_attention layers are not the {_RECURRENT[LINEAR_ATTENTION]} mixers "
                "the layouts take apart by sequence")
    return config_unsupported(config, recurrent_ok=True)


def config_unsupported(config: Any, recurrent_ok: bool = False) -> Optional[str]:
    """:func:`layouts_unsupported` for a causal LM's ``config``: why explicit position masks cannot run on it.

    Args:
        config (Any): the causal LM's config.
        recurrent_ok (bool): whether linear-attention layers are taken care of (the training layouts split their
            rows by sequence); a session's masks by position cannot (a running state cannot skip a hole).
    """
    model_type = getattr(config, "model_type", None)
    for kind in getattr(config, "layer_types", None) or ():
        if kind in _RECURRENT and recurrent_ok:
            continue
        if kind in _RECURRENT:
            return (f"its {kind} layers ({_RECURRENT[kind]}) carry recurrent state along a row, across the sequences "
                    "a layout puts in it")
        if kind not in _ATTENTION_TYPES:
            return f"its {kind} layers are not plain causal attention"
    if model_type not in _MASK_STYLE:
        return f"the layouts' attention masks are not checked for transformers' model_type {model_type!r}"
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation == _GROUPED_SDPA:  # sdpa's masks (a rollout's attention)
        implementation = "sdpa"
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        return (f"its attention implementation {implementation!r} takes no explicit mask here (the layouts run "
                f"with {' or '.join(SUPPORTED_IMPLEMENTATIONS)}: set model.attn_implementation)")
    if getattr(config, "use_bidirectional_attention", None) not in (None, False, "vision"):
        # "vision" (Gemma 4) makes only image tokens attend to their image both ways: text is causal.
        return "its attention is bidirectional (use_bidirectional_attention)"
    return None


def _format(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """``[R, Q, K]`` bool -> ``[R, 1, Q, K]`` in the implementation's format."""
    allowed = allowed[:, None]
    if implementation == "eager":  # the eager attention adds the mask to the scores
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    return allowed


def layout_attention_mask(model: Any, pairs: SlotPairs,
                          allowed: Optional[Callable[[Optional[int]], torch.Tensor]] = None
                          ) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    """The ``attention_mask`` for ``model``'s base model that makes it attend exactly as ``pairs`` says.

    Args:
        model (Any): a ``TransformersDecoder`` that :func:`layouts_unsupported` accepts.
        pairs (SlotPairs): the layout's description, ``[R, S]`` per field.
        allowed (Optional[Callable[[Optional[int]], torch.Tensor]]): the pairs by window (``[R, S, S]``), where
            they are more than ``pairs.allowed`` (an image attending to itself: :mod:`._vision_layouts`).

    Returns:
        Union[torch.Tensor, Dict[str, torch.Tensor]]: one ``[R, 1, S, S]`` mask, or one per layer type.

    Raises:
        ValueError: when :func:`layouts_unsupported` names a reason.
    """
    reason = layouts_unsupported(model)
    if reason is not None:
        raise ValueError(f"the packed and shared-prompt training layouts cannot run on this model: {reason}")
    masks = masks_by_layer_type(_config(model), model.tok_embeddings.weight.dtype, allowed or pairs.allowed)
    if LINEAR_ATTENTION in (getattr(_config(model), "layer_types", None) or ()):
        split_sequences(model.causal_lm)
        masks[LINEAR_ATTENTION] = SequenceRows(pairs)
    return masks


def masks_by_layer_type(config: Any, dtype: torch.dtype, allowed: Callable[[Optional[int]], torch.Tensor]
                        ) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    """The ``attention_mask`` the family's base model takes: ``allowed(window)`` (``[R, Q, K]`` bool) formatted for
    its attention implementation, one mask or one per layer type (the module docstring's rule).

    Args:
        config (Any): the causal LM's config (one :func:`config_unsupported` accepts).
        dtype (torch.dtype): the dtype the attention computes in (an ``eager`` mask is additive in it).
        allowed (Callable[[Optional[int]], torch.Tensor]): ``window`` (or None) -> ``[R, Q, K]`` bool.

    Returns:
        Union[torch.Tensor, Dict[str, torch.Tensor]]: ``[R, 1, Q, K]``, or one such per layer type.
    """
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    window = getattr(config, "sliding_window", None)
    if _MASK_STYLE[config.model_type] == "one":
        if config.model_type in _NEVER_WINDOWED:
            window = None
        return _format(allowed(window), implementation, dtype)
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    masks = {}
    for kind in kinds - set(_RECURRENT):  # each layer type's mask, built once for all its layers
        masks[kind] = _format(allowed(window if kind == "sliding_attention" else None), implementation, dtype)
    return masks


def decode_mask_unsupported(config: Any) -> Optional[str]:
    """Why :func:`decode_step_mask` cannot give ``config``'s model a one-token decode step's mask, or None.

    Args:
        config (Any): the causal LM's config.

    Returns:
        Optional[str]: the reason (the layouts' own, :func:`config_unsupported`, or an ``eager`` attention), or
        None.
    """
    reason = config_unsupported(config, recurrent_ok=True)
    if reason is None and getattr(config, "_attn_implementation", None) == "eager":
        # An eager mask is additive in the dtype the forward computes in, which under mixed precision only the
        # forward knows (transformers takes its embeddings' dtype); a bool mask (sdpa) has no dtype.
        return "its eager attention takes additive masks in the forward's own dtype"
    return reason


def decode_step_mask(config: Any, dtype: torch.dtype, visible: torch.Tensor
                     ) -> Union[torch.Tensor, Dict[str, Optional[torch.Tensor]]]:
    """The ``attention_mask`` of a one-token decode step on transformers' dynamic cache, built as transformers would.

    The new token is the last of ``S`` slots and sees every earlier slot that is not padding, so transformers' own
    mask for the step (``create_causal_mask`` on the ``[n, S]`` padding mask) keeps exactly the slots ``visible``
    keeps. A sliding-window layer's cache (``DynamicSlidingWindowLayer``) holds its last ``w - 1`` slots and the
    new one, and a window of ``w`` keeps all of them (``kv > q - w``): its mask is the last ``min(S, w)`` columns.
    Linear-attention layers take no mask in a one-token step (``create_recurrent_attention_mask``: a sampled token
    is never padding).

    Args:
        config (Any): the causal LM's config (one :func:`decode_mask_unsupported` accepts).
        dtype (torch.dtype): the dtype the attention computes in (unused by ``sdpa``'s bool masks).
        visible (torch.Tensor): ``[n, S]`` bool, True on the cache slots that hold a token (the new one included).

    Returns:
        Union[torch.Tensor, Dict[str, Optional[torch.Tensor]]]: ``[n, 1, 1, K]`` (``K`` the layer's cached slots),
        or one per layer type (None for linear-attention layers).
    """
    def allowed(window: Optional[int]) -> torch.Tensor:
        kept = visible if window is None else visible[:, -window:]
        return kept[:, None, :]  # [n, 1, K]

    masks = masks_by_layer_type(config, dtype, allowed)
    if isinstance(masks, dict) and LINEAR_ATTENTION in (getattr(config, "layer_types", None) or ()):
        masks[LINEAR_ATTENTION] = None
    return masks
