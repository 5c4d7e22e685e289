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

from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from torchtune_grpo.models.attention import attention_installed, EngineKVCache

__all__ = [
    "CacheState",
    "KVCachePool",
    "SlotKVCache",
    "attention_modules",
    "attached_caches",
    "write_slots",
]


class CacheState:
    """What the next forward writes and reads, shared by every layer's cache.

    Attributes:
        slots (torch.Tensor): long ``[s]``: cache slots the ``s`` new tokens of the next forward go to, the
            same for every row; or ``[b, s]``: each row's own slots (a multi-turn session, whose rows hold
            histories of different lengths: :mod:`~torchtune_grpo.generation._session`).
        window (int): attention reads slots ``[0, window)``.
    """

    def __init__(self, slots: torch.Tensor, window: int) -> None:
        self.slots = slots
        self.window = window


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (``[b, h_kv, s, d]``) into ``cache`` (``[b, h_kv, S, d]``) at ``slots``.

    Args:
        cache (torch.Tensor): the storage, written in place.
        slots (torch.Tensor): long ``[s]`` (every row's tokens go to the same slots) or ``[b, s]`` (per row).
        values (torch.Tensor): the keys or values of the ``s`` new tokens.
    """
    if slots.dim() == 1:
        cache.index_copy_(2, slots, values)
        return
    b, h, s, d = values.shape
    cache.scatter_(2, slots.view(b, 1, s, 1).expand(b, h, s, d), values)


class SlotKVCache(EngineKVCache):
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
        write_slots(self.k_cache, self.state.slots, k_val)
        write_slots(self.v_cache, self.state.slots, v_val)
        window = self.state.window
        return self.k_cache[:, :, :window], self.v_cache[:, :, :window]

    def reset(self) -> None:
        """Zero the storage (the engine never needs it: every attended slot is written first)."""
        self.k_cache.zero_()
        self.v_cache.zero_()


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The self-attention modules of a torchtune decoder, in layer order (those with a ``kv_cache``)."""
    return [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "cache_enabled")]


@contextmanager
def attached_caches(attns: List[nn.Module], caches: List[nn.Module]) -> Iterator[None]:
    """Attach ``caches[i]`` to ``attns[i]`` (enabled) for the duration; restore the previous state after.

    Modules that :func:`~torchtune_grpo.models.attention.installable` accepts run
    :func:`~torchtune_grpo.models.attention.attention_forward` meanwhile (the engine's cached attention); others
    keep their own forward, which reaches the cache through torchtune's ``kv_cache.update``.
    """
    saved = [(a.kv_cache, a.cache_enabled) for a in attns]
    try:
        with attention_installed(attns):
            for a, c in zip(attns, caches):
                a.kv_cache = c
                a.cache_enabled = True
            yield
    finally:
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
