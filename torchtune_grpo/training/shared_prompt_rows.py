"""Shared-prompt rows: the ``G`` completions of a group in one training row after their prompt, computed once.

With causal attention a prompt's hidden states, keys and values are the same in all ``G`` rows of its group.
The one-row-per-sequence layout (``prompt + completion``) computes them ``G`` times;
:func:`shared_prompt_layout` packs the sequences of one prompt (within a micro-batch) into one row instead::

    [ prompt (P slots) | completion 1 (C slots) | completion 2 (C slots) | ... | completion M (C slots) ]

A response's last token predicts nothing, so a completion region holds all its tokens but the last (``C`` is
the longest response minus one). The linear layers (most of the FLOPs) then see ``P + M x C`` tokens
instead of ``M x (P + C + 1)``, and attention is split so that it never costs more than in the unshared
layout (:meth:`SharedPromptMask.attention`): the prompt attends causally to itself once, and each completion
attends to the prompt's keys and causally to its own tokens (``M`` blocks of ``C x (P + C)``; no completion ever
sees another). Position ids continue from the prompt in each completion. Every logprob is the same function of
the same inputs as in the unshared layout; only the order of some floating-point sums differs.

On transformers' own modules the same rows run with explicit attention masks built from
:meth:`SharedPromptMask.pairs` (:mod:`torchtune_grpo.models._transformers_layouts`). The packed rows beside
it: :mod:`~torchtune_grpo.training.packed_rows`; which layout a model gets:
:mod:`~torchtune_grpo.training.layout_choice`.
"""

from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from torchtune_grpo.models._transformers_layouts import SlotPairs
from torchtune_grpo.models.attention import AttentionLayout

__all__ = ["SharedPromptLayout", "SharedPromptMask", "shared_prompt_layout", "shared_row_length"]


class SharedPromptMask(AttentionLayout):
    """The attention layout of a shared-prompt forward, passed to the decoder as its ``mask``.

    A plain object (not a tensor), so that module hooks (FSDP2, activation checkpointing) pass it through.

    Args:
        prompt_slots (int): ``P``, the prompt region of every row (prompts right-padded to it).
        completion_slots (int): ``C``, the region of each completion (right-padded to it).
        num_completions (int): ``M``, completion regions per row.
        prompt_lengths (torch.Tensor): ``[R]`` long, the real prompt length of each row.
        completions (Optional[torch.Tensor]): ``[R]`` long, how many of the row's ``M`` regions hold a completion
            (the others are empty: a row's group can have fewer sequences in this micro-batch); None: all ``M``.
    """

    def __init__(
        self, prompt_slots: int, completion_slots: int, num_completions: int, prompt_lengths: torch.Tensor,
        completions: Optional[torch.Tensor] = None,
    ) -> None:
        self.prompt_slots = prompt_slots
        self.completion_slots = completion_slots
        self.num_completions = num_completions
        self.prompt_lengths = prompt_lengths
        self.completions = completions
        p, c, m = prompt_slots, completion_slots, num_completions
        device = prompt_lengths.device
        # [R*M, 1, C, P+C]: a completion token sees its row's real prompt tokens and its own earlier tokens.
        sees_prompt = torch.arange(p, device=device)[None, :] < prompt_lengths[:, None]  # [R, P]
        sees_prompt = sees_prompt.repeat_interleave(m, dim=0)[:, None, None, :].expand(-1, 1, c, p)
        causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
        causal = causal[None, None].expand(sees_prompt.size(0), 1, c, c)
        self.completion_mask = torch.cat([sees_prompt, causal], dim=-1)

    def pairs(self, input_pos: torch.Tensor) -> SlotPairs:
        """The allowed pairs (:class:`~torchtune_grpo.models._transformers_layouts.SlotPairs`) of these rows.

        The prompt's real tokens are segment 0 and shared (every completion of the row sees them), its padding
        is padding (-1); completion region ``j`` is segment ``j + 1``, or padding when it is empty (no result
        is read from it: a linear-attention layer then computes no row for it). With ``input_pos [R, S]`` (each completion
        continuing its prompt's positions) causality and windows are by position, as in the unshared rows. The
        attention :meth:`attention` computes is these pairs (split into blocks so that no completion is
        computed against another); the transformers backend builds its masks from them.
        """
        p, c, m = self.prompt_slots, self.completion_slots, self.num_completions
        r, device = self.prompt_lengths.size(0), self.prompt_lengths.device
        prompt_real = torch.arange(p, device=device)[None, :] < self.prompt_lengths[:, None]  # [R, P]
        region = torch.arange(1, m + 1, device=device).repeat_interleave(c)[None].expand(r, m * c)  # [R, M*C]
        if self.completions is not None:
            region = torch.where(region <= self.completions[:, None], region, -1)
        segment = torch.cat([torch.where(prompt_real, 0, -1), region], dim=1)  # [R, P + M*C]
        shared = torch.cat([prompt_real, torch.zeros(r, m * c, dtype=torch.bool, device=device)], dim=1)
        return SlotPairs(segment, shared, input_pos)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """Shared-prompt attention: ``q [R, h, S, d]``, ``k, v [R, h_kv, S, d]`` -> ``[R, h, S, d]``."""
        p, c, m = self.prompt_slots, self.completion_slots, self.num_completions
        r, h_kv, d = k.size(0), k.size(1), k.size(3)
        gqa = q.size(1) != h_kv
        # The prompt once per row: right-padded, so plain causal attention is exact for its real tokens.
        out_p = F.scaled_dot_product_attention(
            q[:, :, :p], k[:, :, :p], v[:, :, :p], dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
        )

        def per_completion(t: torch.Tensor) -> torch.Tensor:  # [R, heads, M*C, d] -> [R*M, heads, C, d]
            return t[:, :, p:].unflatten(2, (m, c)).transpose(1, 2).flatten(0, 1)

        def with_prompt(t: torch.Tensor) -> torch.Tensor:  # keys/values: the row's prompt, then its own
            prompt = t[:, :, :p].unsqueeze(1).expand(r, m, h_kv, p, d).flatten(0, 1)
            return torch.cat([prompt, per_completion(t)], dim=2)  # [R*M, h_kv, P+C, d]

        out_c = F.scaled_dot_product_attention(
            per_completion(q), with_prompt(k), with_prompt(v), attn_mask=self.completion_mask,
            dropout_p=dropout_p, enable_gqa=gqa,
        )  # [R*M, h, C, d]
        out_c = out_c.unflatten(0, (r, m)).transpose(1, 2).flatten(2, 3)  # [R, h, M*C, d]
        return torch.cat([out_p, out_c], dim=2)


def shared_row_length(max_prompt_length: int, max_response_length: int, sequences_per_row: int) -> int:
    """The longest shared-prompt row: ``P + M x C`` slots (``C = max_response_length - 1``, at least 1).

    A micro-batch whose row would be longer than the model's ``max_seq_len`` is computed one row per
    sequence (:meth:`TrainingBatch.logprobs`). ``sequences_per_row`` is ``min(group_size, micro_batch_size)``.
    """
    return max_prompt_length + sequences_per_row * max(1, max_response_length - 1)


class SharedPromptLayout(NamedTuple):
    """One micro-batch in the shared-prompt layout (see the module docstring). ``R`` rows, ``S`` slots.

    Attributes:
        tokens (torch.Tensor): ``[R, S]`` long, padded with the pad id.
        input_pos (torch.Tensor): ``[R, S]`` long position ids (each completion continues its prompt).
        mask (SharedPromptMask): the attention layout.
        src (torch.Tensor): ``[K]`` long: flat ``R x S`` index of the hidden state predicting each response
            token (the prompt's last real token for a completion's first token).
        targets (torch.Tensor): ``[K]`` long: the response tokens.
        dst (torch.Tensor): ``[K]`` long: flat index into the micro-batch's ``[n, T]`` result.
        source (torch.Tensor): ``[R, S, 2]`` long: the ``(sequence, position)`` of the unshared row each slot holds
            (a shared prompt: the row's first sequence), ``(-1, -1)`` on padding.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: SharedPromptMask
    src: torch.Tensor
    targets: torch.Tensor
    dst: torch.Tensor
    source: torch.Tensor


def shared_prompt_layout(
    prompt_ids: List[List[int]],
    response_ids: List[List[int]],
    pad_id: int,
    start: int,
    width: int,
    device: Optional[torch.device] = None,
) -> SharedPromptLayout:
    """Pack consecutive sequences with the same prompt into one row each.

    Args:
        prompt_ids (List[List[int]]): ``n`` prompts (each non-empty); equal consecutive prompts share a row.
        response_ids (List[List[int]]): ``n`` responses.
        pad_id (int): padding id.
        start (int): the result's first column predicts token ``start + 1`` of each ``prompt + response``.
        width (int): ``T``, columns of the result.
        device (Optional[torch.device]): where the tensors go. Default is None (CPU).

    Returns:
        SharedPromptLayout: the packed rows and the gather/scatter indices of every response token.
    """
    runs: List[List[int]] = []  # sequence indices per row
    for i, p in enumerate(prompt_ids):
        if not p:
            raise ValueError("shared-prompt packing needs non-empty prompts")
        if runs and prompt_ids[runs[-1][0]] == p:
            runs[-1].append(i)
        else:
            runs.append([i])
    p_slots = max(len(p) for p in prompt_ids)
    # A response's last token predicts nothing: a completion region holds all its tokens but the last.
    c_slots = max(1, max(len(r) for r in response_ids) - 1)
    m = max(len(run) for run in runs)
    s = p_slots + m * c_slots
    # Pads need some position id; keep them inside the range the unshared rows use.
    max_pos = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids)) - 1
    tokens = torch.full((len(runs), s), pad_id, dtype=torch.long)
    input_pos = torch.zeros((len(runs), s), dtype=torch.long)
    prompt_lengths = torch.zeros(len(runs), dtype=torch.long)
    source = torch.full((len(runs), s, 2), -1, dtype=torch.long)
    src, targets, dst = [], [], []
    c_range = torch.arange(c_slots)
    for row, run in enumerate(runs):
        prompt = prompt_ids[run[0]]
        p_len = len(prompt)
        prompt_lengths[row] = p_len
        tokens[row, :p_len] = torch.tensor(prompt, dtype=torch.long)
        source[row, :p_len, 0] = run[0]
        source[row, :p_len, 1] = torch.arange(p_len)
        input_pos[row, :p_slots] = torch.arange(p_slots).clamp(max=max_pos)
        for slot in range(m):
            base = p_slots + slot * c_slots
            input_pos[row, base : base + c_slots] = (p_len + c_range).clamp(max=max_pos)
            if slot >= len(run):
                continue  # an empty completion region: attends to the prompt, feeds no result
            i = run[slot]
            resp = response_ids[i]
            if not resp:
                continue
            k = len(resp)
            tokens[row, base : base + k - 1] = torch.tensor(resp[:-1], dtype=torch.long)
            source[row, base : base + k - 1, 0] = i
            source[row, base : base + k - 1, 1] = p_len + torch.arange(k - 1)
            # Token t of the response is predicted at the prompt's last token (t = 0) or at token t - 1.
            pred = torch.arange(base - 1, base + k - 1)
            pred[0] = p_len - 1
            src.append(row * s + pred)
            targets.append(torch.tensor(resp, dtype=torch.long))
            dst.append(i * width + p_len - 1 - start + torch.arange(k))
    empty = torch.zeros(0, dtype=torch.long)
    src_t = torch.cat(src) if src else empty
    targets_t = torch.cat(targets) if targets else empty
    dst_t = torch.cat(dst) if dst else empty
    return SharedPromptLayout(
        tokens=tokens.to(device),
        input_pos=input_pos.to(device),
        mask=SharedPromptMask(p_slots, c_slots, m, prompt_lengths.to(device),
                              torch.tensor([len(run) for run in runs], device=device)),
        src=src_t.to(device),
        targets=targets_t.to(device),
        dst=dst_t.to(device),
        source=source.to(device),
    )
