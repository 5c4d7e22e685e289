"""torchtune's attention, with the project's two other ways of attending: one forward, one owner.

torchtune's ``MultiHeadAttention.forward`` attends with a tensor mask (or causally) and a torchtune
``KVCache``. This project attends in two more ways:

- training in the shared-prompt layout (:mod:`torchtune_grpo.training.batch`): the ``mask`` is an
  :class:`AttentionLayout`, an object that computes attention from the queries, keys and values itself;
- generation with the native engine's static caches (:mod:`torchtune_grpo.generation`): the module's
  ``kv_cache`` is an :class:`EngineKVCache`, which writes at slots the engine chooses (and may attend itself).

:func:`install_attention` gives an attention module :func:`attention_forward`, which runs those two and
otherwise torchtune's forward unchanged. This module is the only code that replaces an attention module's
forward: the training layout installs it for good (:func:`install_attention`, idempotent), the engine for
the length of a rollout (:func:`attention_installed`).
"""

import types
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention

__all__ = [
    "AttentionLayout",
    "EngineKVCache",
    "attention_forward",
    "attention_installed",
    "install_attention",
    "installable",
    "project_qkv",
]


class AttentionLayout:
    """A ``mask`` that computes attention itself (a plain object: module hooks pass it through).

    Subclasses implement :meth:`attention`.
    """

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """``q [b, h, s, d]``, ``k, v [b, h_kv, s, d]`` -> ``[b, h, s, d]``."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Build what every layer's :meth:`attention` shares, before the layers run: a compiled layer then reads it
        built, instead of building it at the first layer and being compiled again for the next (whose guard sees
        it built). Default: nothing to build."""


class EngineKVCache(nn.Module):
    """A generation engine's KV cache, attached to an attention module while the engine runs.

    A cache either writes a forward's keys/values and returns what attention reads (:meth:`update`, the
    interface of torchtune's ``KVCache``), or, with ``attends = True``, computes the attention itself
    (``attend(q, k_val, v_val, mask)``).
    """

    #: Whether the cache computes attention itself (``attend``) instead of returning keys and values.
    attends = False

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``k_val``/``v_val`` (``[b, h_kv, s, d]``) and return the keys/values attention reads."""
        raise NotImplementedError


def project_qkv(
    attn: MultiHeadAttention, x: torch.Tensor, y: torch.Tensor, input_pos: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values exactly as torchtune 0.6.1's ``MultiHeadAttention.forward`` computes them.

    Projections, positional embeddings, then q/k norms, step for step; no KV-cache update and no
    grouped-query expansion (callers leave that to ``scaled_dot_product_attention(enable_gqa=True)``).

    Args:
        attn (MultiHeadAttention): the attention module.
        x (torch.Tensor): ``[b, s_x, d_model]`` query input.
        y (torch.Tensor): ``[b, s_y, d_model]`` key/value input (``x`` for self-attention).
        input_pos (Optional[torch.Tensor]): ``[b, s]`` position ids for the positional embeddings.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``q [b, h, s_x, d]``, ``k`` and ``v
        [b, h_kv, s_y, d]``.
    """
    b, s_x, _ = x.shape
    s_y = y.shape[1]
    q = attn.q_proj(x).view(b, s_x, attn.num_heads, attn.head_dim)
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=input_pos)
    q = q.transpose(1, 2)  # [b, h, s, d]
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    k = attn.k_proj(y).view(b, s_y, -1, attn.head_dim)
    v = attn.v_proj(y).view(b, s_y, -1, attn.head_dim)
    if attn.pos_embeddings is not None:
        k = attn.pos_embeddings(k, input_pos=input_pos)
    k = k.transpose(1, 2)  # [b, h_kv, s, d]
    v = v.transpose(1, 2)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return q, k, v


def attention_forward(
    self: MultiHeadAttention,
    x: torch.Tensor,
    y: Optional[torch.Tensor] = None,
    *,
    mask=None,
    input_pos: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """torchtune's ``MultiHeadAttention.forward``, plus an :class:`AttentionLayout` mask and engine caches.

    - ``mask`` an :class:`AttentionLayout` (a training forward): projections as torchtune's, then the
      layout's attention.
    - ``kv_cache`` an :class:`EngineKVCache` and a mask (a rollout's prefill or decode step): torchtune's
      cached self-attention step for step, except that grouped-query attention is left to
      ``scaled_dot_product_attention(enable_gqa=True)`` instead of copying every key/value head
      ``num_heads / num_kv_heads`` times (the same numbers; exact greedy equality with torchtune's
      generation is tested). The mask may be boolean or additive, or whatever a cache that ``attends``
      takes.
    - anything else: torchtune's forward, unchanged.
    """
    if isinstance(mask, AttentionLayout):
        if y is None or (self.kv_cache is not None and self.cache_enabled):
            raise ValueError(
                "A shared-prompt forward is a training forward: self-attention without a KV cache"
            )
        b, s_x, _ = x.shape
        q, k, v = project_qkv(self, x, y, input_pos)  # [b, h, s_x, d], [b, h_kv, s_y, d] x2
        out = mask.attention(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))
    cache = self.kv_cache
    if not isinstance(cache, EngineKVCache) or y is None or mask is None:
        return MultiHeadAttention.forward(self, x, y, mask=mask, input_pos=input_pos)
    b, s_x, _ = x.shape
    q, k, v = project_qkv(self, x, y, input_pos)  # [b, h, s_x, d], [b, h_kv, s_y, d] x2
    if cache.attends:  # e.g. the shared-prefix layout of generation/_prefix_attention.py
        out = cache.attend(q, k, v, mask)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))
    k, v = cache.update(k, v)  # [b, h_kv, W, d]
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


def installable(attn: nn.Module) -> bool:
    """Whether ``attn`` runs, or may be given, :func:`attention_forward`.

    True for torchtune ``MultiHeadAttention`` modules (LoRA projections included) whose forward is
    torchtune's or already this one; subclasses with their own forward and instances given someone
    else's forward keep theirs.
    """
    if type(attn).forward is not MultiHeadAttention.forward:
        return False
    own = attn.__dict__.get("forward")
    return own is None or getattr(own, "__func__", None) is attention_forward


def install_attention(attn: nn.Module) -> bool:
    """Give ``attn`` :func:`attention_forward` (an instance attribute; idempotent).

    Returns:
        bool: whether ``attn`` now runs it (False, and nothing changed, when not :func:`installable`).
    """
    if not installable(attn):
        return False
    if "forward" not in attn.__dict__:
        attn.forward = types.MethodType(attention_forward, attn)
    return True


@contextmanager
def attention_installed(attns: List[nn.Module]) -> Iterator[List[bool]]:
    """:func:`install_attention` on each of ``attns`` for the duration; modules that ran torchtune's own
    forward before get it back after. Yields whether each module runs :func:`attention_forward`."""
    fresh = [a for a in attns if installable(a) and "forward" not in a.__dict__]
    try:
        yield [install_attention(a) for a in attns]
    finally:
        for a in fresh:
            del a.forward
