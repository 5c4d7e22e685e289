"""Image prompts in the packed and shared-prompt training layouts (transformers' image-text classes).

A layout's row holds a prompt once (shared-prompt rows) or several sequences (packed rows); with images, the
image tokens are part of the prompt and ride along. Three things the image-text class works out for plain rows
are worked out here for the layout's slots, from what it would compute on one row per sequence:

- **the image inputs**: per-token keys (``token_type_ids``, ``mm_token_type_ids``) are each slot's value in its
  sequence (the layout's ``source``); per-image keys (pixels, grids) are the images of the sequences whose prompt
  tokens the rows hold, in the order those image tokens come in the rows (a shared prompt's once), which is the
  order the class scatters the features over the image tokens;
- **positions**: Qwen3.5's 3-D M-RoPE positions are the class's own ``get_rope_index`` on one row per sequence,
  gathered into the slots (``[4, R, S]``: the text position first, as its text model takes them); the Gemmas'
  are the layout's positions;
- **masks**: the layout's pairs, and where the family lets an image attend to itself bidirectionally (Gemma 3 in
  every layer; Gemma 4 with ``use_bidirectional_attention: vision``, in its sliding layers only: transformers'
  ``create_masks_for_vision_model`` of each), every pair of slots of one image (a run of image tokens of one
  segment) too; windows still apply by position distance.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from torchtune_grpo.models._transformers_layouts import SlotPairs

__all__ = ["bidirectional_layers", "image_blocks", "layout_image_inputs", "PER_TOKEN_KEYS", "POSITIONS_KEY",
           "ROW_KEYS", "with_blocks"]

#: Per-token image inputs (one value per prompt token; 0 = text); the others are per image.
PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
#: The image inputs :func:`layout_image_inputs` reads on one row per sequence: the per-token types and the grids
#: M-RoPE positions are computed from (not the pixels, which it takes per sequence).
ROW_KEYS = PER_TOKEN_KEYS + ("image_grid_thw", "video_grid_thw")
#: The key of :func:`layout_image_inputs`'s result holding the family's own position ids for the slots.
POSITIONS_KEY = "position_ids"
_MROPE = {"qwen3_5", "qwen3_5_moe"}


def bidirectional_layers(config: Any) -> Tuple[bool, bool]:
    """Whether an image attends to itself bidirectionally in the (full, sliding) attention layers of the image-text
    class with ``config`` (transformers 5.19's rule per family)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        return True, True
    if model_type == "gemma4":
        text = config.get_text_config()
        return False, getattr(text, "use_bidirectional_attention", None) == "vision"
    return False, False


def image_blocks(types: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``[R, S]`` long: each image's block id in its row (a run of image slots, ``types != 0``, of one segment),
    -1 on text and padding."""
    image = types != 0
    before = torch.nn.functional.pad(image, (1, 0))[:, :-1]
    same = torch.nn.functional.pad(segment, (1, 0), value=-2)[:, :-1] == segment
    starts = image & ~(before & same)
    return torch.where(image, starts.long().cumsum(dim=1) - 1, -1)


def with_blocks(pairs: SlotPairs, blocks: torch.Tensor, layers: Tuple[bool, bool]):
    """``allowed(window)`` (``[R, S, S]``) of ``pairs`` with an image's slots attending each other where
    ``layers`` says (full layers: ``window`` None; sliding layers: a window)."""

    def allowed(window: Optional[int] = None) -> torch.Tensor:
        base = pairs.allowed(window)
        if not layers[0 if window is None else 1]:
            return base
        same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)  # [R, S, S]
        if window is not None:  # AND(window, OR(causal, block)): the window by position distance still applies
            distance = pairs.position[:, :, None] - pairs.position[:, None, :]
            same = same & (distance < window)
        return base | same

    return allowed


def layout_image_inputs(inner: Any, per_sequence: Sequence[Optional[Mapping[str, torch.Tensor]]],
                        unshared: Optional[Mapping[str, torch.Tensor]], tokens: torch.Tensor,
                        lengths: Sequence[int], source: torch.Tensor) -> Optional[Dict[str, torch.Tensor]]:
    """The image inputs of a layout's rows (see the module docstring).

    Args:
        inner (Any): the image-text class's inner model (``policy.image_model``).
        per_sequence (Sequence[Optional[Mapping[str, torch.Tensor]]]): each of the ``n`` sequences' prompt image
            inputs (per-token keys ``[L_prompt]``), or None.
        unshared (Optional[Mapping[str, torch.Tensor]]): their :data:`ROW_KEYS` as one right-padded row per
            sequence (:func:`~torchtune_grpo.models._vision.batch_image_inputs`, width ``W``).
        tokens (torch.Tensor): ``[n, W]`` the sequences as one right-padded row each.
        lengths (Sequence[int]): each sequence's real length.
        source (torch.Tensor): ``[R, S, 2]`` long: each slot's ``(sequence, position)``, ``(-1, -1)`` on padding.

    Returns:
        Optional[Dict[str, torch.Tensor]]: per-token keys ``[R, S]``, per-image keys, and for M-RoPE families
        :data:`POSITIONS_KEY` ``[4, R, S]``; None when no sequence has images.
    """
    if unshared is None:
        return None
    seq, pos = source[..., 0], source[..., 1]
    real = seq >= 0
    s_idx, p_idx = seq.clamp(min=0), pos.clamp(min=0)
    out: Dict[str, torch.Tensor] = {}
    type_key = next(k for k in PER_TOKEN_KEYS if k in unshared)
    for key in PER_TOKEN_KEYS:
        if key in unshared:
            out[key] = torch.where(real, unshared[key][s_idx, p_idx], 0)
    # The sequences whose image tokens the rows hold, in the order those tokens come (row-major).
    held = seq[real & (out[type_key] != 0)]
    order: List[int] = list(dict.fromkeys(held.tolist()))
    per_image = sorted({k for i in order if per_sequence[i] is not None for k in per_sequence[i]} - set(PER_TOKEN_KEYS))
    for key in per_image:
        out[key] = torch.cat([per_sequence[i][key].to(tokens.device) for i in order if per_sequence[i] is not None
                              and key in per_sequence[i]], dim=0)
    if getattr(inner.config, "model_type", None) in _MROPE:
        width = tokens.size(1)
        mask = torch.arange(width, device=tokens.device)[None, :] < torch.tensor(list(lengths), device=tokens.device)[:, None]
        rope_kwargs = {k: v for k, v in unshared.items() if k in ("image_grid_thw", "video_grid_thw")}
        positions, _ = inner.get_rope_index(tokens, unshared[type_key], attention_mask=mask.long(), **rope_kwargs)
        gathered = torch.where(real, positions[:, s_idx, p_idx], 0)  # [3, R, S]
        out[POSITIONS_KEY] = torch.cat([torch.where(real, pos, 0)[None], gathered])
    return out
