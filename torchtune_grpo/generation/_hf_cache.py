"""A transformers KV cache whose attention layers grow in place, for the native engine's decode.

transformers' ``DynamicLayer`` appends each decode step's keys and values with ``torch.cat``: every step copies the
whole cache, so a completion of ``T`` tokens copies ``O(T^2)`` key/value slots per layer (measured: a third of a
1,024-token decode of a tiny Qwen2 on CPU). :class:`GrowingLayer` keeps them in a buffer with room to spare,
doubled when full, and writes each step's slots into it: ``O(T)`` copies in all, amortised. Attention reads a view
of the filled part, so every forward sees the same keys and values, in the same order, as with ``DynamicLayer``.

transformers' sliding-window layer (``DynamicSlidingWindowLayer``, window ``w``) does the same ``torch.cat`` of its
last ``w - 1`` slots and the new ones at every step, then keeps the last ``w - 1``: up to ``w`` slots copied per
token and layer (Gemma 3 and 4 window five layers in six, with ``w`` of 512 to 1,024). :class:`GrowingWindowLayer`
writes each step's slots after the kept ones in a buffer with room to spare (doubled while the row is shorter than
the window, about ``w`` more once it is longer) and moves the kept slots to a new buffer only when that room is used
up: about one slot copied per token, amortised; attention reads the same slots in the same order.

Plain full-attention layers (``type(layer) is DynamicLayer``) and transformers' own sliding-window layers are
replaced; linear-attention and other layers keep transformers' own classes (they do not grow, or hold other state).
"""

from typing import Optional, Tuple

import torch
from transformers import DynamicCache, DynamicLayer
from transformers.cache_utils import DynamicSlidingWindowLayer

__all__ = ["GrowingLayer", "GrowingWindowLayer", "growing_cache", "is_window_layer"]

# The first buffer's room beyond the prefill (slots): a short completion never reallocates.
_MIN_ROOM = 64


def _moved(buffers: Tuple[torch.Tensor, torch.Tensor], lo: int, hi: int, capacity: int,
           index: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slots ``[lo, hi)`` of ``buffers`` (keys, values ``[B, H, slots, D]``; of batch entries ``index``, when given)
    copied to the front of new buffers ``[B', H, capacity, D]``."""
    moved = []
    for old in buffers:
        part = old[..., lo:hi, :]
        if index is not None:
            part = part.index_select(0, index.to(part.device))
        new = part.new_empty((*part.shape[:-2], capacity, part.shape[-1]))
        new[..., : hi - lo, :].copy_(part)
        moved.append(new)
    return moved[0], moved[1]


class GrowingLayer(DynamicLayer):
    """A full-attention layer's keys and values ``[B, H, S, D]`` as views of buffers ``[B, H, capacity, D]``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._k = self._v = None
        self._len = 0

    def _views(self) -> None:
        self.keys, self.values = self._k[..., : self._len, :], self._v[..., : self._len, :]

    def _reallocate(self, capacity: int, index: "torch.Tensor | None" = None) -> None:
        """New buffers of ``capacity`` slots holding the filled part (of batch entries ``index``, when given)."""
        self._k, self._v = _moved((self._k, self._v), 0, self._len, capacity, index)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, s, D]`` new keys and values after the filled slots; return all ``[B, H, S + s, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._len + key_states.size(-2)
        if self._k is None:
            self._k = key_states.new_empty((*key_states.shape[:-2], end + _MIN_ROOM, key_states.shape[-1]))
            self._v = value_states.new_empty((*value_states.shape[:-2], end + _MIN_ROOM, value_states.shape[-1]))
        elif end > self._k.size(-2):
            self._reallocate(max(end, 2 * self._k.size(-2)))
        self._k[..., self._len: end, :].copy_(key_states)
        self._v[..., self._len: end, :].copy_(value_states)
        self._len = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep (and repeat) batch entries ``beam_idx``: the filled slots are copied, the room kept."""
        if self.get_seq_length() > 0:
            self._reallocate(self._k.size(-2), beam_idx)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.reorder_cache(torch.arange(self._k.size(0), device=self._k.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``|tokens_to_remove|`` slots (transformers' negative-count convention); the room stays."""
        if tokens_to_remove > 0:  # the legacy absolute-length form
            tokens_to_remove = max(self._len - tokens_to_remove, 0)
        self._len = max(self._len - abs(tokens_to_remove), 0)
        if self._k is not None:
            self._views()

    def reset(self) -> None:
        self._k = self._v = None
        self._len = 0
        super().reset()

    def offload(self) -> None:
        raise NotImplementedError("GrowingLayer is the native engine's decode cache: it is never offloaded")


class GrowingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer's kept keys and values ``[B, H, <= w - 1, D]`` as views of buffers with room (at most
    about ``2 w`` slots, and about twice the row's length while it is shorter than the window).

    ``update`` returns what transformers' layer returns (the kept slots, then the new ones) and keeps the same last
    ``w - 1`` slots; ``cumulative_length`` and so the masks' sizes (``get_mask_sizes``) are transformers' own.

    Args:
        sliding_window (int): the window ``w`` (> 1).
    """

    def __init__(self, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self._lo = self._hi = 0  # the kept slots are [_lo, _hi) of the buffers

    def _keep(self) -> None:
        self.keys, self.values = self._k[..., self._lo: self._hi, :], self._v[..., self._lo: self._hi, :]

    def _reallocate(self, capacity: int, index: "torch.Tensor | None" = None) -> None:
        """New buffers of ``capacity`` slots holding the kept ones first (of batch entries ``index``, when given)."""
        kept = self._hi - self._lo
        self._k, self._v = _moved((self._k, self._v), self._lo, self._hi, capacity, index)
        self._lo, self._hi = 0, kept

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, s, D]`` new keys and values after the kept slots; return the kept and the new ones."""
        if self.record_past:
            raise NotImplementedError("GrowingWindowLayer is the native engine's decode cache: no past recording")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.size(-2)
        self.cumulative_length += s
        if self._k is None:
            self._k = key_states.new_empty((*key_states.shape[:-2], s + _MIN_ROOM, key_states.shape[-1]))
            self._v = value_states.new_empty((*value_states.shape[:-2], s + _MIN_ROOM, value_states.shape[-1]))
        elif self._hi + s > self._k.size(-2):
            # Doubled while the row is shorter than the window (memory follows the tokens, not the window), at most
            # about two windows once it is longer: a move of the kept w - 1 slots every w or so tokens.
            kept = self._hi - self._lo
            self._reallocate(max(kept + s + _MIN_ROOM, min(2 * self._k.size(-2), 2 * self.sliding_window + _MIN_ROOM)))
        end = self._hi + s
        self._k[..., self._hi: end, :].copy_(key_states)
        self._v[..., self._hi: end, :].copy_(value_states)
        full_k, full_v = self._k[..., self._lo: end, :], self._v[..., self._lo: end, :]
        self._lo, self._hi = max(self._lo, end - (self.sliding_window - 1)), end
        self._keep()
        return full_k, full_v

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep (and repeat) batch entries ``beam_idx``: the kept slots are copied, the room kept."""
        if self._k is not None:
            self._reallocate(self._k.size(-2), beam_idx)
            self._keep()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            self.reorder_cache(torch.arange(self._k.size(0), device=self._k.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingWindowLayer is the native engine's decode cache: it is never cropped")

    def reset(self) -> None:
        self._k = self._v = None
        self._lo = self._hi = 0
        super().reset()

    def offload(self) -> None:
        raise NotImplementedError("GrowingWindowLayer is the native engine's decode cache: it is never offloaded")


def is_window_layer(layer) -> bool:
    """transformers' sliding-window attention cache layer: a direct ``DynamicLayer`` subclass marked sliding (not the
    hybrid linear-attention layers that also derive from it)."""
    return type(layer).__mro__[1] is DynamicLayer and bool(getattr(layer, "is_sliding", False))


def growing_cache(config, full_history: bool = False) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config``, its plain full-attention layers :class:`GrowingLayer`, its
    sliding-window layers :class:`GrowingWindowLayer`.

    Args:
        config: the causal LM's config (``model.config``).
        full_history (bool): its sliding-window layers :class:`GrowingLayer` too, keeping every slot (the mask
            applies the window), for a prefill whose keys and values go on to a fixed-shape cache
            (``_hf_static.py``). Default is False.

    Returns:
        DynamicCache: the cache the model's first forward fills.
    """
    cache = DynamicCache(config=config)
    cache.layers = [_growing(layer, full_history) for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # a config without layer types: layers made on first use
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def _growing(layer, full_history: bool):
    """The growing replacement of one of transformers' cache layers, or the layer itself."""
    if type(layer) is DynamicLayer or (full_history and is_window_layer(layer)):
        return GrowingLayer()
    if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window > 1 and not layer.record_past:
        return GrowingWindowLayer(sliding_window=layer.sliding_window)
    return layer
