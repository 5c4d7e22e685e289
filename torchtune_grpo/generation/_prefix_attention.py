"""Decode-time attention with a prompt shared by its group: stored once, read once per group.

Every row of a GRPO group continues the same prompt. The per-row layout keeps (and, at every decoded token,
reads) the prompt's keys and values ``G`` times. Here the cache has two parts: the prompt's keys and values
once per prompt, ``[B, h_kv, P, d]``, and each row's completion, ``[B x G, h_kv, T, d]``. A decode step's
attention scores the ``G`` rows' queries of a group together against their prompt (one matmul reads the
prompt's keys once), scores each row against its own completion, and takes one softmax over both. On CPU,
where the tiny model's decode attention was bound by reading the cache (0.4 ms per layer and token for
``32 x 140`` slots, cold), this reads ``P + G T`` slots per group instead of ``G (P + T)``; the KV memory
shrinks by the same factor.

The scores are computed with plain matmuls in the cache's dtype, so this layout is used for float32 caches
only: SDPA keeps half-precision scores in fp32 internally, a bf16 matmul would round them. Half-precision
rollouts use the per-row layout (``torchtune_grpo/generation/_cache.py``).
"""

from typing import NamedTuple, Optional

import torch
from torch import nn

from torchtune_grpo.models.attention import EngineKVCache
from torchtune_grpo.generation._cache import CacheState, write_slots

__all__ = ["PrefixDecodeMask", "SharedPrefixKVCache", "lean_decode_eligible", "lean_decode_layer"]


class PrefixDecodeMask(NamedTuple):
    """The decode step's attention mask for :class:`SharedPrefixKVCache`, in place of a tensor mask.

    torchtune's layers hand ``mask`` to their attention unchanged, so the two parts travel together.

    Attributes:
        prefix (torch.Tensor): ``[B, 1, 1, Pw]`` additive (0 where a prompt slot is a real token, ``-inf``
            for left padding and unused slots), the cache's dtype.
        completion (Optional[torch.Tensor]): ``[1 or N, 1, s, Wc]`` additive mask of the completion window
            (slots not written yet; per row and query in a multi-turn session), or None when the window is
            exactly the written slots.
    """

    prefix: torch.Tensor
    completion: Optional[torch.Tensor]


class SharedPrefixKVCache(EngineKVCache):
    """A layer's decode cache: each prompt's keys/values once, then each row's completion.

    Rows ``i G .. i G + G - 1`` continue prompt ``i``. New keys/values go to the completion part at
    ``state.slots``; attention reads the prompt part's first ``prefix_window`` slots and the completion
    part's first ``state.window`` slots.

    Args:
        prefix_k (torch.Tensor): ``[B, h_kv, S_p, d]`` the prompts' keys (written by the prefill).
        prefix_v (torch.Tensor): ``[B, h_kv, S_p, d]`` the prompts' values.
        k_cache (torch.Tensor): ``[B x G, h_kv, S_c, d]`` completion keys.
        v_cache (torch.Tensor): ``[B x G, h_kv, S_c, d]`` completion values.
        state (CacheState): shared write slot and completion window.
        prefix_window (int): prompt slots attention reads (``Pw``).
    """

    def __init__(
        self,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: CacheState,
        prefix_window: int,
    ) -> None:
        super().__init__()
        # Plain attributes, not buffers: never part of the model's state, never moved by ``.to()``.
        self.prefix_k, self.prefix_v = prefix_k, prefix_v
        self.k_cache, self.v_cache = k_cache, v_cache
        self.state = state
        self.prefix_window = prefix_window
        self.batch_size = k_cache.size(0)

    attends = True  # attention_forward hands it the queries: it reads the prompt part once per group

    def attend(
        self, q: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor, mask: PrefixDecodeMask
    ) -> torch.Tensor:
        """Write ``s`` tokens' keys/values, then attend over the prompt and the completion so far.

        The same result as ``scaled_dot_product_attention(q, K, V, mask, enable_gqa=True)`` over each row's
        full ``[prompt | completion]`` keys (up to floating-point summation order). ``s`` is 1 in a decode
        step; a multi-turn session also appends several tokens per row (an environment's reply) in one
        forward, each query masked by its own row of ``mask.completion``.

        Args:
            q (torch.Tensor): ``[N, h, s, d]`` queries of the new tokens.
            k_val (torch.Tensor): ``[N, h_kv, s, d]`` their keys.
            v_val (torch.Tensor): ``[N, h_kv, s, d]`` their values.
            mask (PrefixDecodeMask): the prompt and completion masks.

        Returns:
            torch.Tensor: ``[N, h, s, d]`` attention output.
        """
        write_slots(self.k_cache, self.state.slots, k_val)
        write_slots(self.v_cache, self.state.slots, v_val)
        w, pw = self.state.window, self.prefix_window
        kc, vc = self.k_cache[:, :, :w], self.v_cache[:, :, :w]  # [N, h_kv, Wc, d]
        kp, vp = self.prefix_k[:, :, :pw], self.prefix_v[:, :, :pw]  # [B, h_kv, Pw, d]
        n, h, s, d = q.shape
        b, h_kv = kp.shape[:2]
        g, r = n // b, h // h_kv  # rows per prompt, query heads per key/value head
        rs = r * s  # query rows per kv head: head j reads kv head j // r
        q = q.reshape(n, h_kv, rs, d) * d**-0.5  # SDPA's default scale
        # A group's G r s queries per kv head against its prompt: the prompt's keys are read once per group.
        qp = q.view(b, g, h_kv, rs, d).transpose(1, 2).reshape(b, h_kv, g * rs, d)
        sp = torch.matmul(qp, kp.transpose(-1, -2)) + mask.prefix  # [B, h_kv, G r s, Pw]
        sp = sp.view(b, h_kv, g, rs, pw).transpose(1, 2).reshape(n, h_kv, rs, pw)
        sc = torch.matmul(q, kc.transpose(-1, -2))  # [N, h_kv, r s, Wc]
        if mask.completion is not None:  # [1 or N, 1, s, Wc]: broadcast over the r heads of a kv head
            sc = (sc.view(n, h_kv, r, s, w) + mask.completion.unsqueeze(1)).view(n, h_kv, rs, w)
        probs = torch.softmax(torch.cat([sp, sc], dim=-1), dim=-1)  # one softmax over prompt + completion
        pp, pc = probs.split([pw, w], dim=-1)
        pp = pp.reshape(b, g, h_kv, rs, pw).transpose(1, 2).reshape(b, h_kv, g * rs, pw)
        out = torch.matmul(pp, vp).view(b, h_kv, g, rs, d).transpose(1, 2).reshape(n, h_kv, rs, d)
        out = out + torch.matmul(pc, vc)
        # reshape, not view: with one prompt (B = 1) the prompt part above stays a strided view and the sum
        # keeps its layout, in which h_kv and r cannot be merged without a copy.
        return out.reshape(n, h, s, d)


def lean_decode_eligible(layers: nn.ModuleList) -> bool:
    """Whether :func:`lean_decode_layer` may replace these layers' forwards during decoding.

    True when every layer is a plain torchtune ``TransformerSelfAttentionLayer`` and nothing inside a layer
    carries a forward hook (the lean path calls submodules' ``forward`` directly), and no global module
    hook is registered. The layers' own hooks (FSDP2's) are the caller's business
    (``can_skip_module_hooks``).
    """
    from torch.nn.modules import module as module_impl
    from torchtune.modules import TransformerSelfAttentionLayer

    if module_impl._global_forward_hooks or module_impl._global_forward_pre_hooks:
        return False
    for layer in layers:
        if type(layer) is not TransformerSelfAttentionLayer:
            return False
        for m in layer.modules():
            if m is not layer and (m._forward_hooks or m._forward_pre_hooks):
                return False
    return True


def lean_decode_layer(
    layer: nn.Module, x: torch.Tensor, mask: PrefixDecodeMask, input_pos: torch.Tensor
) -> torch.Tensor:
    """``TransformerSelfAttentionLayer.forward`` for one decoded token with a :class:`SharedPrefixKVCache`.

    The same operations in the same order as torchtune's layer and attention forwards (the same numbers;
    greedy equality is tested), with less around them: submodules' ``forward`` called directly (no
    ``nn.Module.__call__``), and one positional-embedding call on queries and keys together (RoPE acts on
    each head alone, so ``rope(cat(q, k))`` is ``cat(rope(q), rope(k))``). For a tiny model on CPU, where
    a decode step is a few hundred small operations, this is ~8% of the rollout.

    Args:
        layer (nn.Module): a torchtune ``TransformerSelfAttentionLayer`` whose attention holds a
            :class:`SharedPrefixKVCache` (see :func:`lean_decode_eligible`).
        x (torch.Tensor): ``[N, 1, d_model]`` the layer's input.
        mask (PrefixDecodeMask): the step's masks.
        input_pos (torch.Tensor): ``[N, 1]`` position ids.

    Returns:
        torch.Tensor: ``[N, 1, d_model]``.
    """
    attn = layer.attn
    h = layer.sa_norm.forward(x)
    n, s, _ = h.shape
    heads, head_dim = attn.num_heads, attn.head_dim
    q = attn.q_proj.forward(h).view(n, s, heads, head_dim)
    k = attn.k_proj.forward(h).view(n, s, -1, head_dim)
    v = attn.v_proj.forward(h).view(n, s, -1, head_dim)
    if attn.pos_embeddings is not None:
        qk = attn.pos_embeddings.forward(torch.cat([q, k], dim=2), input_pos=input_pos)
        q, k = qk[:, :, :heads], qk[:, :, heads:]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [N, heads, 1, d]
    if attn.q_norm is not None:
        q = attn.q_norm.forward(q)
    if attn.k_norm is not None:
        k = attn.k_norm.forward(k)
    out = attn.kv_cache.attend(q, k, v, mask)  # [N, heads, 1, d]
    out = attn.output_proj.forward(out.transpose(1, 2).reshape(n, s, -1))
    h = layer.sa_scale.forward(out) + x
    return h + layer.mlp_scale.forward(layer.mlp.forward(layer.mlp_norm.forward(h)))
