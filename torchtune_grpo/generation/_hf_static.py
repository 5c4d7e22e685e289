"""A fixed-shape cache and a compiled decode step for the native engine on transformers' own modules.

On CUDA the torchtune backend's decode step runs as CUDA graphs (``torch.compile(mode="reduce-overhead")``): one
replay per token instead of hundreds of kernel launches from Python. A graph needs fixed shapes and fixed
addresses, which transformers' growing caches do not have. This module gives a transformers policy the same:

- **the cache**: transformers' ``StaticCache`` for the model's config, its sliding-window layers replaced by full
  ``StaticLayer`` ones. Every attention layer then holds ``capacity`` slots, ``[N, H, capacity, D]``, written in
  place at the layer's own counter; a sliding window is applied by the mask, from positions, exactly as
  transformers' mask functions do for a full-length cache (a windowed layer keeps its whole history: more memory,
  one graph for every layer kind). The cache is kept between rollouts while its shape stays the same (``reset``
  zeroes it in place), so the graphs recorded on its buffers replay.
- **the prefill** stays eager (one per group, images included, as :class:`~torchtune_grpo.generation._hf_rollout.
  HFRollout` runs it, on a cache whose attention layers all keep their whole history); its keys and values are
  then written into the fixed cache with the layers' own ``update`` (:func:`fill_fixed`).
- **the attention mask** is a ``[N, capacity]`` buffer: the prompt's columns from the prefill, each decode step's
  column set to 1 before the step; slots after the current one are 0, so every step attends to exactly what the
  growing cache would hold. Masked slots add exact zeros, so only the reduction order over the longer rows can
  differ from the eager path (last bits).
- **the decode step** (:func:`static_decode_step`) is compiled once per shape (``dynamic=False``) by the engine's
  ``compile_decode`` settings; rows do not leave the batch (``compact_decode`` is eager-only, as on the torchtune
  backend).

Linear-attention layers (Qwen3.5's Gated DeltaNet) keep transformers' own cache layer, whose convolution and
recurrent states have fixed shapes and are written in place already; the prefill's states are copied into them.

Where it does not apply, the engine decodes eagerly and says why once (:func:`static_decode_unsupported`): cache
layers with no fixed-shape form here (hybrid layers holding both kinds, indexed attention), and mixtures of
experts, whose routes are recorded per forward by hooks a graph would not run.
"""

import logging
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

# transformers is imported in the functions, not here: the native engine imports this module, and a run without a
# transformers policy (`make demo`'s environment has no transformers) must not need it.

__all__ = ["StaticDecode", "fill_fixed", "static_decode_step", "static_decode_unsupported"]

log = logging.getLogger(__name__)

_warned: set = set()


def static_decode_unsupported(hf: nn.Module, records_routes: bool) -> Optional[str]:
    """Why ``hf`` cannot decode on a fixed-shape cache, or None when it can.

    Args:
        hf (nn.Module): a transformers causal LM.
        records_routes (bool): the rollout records a mixture of experts' routes per forward (router hooks).

    Returns:
        Optional[str]: the reason, naming the layer type, or None.
    """
    from transformers import StaticCache, StaticLayer, StaticSlidingWindowLayer

    if records_routes:
        return "the mixture of experts' routes are recorded by hooks at every decode forward"
    try:
        layers = StaticCache(config=hf.config, max_cache_len=1).layers
    except (ValueError, KeyError, TypeError) as e:  # a config transformers cannot lay out statically
        return f"transformers builds no StaticCache for this config ({e})"
    for layer in layers:
        if not (type(layer) in (StaticLayer, StaticSlidingWindowLayer) or _is_linear(layer)):
            return f"its {type(layer).__name__} cache layers have no fixed-shape form here"
    return None


def _is_linear(layer: Any) -> bool:
    """A linear-attention layer's cache alone (convolution and recurrent states, fixed shapes by nature)."""
    from transformers import StaticLayer

    return hasattr(layer, "update_recurrent_state") and not isinstance(layer, StaticLayer)


def fill_fixed(fixed: Any, grown: Any) -> None:
    """Write the prefilled cache ``grown`` (``N`` rows, every attention layer holding all its slots) into ``fixed``.

    Each layer's own update methods write in place, so the fixed buffers keep their addresses (a recorded graph
    reads them): keys and values into slots ``0 .. S-1``; a linear-attention layer's convolution and recurrent
    states copied as they are.
    """
    for into, layer in zip(fixed.layers, grown.layers):
        if not _is_linear(into):
            into.update(layer.keys, layer.values)
            continue
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                into.update_conv_state(layer.conv_states[i], state_idx=i, conv_kernel_size=layer.conv_kernel_size[i])
            if layer.is_recurrent_states_initialized[i]:
                into.update_recurrent_state(layer.recurrent_states[i], state_idx=i)


def warn_eager_once(model_type: str, reason: str) -> None:
    """Log once per model type that decode steps run eagerly although ``compile_decode`` asked otherwise."""
    if model_type not in _warned:
        _warned.add(model_type)
        log.warning("compile_decode: %s decodes eagerly on transformers' growing cache: %s", model_type, reason)


def static_decode_step(hf: nn.Module, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """One decode forward on the fixed cache: ``ids [N, 1]`` at ``positions`` -> the next logits ``[N, V]`` fp32.

    Args:
        hf (nn.Module): the causal LM.
        cache (StaticCache): the fixed cache (written in place at each layer's counter).
        ids (torch.Tensor): ``[N, 1]`` the tokens fed.
        positions (torch.Tensor): ``[N, 1]`` their position ids (``[4, N, 1]`` with M-RoPE).
        mask (torch.Tensor): ``[N, capacity]`` 1 on the slots each row attends to, this step's included.

    Returns:
        torch.Tensor: ``[N, V]`` fp32.
    """
    out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
             logits_to_keep=1)
    return out.logits[:, -1].float()


class StaticDecode:
    """The engine's fixed caches for transformers' modules, kept between rollouts of the same shape.

    Args:
        multiple (int): capacities are rounded up to a multiple of this (bounds the number of compiled shapes).
    """

    def __init__(self, multiple: int) -> None:
        self.multiple = max(1, int(multiple))
        # One cache and mask at a time: (id(hf), rows, capacity, dtype, device) -> (cache, mask [N, capacity]).
        self._held: Dict[Tuple[Any, ...], Tuple[Any, torch.Tensor]] = {}

    def release(self) -> None:
        """Free the held cache (the next rollout allocates one, and compiled graphs are recorded anew)."""
        self._held.clear()

    def take(self, hf: nn.Module, rows: int, slots: int, device: torch.device) -> Tuple[Any, torch.Tensor]:
        """A zeroed fixed cache (transformers' ``StaticCache``) and ``[rows, capacity]`` mask of at least ``slots``
        slots, kept for the next call."""
        from transformers import StaticCache, StaticLayer

        capacity = -(-slots // self.multiple) * self.multiple
        dtype = next(hf.parameters()).dtype
        key = (id(hf), rows, capacity, dtype, str(device))
        held = self._held.get(key)
        if held is None:
            self._held.clear()  # one shape at a time: a new prompt width or batch replaces the old buffers
            cache = StaticCache(config=hf.config, max_cache_len=capacity)
            # Windowed layers hold every slot too (the mask applies the window), so one layer kind serves all.
            cache.layers = [layer if _is_linear(layer) else StaticLayer(max_cache_len=capacity)
                            for layer in cache.layers]
            mask = torch.zeros((rows, capacity), dtype=torch.long, device=device)
            held = self._held[key] = (cache, mask)
        else:
            held[0].reset()
            held[1].zero_()
        return held
