"""A static KV cache for the native engine: allocated once per shape, reused across rollouts.

torchtune's own :class:`~torchtune.modules.KVCache` advances an internal position and asserts on it in every
``update`` (a device-to-host sync per layer per token on GPU). The engine instead decides where each
forward writes: one shared :class:`CacheState` holds the slot indices of the current forward (``[P]`` for a
prefill, ``[1]`` for a decode step) and the attention window, and every layer's :class:`SlotKVCache` writes
there with ``index_copy_`` and returns the first ``window`` slots. Nothing in ``update`` reads a value back
to the host, and with a fixed window every decode step has the same shapes (a CUDA graph can replay it).

The caches are attached to the model's attention modules only while the engine runs and detached after,
restoring whatever was there. That matters for training: torchtune's attention takes its fused causal
path (``is_causal``) only when ``attn.kv_cache is None``, so a cache that was merely *disabled*
(``torchtune.modules.common_utils.disable_kv_cache``) would leave a mask-less training forward attending
to every position.
"""

import types
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention

from torchtune_grpo._attention import project_qkv

__all__ = [
    "CacheState",
    "KVCachePool",
    "SlotKVCache",
    "attention_modules",
    "attached_caches",
    "cached_attention_forward",
    "takes_cached_forward",
]


class CacheState:
    """What the next forward writes and reads, shared by every layer's cache.

    Attributes:
        slots (torch.Tensor): long ``[s]``: cache slots the ``s`` new tokens of the next forward go to.
        window (int): attention reads slots ``[0, window)``.
    """

    def __init__(self, slots: torch.Tensor, window: int) -> None:
        self.slots = slots
        self.window = window


class SlotKVCache(nn.Module):
    """Drop-in for torchtune's ``KVCache`` inside ``MultiHeadAttention``: writes at ``state.slots``.

    Args:
        k_cache (torch.Tensor): ``[b, h_kv, S, d]`` key storage (possibly a view of a larger cache).
        v_cache (torch.Tensor): ``[b, h_kv, S, d]`` value storage.
        state (CacheState): shared write slots and window.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, state: CacheState) -> None:
        super().__init__()
        # Plain attributes, not buffers: never part of the model's state, never moved by ``.to()``.
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.state = state
        self.batch_size = k_cache.size(0)

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``k_val``/``v_val`` (``[b, h_kv, s, d]``) at the current slots; return the window."""
        slots = self.state.slots
        self.k_cache.index_copy_(2, slots, k_val)
        self.v_cache.index_copy_(2, slots, v_val)
        window = self.state.window
        return self.k_cache[:, :, :window], self.v_cache[:, :, :window]

    def reset(self) -> None:
        """Zero the storage (the engine never needs it: every attended slot is written first)."""
        self.k_cache.zero_()
        self.v_cache.zero_()


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The self-attention modules of a torchtune decoder, in layer order (those with a ``kv_cache``)."""
    return [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "cache_enabled")]


def cached_attention_forward(
    self: MultiHeadAttention,
    x: torch.Tensor,
    y: Optional[torch.Tensor] = None,
    *,
    mask: Optional[torch.Tensor] = None,
    input_pos: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """torchtune's ``MultiHeadAttention.forward`` for cached self-attention, without the GQA copy.

    The same computation, step for step, as torchtune 0.6.1's forward with a KV cache and a boolean mask,
    except that grouped-query attention is left to ``scaled_dot_product_attention(enable_gqa=True)``
    instead of materialising every key/value head ``num_heads / num_kv_heads`` times (a copy of the whole
    cache window per layer per decoded token). SDPA computes the same numbers (the tests check exact
    greedy equality with torchtune's own generation). The mask may be boolean or additive (float, the
    query's dtype), or a ``PrefixDecodeMask`` for a cache with an ``attend`` method. Anything else falls
    back to torchtune's forward.
    """
    if y is None or mask is None or self.kv_cache is None:
        return MultiHeadAttention.forward(self, x, y, mask=mask, input_pos=input_pos)
    b, s_x, _ = x.shape
    q, k, v = project_qkv(self, x, y, input_pos)  # [b, h, s_x, d], [b, h_kv, s_y, d] x2
    attend = getattr(self.kv_cache, "attend", None)
    if attend is not None:  # a cache that attends itself (the shared-prefix layout of _prefix_attention.py)
        out = attend(q, k, v, mask)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))
    k, v = self.kv_cache.update(k, v)  # [b, h_kv, W, d]
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask[:, None, :, :],
        dropout_p=self.attn_dropout if self.training else 0.0,
        enable_gqa=self.num_heads != self.num_kv_heads,
    )
    out = out.transpose(1, 2).contiguous().view(b, s_x, -1)
    return self.output_proj(out)


def takes_cached_forward(attn: nn.Module) -> bool:
    """Whether :func:`attached_caches` gives ``attn`` :func:`cached_attention_forward`.

    Plain torchtune ``MultiHeadAttention`` modules do; so do instances whose own forward marks itself as
    torchtune's for every input it may get here (``falls_back_to_mha``). Subclasses with their own forward
    keep it.
    """
    own = attn.__dict__.get("forward")
    replaceable = own is None or getattr(getattr(own, "__func__", None), "falls_back_to_mha", False)
    return type(attn).forward is MultiHeadAttention.forward and replaceable


@contextmanager
def attached_caches(attns: List[nn.Module], caches: List[nn.Module]) -> Iterator[None]:
    """Attach ``caches[i]`` to ``attns[i]`` (enabled) for the duration; restore the previous state after.

    Modules for which :func:`takes_cached_forward` holds also run :func:`cached_attention_forward`
    meanwhile (an instance attribute, restored on exit; e.g. over the shared-prompt training forward of
    ``torchtune_grpo/packing.py``, which marks itself ``falls_back_to_mha``).
    """
    saved = [(a.kv_cache, a.cache_enabled) for a in attns]
    patched = []
    try:
        for a, c in zip(attns, caches):
            a.kv_cache = c
            a.cache_enabled = True
            own = a.__dict__.get("forward")
            if takes_cached_forward(a):
                a.forward = types.MethodType(cached_attention_forward, a)
                patched.append((a, own))
        yield
    finally:
        for a, own in patched:
            if own is None:
                del a.forward
            else:
                a.forward = own
        for a, (c, enabled) in zip(attns, saved):
            a.kv_cache = c
            a.cache_enabled = enabled


class KVCachePool:
    """Key/value storage for every layer, allocated once and reused while the shapes allow.

    A request names one or more *parts*, each ``(rows, length)``: the engine's shared-prefix layout asks for
    ``[(B, P), (B x G, T)]`` (each prompt once, each row's completion), the per-row layout for
    ``[(B x G, P + T)]``. Part ``j`` of layer ``i`` is ``k[j][i], v[j][i]: [rows_j, h_kv, capacity_j,
    head_dim]``. A request with the same parts' rows, dtype and device whose lengths fit reuses the storage;
    a longer one reallocates with the lengths rounded up to a multiple of ``len_multiple`` (so slowly growing
    prompts do not reallocate every step); anything else replaces it (one set is kept at a time).

    Args:
        len_multiple (int): allocation granularity in slots. Default is 64.
    """

    def __init__(self, len_multiple: int = 64) -> None:
        self.len_multiple = max(1, len_multiple)
        self.k: List[List[torch.Tensor]] = []
        self.v: List[List[torch.Tensor]] = []
        self.key: Optional[tuple] = None
        self.capacities: List[int] = []
        self.allocations = 0  # how many times storage was (re)allocated: for tests and benchmarks

    def get(
        self,
        layout: List[Tuple[int, int]],
        parts: List[Tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> List[Tuple[List[torch.Tensor], List[torch.Tensor]]]:
        """Storage for ``layout`` (``(h_kv, head_dim)`` per layer) and ``parts`` (``(rows, length)`` each).

        Returns:
            List[Tuple[List[torch.Tensor], List[torch.Tensor]]]: per part, the per-layer keys and values.
        """
        key = (tuple(layout), tuple(rows for rows, _ in parts), dtype, torch.device(device))
        fits = key == self.key and all(n <= cap for (_, n), cap in zip(parts, self.capacities))
        if not fits:
            self.release()
            self.capacities = [-(-n // self.len_multiple) * self.len_multiple for _, n in parts]
            for (rows, _), cap in zip(parts, self.capacities):
                self.k.append([torch.zeros(rows, h, cap, d, dtype=dtype, device=device) for h, d in layout])
                self.v.append([torch.zeros(rows, h, cap, d, dtype=dtype, device=device) for h, d in layout])
            self.key = key
            self.allocations += 1
        return list(zip(self.k, self.v))

    def release(self) -> None:
        """Free the storage."""
        self.k, self.v, self.key, self.capacities = [], [], None, []
