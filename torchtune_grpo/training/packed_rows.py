"""Packed rows: several sequences in one training row, none attending to another (document masking).

In the one-row-per-sequence layout every row of a forward is padded to the longest sequence in it. With
long-tailed lengths (a 1,000-token completion next to 40-token ones) most of the forward is padding, even
after token-budget micro-batching sorts the lengths (:mod:`~torchtune_grpo.training.micro_batches`). Packing puts
the sequences of a micro-batch one after another into rows as wide as its longest sequence (or, under a
token-budget plan, as wide as the step's longest, filled from every sequence of the step)::

    [ seq 3 (prompt + response[:-1]) | seq 7 | seq 1 | pad ]
    [ seq 0                                      | seq 5   ]

Each sequence keeps its own position ids (from 0) and attends causally to itself only: a
:class:`PackedMask` (an :class:`~torchtune_grpo.models.attention.AttentionLayout`, carried through the same
attention replacement as the shared-prompt layout on torchtune modules; on transformers' own modules turned into
explicit masks from :meth:`PackedMask.pairs`, windows per sequence) gives scaled-dot-product attention a block-diagonal
causal mask, or, with ``packed_attention: flex`` on CUDA, gives FlexAttention (``torch.nn.attention.flex_attention``,
compiled) a block mask of the same pairs, so the blocks of a row that no query of one sequence attends to
are skipped instead of computed and masked (on the CPU, which has no FlexAttention backward, the masked
path runs). Every logprob is the same function of the same inputs as in the unpacked layout (tested in fp32,
gradients included). A sequence is never split across rows (the row width is the longest sequence), so no
state crosses a row boundary. Attention costs ``rows x width^2`` per forward (the padded layout's is
``sequences x width^2``): no more than the padded layout at the same width. Under a token-budget plan
every row is as wide as the step's longest sequence, so a micro-batch of short sequences pays attention
over that width (the masked path computes every pair of a row; about ``tokens x width`` in all).
"""

from typing import Callable, List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from torchtune_grpo.models._transformers_layouts import SlotPairs
from torchtune_grpo.models.attention import AttentionLayout

__all__ = ["PACKED_ATTENTION", "PackedMask", "PackedLayout", "first_fit_decreasing", "flex_packed_attention",
           "packed_layout"]

PACKED_ATTENTION = ("sdpa", "flex")  # the backends of packed rows' attention (``packed_attention``)
_COMPILED_FLEX: Optional[Callable] = None


def _block_mask(segments: torch.Tensor):
    """FlexAttention's block mask of the pairs :class:`PackedMask` allows, ``segments [R, S]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, q_idx, kv_idx):  # the same sequence, causal; a pad slot (-1) also sees itself
        return ((segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)) | (q_idx == kv_idx)

    r, s = segments.shape
    return create_block_mask(allowed, B=r, H=None, Q_LEN=s, KV_LEN=s, device=segments.device)


def flex_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention over packed rows: ``q [R, h, S, d]``, ``k, v [R, h_kv, S, d]`` -> ``[R, h, S, d]``.

    Compiled on CUDA (once per process; eager FlexAttention is a reference implementation, not a fast
    one); eager elsewhere, where it has a forward only (the CPU tests' check of the mask).
    """
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    fn = flex_attention
    if q.is_cuda:
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.size(1) != k.size(1))


class PackedMask(AttentionLayout):
    """Block-diagonal causal attention over the sequences packed into each row (a plain object).

    Args:
        segments (torch.Tensor): ``[R, S]`` long: which sequence of its row each slot belongs to; ``-1`` for
            padding (a pad slot attends to itself only, so no softmax row is empty).
        backend (str): ``"sdpa"``: scaled-dot-product attention with the dense ``[R, 1, S, S]`` mask;
            ``"flex"``: FlexAttention with a block mask on CUDA (skipping the blocks no pair needs), the
            dense mask elsewhere and with dropout. Default is ``"sdpa"``.
    """

    def __init__(self, segments: torch.Tensor, backend: str = "sdpa") -> None:
        if backend not in PACKED_ATTENTION:
            raise ValueError(f"packed_attention must be one of {list(PACKED_ATTENTION)}, got {backend!r}")
        self.segments = segments
        self.backend = backend
        self._mask: Optional[torch.Tensor] = None
        self._block: Optional[object] = None  # built at the first layer's call, shared by the others

    @property
    def mask(self) -> torch.Tensor:
        """``[R, 1, S, S]`` bool: which slot each slot attends to."""
        if self._mask is None:
            segments, s = self.segments, self.segments.size(1)
            same = segments[:, :, None] == segments[:, None, :]  # [R, S, S]
            causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
            eye = torch.eye(s, dtype=torch.bool, device=segments.device)
            self._mask = ((same & causal) | eye)[:, None]
        return self._mask

    def prepare(self) -> None:
        """The block mask where :meth:`attention` takes FlexAttention's path (CUDA), else the dense mask."""
        if self.backend == "flex" and self.segments.is_cuda:
            if self._block is None:
                self._block = _block_mask(self.segments)
        else:
            self.mask  # noqa: B018 - built and kept

    def pairs(self, input_pos: torch.Tensor) -> SlotPairs:
        """The allowed pairs (:class:`~torchtune_grpo.models._transformers_layouts.SlotPairs`): each sequence its
        own segment, nothing shared; ``input_pos [R, S]`` restart at 0 in each (causality and windows by
        position are then within the sequence). The transformers backend builds its masks from it."""
        return SlotPairs(self.segments, torch.zeros_like(self.segments, dtype=torch.bool), input_pos)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """``q [R, h, S, d]``, ``k, v [R, h_kv, S, d]`` -> ``[R, h, S, d]``."""
        if self.backend == "flex" and q.is_cuda and dropout_p == 0.0:
            if self._block is None:
                self._block = _block_mask(self.segments)
            return flex_packed_attention(q, k, v, self._block)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, dropout_p=dropout_p, enable_gqa=q.size(1) != k.size(1)
        )


class PackedLayout(NamedTuple):
    """One micro-batch's sequences packed into rows (fields as ``training_batch.SharedPromptLayout``).

    Attributes:
        tokens (torch.Tensor): ``[R, S]`` long, padded with the pad id.
        input_pos (torch.Tensor): ``[R, S]`` long position ids, from 0 in each sequence.
        mask (PackedMask): the attention layout.
        src (torch.Tensor): ``[K]`` long: flat ``R x S`` index of the hidden state predicting each response
            token.
        targets (torch.Tensor): ``[K]`` long: the response tokens.
        dst (torch.Tensor): ``[K]`` long: flat index into the micro-batch's ``[n, T]`` result.
        source (torch.Tensor): ``[R, S, 2]`` long: the ``(sequence, position)`` of the unshared row each slot holds,
            ``(-1, -1)`` on padding (per-token data of the unshared rows, e.g. MoE routes, laid out like the slots).
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: PackedMask
    src: torch.Tensor
    targets: torch.Tensor
    dst: torch.Tensor
    source: torch.Tensor


def _next_fit(lengths: List[int], width: int) -> List[List[int]]:
    """Sequence indices per row in the given order, a new row when the next sequence does not fit."""
    rows: List[List[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if not rows or n > room:
            rows.append([])
            room = width
        rows[-1].append(i)
        room -= n
    return rows


def first_fit_decreasing(lengths: List[int], width: int, max_per_row: Optional[int] = None) -> List[List[int]]:
    """Sequence indices per row: longest first (ties by index), each into the first row with room, each row's
    lengths summing to at most ``width`` (a longer sequence gets a row of its own) and, with ``max_per_row``,
    holding at most that many sequences."""
    rows: List[List[int]] = []
    room: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, free in enumerate(room):
            if lengths[i] <= free and (max_per_row is None or len(rows[r]) < max_per_row):
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def packed_layout(
    prompt_ids: List[List[int]],
    response_ids: List[List[int]],
    pad_id: int,
    start: int,
    width: int,
    device: Optional[torch.device] = None,
    row_width: Optional[int] = None,
    attention: str = "sdpa",
) -> PackedLayout:
    """Pack ``n`` sequences into rows: as wide as the longest, first-fit decreasing (deterministic); or, with
    ``row_width`` (a token-budget plan's, :func:`~torchtune_grpo.training.micro_batches.plan_micro_batches`), rows of
    that many slots filled next-fit in the given order (the plan lists its rows' sequences one row after
    another, so this never makes more rows than it planned).

    A sequence occupies ``prompt + response[:-1]`` (a response's last token is an input to nothing).

    Args:
        prompt_ids (List[List[int]]): ``n`` non-empty prompts.
        response_ids (List[List[int]]): ``n`` responses.
        pad_id (int): padding id.
        start (int): the result's first column predicts token ``start + 1`` of each ``prompt + response``.
        width (int): ``T``, columns of the result.
        device (Optional[torch.device]): where the tensors go. Default is None (CPU).
        row_width (Optional[int]): slots per row, filled in order; None: first-fit decreasing at the longest
            sequence. Default is None.
        attention (str): :class:`PackedMask`'s backend (``"sdpa"`` or ``"flex"``). Default is ``"sdpa"``.

    Returns:
        PackedLayout: the packed rows and the gather/scatter indices of every response token.
    """
    seqs = [p + r[:-1] if r else list(p) for p, r in zip(prompt_ids, response_ids)]
    lengths = [len(s) for s in seqs]
    if row_width is None:
        rows = first_fit_decreasing(lengths, max(lengths))
    else:
        rows = _next_fit(lengths, max(row_width, max(lengths)))
    s_width = max(sum(lengths[i] for i in row) for row in rows)  # the fullest row: no all-padding column
    tokens = torch.full((len(rows), s_width), pad_id, dtype=torch.long)
    input_pos = torch.zeros((len(rows), s_width), dtype=torch.long)
    segments = torch.full((len(rows), s_width), -1, dtype=torch.long)
    source = torch.full((len(rows), s_width, 2), -1, dtype=torch.long)
    src, targets, dst = [], [], []
    for row, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(members):
            n = lengths[i]
            tokens[row, at : at + n] = torch.tensor(seqs[i], dtype=torch.long)
            input_pos[row, at : at + n] = torch.arange(n)
            segments[row, at : at + n] = seg
            source[row, at : at + n, 0] = i
            source[row, at : at + n, 1] = torch.arange(n)
            k, p_len = len(response_ids[i]), len(prompt_ids[i])
            if k:
                # Response token t is predicted at the sequence's position p_len - 1 + t.
                src.append(row * s_width + at + p_len - 1 + torch.arange(k))
                targets.append(torch.tensor(response_ids[i], dtype=torch.long))
                dst.append(i * width + p_len - 1 - start + torch.arange(k))
            at += n
    empty = torch.zeros(0, dtype=torch.long)
    cat = lambda parts: torch.cat(parts) if parts else empty  # noqa: E731
    return PackedLayout(
        tokens=tokens.to(device),
        input_pos=input_pos.to(device),
        mask=PackedMask(segments.to(device), attention),
        src=cat(src).to(device),
        targets=cat(targets).to(device),
        dst=cat(dst).to(device),
        source=source.to(device),
    )
