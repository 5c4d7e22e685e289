"""The projection half of torchtune's attention, shared by the engine's cached forward and the shared-prompt
training forward (both replace only the attention call itself)."""

from typing import Optional, Tuple

import torch
from torchtune.modules import MultiHeadAttention


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
