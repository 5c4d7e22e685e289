"""Training layouts of a GRPO step's sequences, and their per-token logprobs.

The ``G`` completions of a group share their prompt, and with causal attention the prompt's hidden states,
keys and values are the same in all ``G`` rows. The default layout (one row per sequence,
``prompt + completion``) computes them ``G`` times. :class:`TrainingBatch` with ``share_prompt=True`` packs
the sequences of one prompt (within a micro-batch) into one row instead::

    [ prompt (P slots) | completion 1 (C slots) | completion 2 (C slots) | ... | completion M (C slots) ]

A response's last token predicts nothing, so a completion region holds all its tokens but the last (``C`` is
the longest response minus one). The linear layers (most of the FLOPs) then see ``P + M x C`` tokens
instead of ``M x (P + C + 1)``, and attention is split so that it never costs more than in the unshared
layout: the prompt attends causally to itself once, and each completion attends to the prompt's keys and
causally to its own tokens (``M`` blocks of ``C x (P + C)``; no completion ever sees another). Position ids
continue from the prompt in each completion. Every logprob is the same function of the same inputs as in
the unshared layout (tested to ~1e-6 in fp32, gradients included); only the order of some floating-point
sums differs.

The shared attention runs in the torchtune ``MultiHeadAttention`` modules of the model when a forward gets a
:class:`SharedPromptMask` (an :class:`~torchtune_grpo.models.attention.AttentionLayout`) as its ``mask``:
:func:`install_shared_prompt_attention` gives those modules :mod:`torchtune_grpo.models.attention`'s forward, which
recognises it and otherwise runs torchtune's own forward unchanged. On transformers' own modules
(:class:`~torchtune_grpo.models.TransformersDecoder`) the forward turns the layout's :meth:`SharedPromptMask.pairs`
into explicit attention masks instead (:mod:`torchtune_grpo.models._transformers_layouts`; families whose layers
carry state along a row, Qwen3.5's Gated DeltaNet, train one row per sequence). The layout travels as the
``mask`` argument (not as global state), so activation checkpointing's recomputation in backward sees it.

Results always come back in the unshared layout: column ``j`` of an ``[N, T]`` result is the prediction of
token ``start + j + 1`` of the row ``prompt + response``, as
:func:`~torchtune_grpo.models.logprobs.sequence_logprobs` gives it, with ``start = min(prompt lengths) - 1``;
positions that are not response tokens hold 0. Masks, advantages, reference/old logprobs and loss
aggregation therefore do not depend on the layout.
"""

import copy
from contextlib import nullcontext
from typing import Callable, ContextManager, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention, TransformerDecoder

from torchtune_grpo.models._transformers_layouts import layouts_unsupported, SlotPairs
from torchtune_grpo.models._transformers_policy import TransformersDecoder
from torchtune_grpo.models.attention import AttentionLayout, install_attention, installable
from torchtune_grpo.models.compiled import compiled_layers
from torchtune_grpo.models.logprobs import chunked_logprobs, replace_unembed, sequence_logprobs, TokenLogprobs
from torchtune_grpo.models.moe_routing import router_hooks
from torchtune_grpo.training.micro_batches import agreed_plan, MicroBatchPlan, plan_micro_batches
from torchtune_grpo.training.packed_rows import packed_layout, PackedLayout
from torchtune_grpo.training.routes import layout_routes

__all__ = [
    "install_shared_prompt_attention", "pack_sequences", "response_values", "shared_prompt_layout",
    "shared_prompt_unsupported", "shared_row_length", "SharedPromptMask", "supports_shared_prompt",
    "training_layout", "TrainingBatch", "batch_logprobs", "batch_token_logprobs", "micro_batches",
]


def pack_sequences(
    prompt_ids: List[List[int]], response_ids: List[List[int]], pad_id: int
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Lay out ``prompt + response`` per row, right-padded, for training forwards.

    Generation left-pads prompts; training re-packs each row so it starts at position 0. Then a plain
    causal mask is exact (padding only ever follows real tokens), no position ids are needed, and
    attention can take the fused ``is_causal`` path.

    Args:
        prompt_ids (List[List[int]]): N prompts.
        response_ids (List[List[int]]): N responses.
        pad_id (int): padding id.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``tokens [N, L]`` (int64) and ``response_mask [N, L]`` (bool,
        True on response tokens), with ``L = max(len(prompt) + len(response))``.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    n, seq_len = len(lengths), max(lengths)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, seq_len), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        response_mask[i, len(p) : len(p) + len(r)] = True
    return tokens, response_mask


def response_values(
    prompt_ids: List[List[int]], values: List[List[float]], start: int, width: int
) -> torch.Tensor:
    """Lay out per-response-token values (e.g. sampling logprobs) like the trainer's logprobs.

    The trainer's logprobs of a packed row (``pack_sequences``, prompt then response from position 0)
    start at the prediction of token ``start + 1``; response token ``j`` of row ``i`` sits at position
    ``len(prompt_i) + j``, so its logprob is column ``len(prompt_i) + j - 1 - start``.

    Args:
        prompt_ids (List[List[int]]): N prompts.
        values (List[List[float]]): N lists, one value per response token.
        start (int): the ``start`` passed to ``sequence_logprobs``.
        width (int): ``T``, the number of logprob columns.

    Returns:
        torch.Tensor: ``[N, width]`` float32, 0 where no response token is.
    """
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, (prompt, row) in enumerate(zip(prompt_ids, values)):
        if row:
            first = len(prompt) - 1 - start
            out[i, first : first + len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


class SharedPromptMask(AttentionLayout):
    """The attention layout of a shared-prompt forward, passed to the decoder as its ``mask``.

    A plain object (not a tensor), so that module hooks (FSDP2, activation checkpointing) pass it through.

    Args:
        prompt_slots (int): ``P``, the prompt region of every row (prompts right-padded to it).
        completion_slots (int): ``C``, the region of each completion (right-padded to it).
        num_completions (int): ``M``, completion regions per row.
        prompt_lengths (torch.Tensor): ``[R]`` long, the real prompt length of each row.
    """

    def __init__(
        self, prompt_slots: int, completion_slots: int, num_completions: int, prompt_lengths: torch.Tensor
    ) -> None:
        self.prompt_slots = prompt_slots
        self.completion_slots = completion_slots
        self.num_completions = num_completions
        self.prompt_lengths = prompt_lengths
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
        is padding (-1); completion region ``j`` is segment ``j + 1``. With ``input_pos [R, S]`` (each completion
        continuing its prompt's positions) causality and windows are by position, as in the unshared rows. The
        attention :meth:`attention` computes is these pairs (split into blocks so that no completion is
        computed against another); the transformers backend builds its masks from them.
        """
        p, c, m = self.prompt_slots, self.completion_slots, self.num_completions
        r, device = self.prompt_lengths.size(0), self.prompt_lengths.device
        prompt_real = torch.arange(p, device=device)[None, :] < self.prompt_lengths[:, None]  # [R, P]
        segment = torch.cat([
            torch.where(prompt_real, 0, -1),
            torch.arange(1, m + 1, device=device).repeat_interleave(c)[None].expand(r, m * c),
        ], dim=1)  # [R, P + M*C]
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


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def shared_prompt_unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run shared-prompt (and packed) forwards, or None when it can.

    It can when it is a torchtune :class:`~torchtune.modules.TransformerDecoder` (FSDP-wrapped or not) whose
    attention modules are all plain causal self-attention ``MultiHeadAttention`` (LoRA projections are fine)
    and which returns no intermediate hidden states; or transformers' own module
    (:class:`~torchtune_grpo.models.TransformersDecoder`) of a family whose layers
    :func:`~torchtune_grpo.models._transformers_layouts.layouts_unsupported` accepts (explicit masks).
    """
    if isinstance(model, TransformersDecoder):
        return layouts_unsupported(model)
    if not isinstance(model, TransformerDecoder):
        return f"the model is a {type(model).__name__}, not a torchtune TransformerDecoder"
    if model.output_hidden_states:
        return "the model returns intermediate hidden states (output_hidden_states)"
    attns = _attention_modules(model)
    if not attns:
        return "the model has no torchtune MultiHeadAttention modules"
    for a in attns:
        if not installable(a):
            return f"its attention {type(a).__name__} has its own forward"
        if not a.is_causal:
            return "its attention is not causal self-attention"
    return None


def supports_shared_prompt(model: nn.Module) -> bool:
    """Whether ``model`` can run shared-prompt forwards (see :func:`shared_prompt_unsupported`).

    Anything else trains in the unshared layout.
    """
    return shared_prompt_unsupported(model) is None


def shared_row_length(max_prompt_length: int, max_response_length: int, sequences_per_row: int) -> int:
    """The longest shared-prompt row: ``P + M x C`` slots (``C = max_response_length - 1``, at least 1).

    A micro-batch whose row would be longer than the model's ``max_seq_len`` is computed one row per
    sequence (:meth:`TrainingBatch.logprobs`). ``sequences_per_row`` is ``min(group_size, micro_batch_size)``.
    """
    return max_prompt_length + sequences_per_row * max(1, max_response_length - 1)


def install_shared_prompt_attention(model: nn.Module) -> bool:
    """Let ``model``'s attention modules run :class:`SharedPromptMask` forwards (idempotent).

    Every other forward is unchanged. Returns False (and changes nothing) when
    :func:`supports_shared_prompt` is False.
    """
    if not supports_shared_prompt(model):
        return False
    if isinstance(model, TransformersDecoder):
        return True  # its forward turns the layout into explicit masks: nothing to install
    for a in _attention_modules(model):
        install_attention(a)
    return True


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
        mask=SharedPromptMask(p_slots, c_slots, m, prompt_lengths.to(device)),
        src=src_t.to(device),
        targets=targets_t.to(device),
        dst=dst_t.to(device),
        source=source.to(device),
    )


class TrainingBatch:
    """A step's ``N`` sequences laid out for the training forwards; per-token logprobs ``[N, T]`` of any rows.

    Args:
        prompt_ids (List[List[int]]): ``N`` prompts (consecutive sequences of a group repeat their prompt).
        response_ids (List[List[int]]): ``N`` responses.
        pad_id (int): padding id.
        share_prompt (bool): compute each prompt once per group of sequences in the same micro-batch (see
            the module docstring); False lays out one row per sequence. Models that
            :func:`supports_shared_prompt` rejects use one row per sequence anyway. Default is True.
        pack (bool): without ``share_prompt``: pack each micro-batch's sequences into rows as wide as its
            longest, none attending to another (:mod:`~torchtune_grpo.training.packed_rows`); False pads one row per
            sequence. Models :func:`supports_shared_prompt` rejects are not packed. Default is False.
        device (Optional[torch.device]): where the tensors go. Default is None (CPU).
        packed_attention (str): the packed rows' attention (:class:`~torchtune_grpo.training.packed_rows.PackedMask`):
            ``"sdpa"`` or ``"flex"`` (FlexAttention on CUDA). Default is ``"sdpa"``.
        routed_experts (Optional[List[torch.Tensor]]): a mixture-of-experts engine's routes per row
            (``Rollout.routed_experts``), for the router metrics and routing replay. Default is None.
        replay (bool): force ``routed_experts`` in every forward of this batch (``moe.routing_replay: rollout``;
            in every layout: :meth:`routes_for` lays them out in the layout's slots). Default is False.
        images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each row's prompt image inputs
            (:class:`~torchtune_grpo.data.ImagePromptDataset`'s ``image_inputs``), or None. With images the rows are
            laid out one per sequence (no shared prompts, no packing: the image-text forward takes plain rows), and
            every forward of this batch (old, reference and policy logprobs) sees its rows' images
            (:func:`~torchtune_grpo.models.image_inputs`). Default is None.

    Attributes:
        tokens (torch.Tensor): ``[N, L]`` the unshared rows ``prompt + response``, right-padded.
        routes (Optional[torch.Tensor]): ``[N, L, layers, k]`` int16 (CPU) the engine's routes where ``tokens``
            are, -1 elsewhere (:func:`~torchtune_grpo.training.routes.layout_routes`), or None.
        start (int): ``min(prompt lengths) - 1``: column 0 of a result predicts token ``start + 1``.
        response_mask (torch.Tensor): ``[N, T]`` bool, True where a column predicts a response token.
    """

    def __init__(
        self,
        prompt_ids: List[List[int]],
        response_ids: List[List[int]],
        pad_id: int,
        *,
        share_prompt: bool = True,
        pack: bool = False,
        device: Optional[torch.device] = None,
        packed_attention: str = "sdpa",
        routed_experts: Optional[List[torch.Tensor]] = None,
        replay: bool = False,
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    ) -> None:
        tokens, response_mask = pack_sequences(prompt_ids, response_ids, pad_id)
        # Rows whose prompts have images: one row per sequence, each forward with its rows' image inputs.
        self.images = None if images is None or all(i is None for i in images) else list(images)
        if self.images is not None:
            share_prompt, pack = False, False
        self.routes = None if routed_experts is None else layout_routes(
            prompt_ids, response_ids, routed_experts, tokens.size(1))
        if replay and self.routes is None:
            raise ValueError("moe.routing_replay: rollout, but the rollouts carry no routed_experts: the engine did "
                             "not report routes (TransformersGenerator and the native engine on a transformers MoE "
                             "policy do; vLLM with its routed-experts output)")
        self.replay = bool(replay)
        self.start = min(len(p) for p in prompt_ids) - 1
        self.tokens = tokens.to(device)
        self.response_mask = response_mask[:, self.start + 1 :].to(device)
        self.prompt_ids, self.response_ids = prompt_ids, response_ids
        # [N] real tokens per unshared row: a forward over some rows is cut to their longest.
        self.lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        self.pad_id = pad_id
        self.share_prompt = share_prompt
        self.pack = pack and not share_prompt
        self.packed_attention = packed_attention
        self.device = device
        self.row_width: Optional[int] = None  # a packed plan's (select)
        self._layouts: Dict[Tuple[int, int], "SharedPromptLayout | PackedLayout"] = {}

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, start: int = 0) -> "TrainingBatch":
        """An unshared batch of already packed rows ``tokens [N, L]``, results from column ``start``."""
        batch = cls.__new__(cls)
        batch.tokens, batch.start = tokens, start
        batch.response_mask = None
        batch.prompt_ids = batch.response_ids = batch.lengths = None
        batch.pad_id, batch.share_prompt, batch.pack, batch.device = None, False, False, tokens.device
        batch.packed_attention = "sdpa"
        batch.routes, batch.replay = None, False
        batch.images = None
        batch.row_width = None
        batch._layouts = {}
        return batch

    def __len__(self) -> int:
        return self.tokens.size(0)

    @property
    def width(self) -> int:
        """``T``: result columns."""
        return self.tokens.size(1) - 1 - self.start

    def response_values(self, values: List[List[float]]) -> torch.Tensor:
        """Per-response-token ``values`` (one list per sequence) in the result layout ``[N, T]``, 0 elsewhere.

        E.g. the engine's sampling logprobs, next to the trainer's (see :func:`response_values`).
        """
        return response_values(self.prompt_ids, values, self.start, self.width).to(self.device)

    def select(self, rows: List[int], row_width: Optional[int] = None) -> "TrainingBatch":
        """The batch of ``rows`` (indices, in that order), in the same ``[*, T]`` result layout.

        ``start`` (and so ``T``) stays this batch's, so values of the selection line up with the rest;
        layouts are rebuilt for the new rows. ``row_width``: a packed plan's (:attr:`MicroBatchPlan.row_width`):
        the packed layouts fill rows of that width in ``rows``' order.
        """
        batch = copy.copy(self)
        batch.row_width = row_width
        index = torch.tensor(rows, dtype=torch.long, device=self.tokens.device)
        batch.tokens = self.tokens.index_select(0, index)
        if self.response_mask is not None:
            batch.response_mask = self.response_mask.index_select(0, index)
        if self.routes is not None:
            batch.routes = self.routes.index_select(0, index.cpu())
        if self.images is not None:
            batch.images = [self.images[i] for i in rows]
        if self.prompt_ids is not None:
            batch.prompt_ids = [self.prompt_ids[i] for i in rows]
            batch.response_ids = [self.response_ids[i] for i in rows]
            batch.lengths = [self.lengths[i] for i in rows]
        batch._layouts = {}
        return batch

    def forward_width(self, rows: slice) -> int:
        """The columns of an unshared forward over ``rows``: their longest sequence (at least ``start + 2``)."""
        if self.lengths is None:
            return self.tokens.size(1)
        return max(max(self.lengths[rows]), self.start + 2)

    def real_mask(self, rows: slice, model: Optional[nn.Module] = None, allow_layout: bool = True) -> torch.Tensor:
        """The real (not padding) tokens of ``model``'s forward over ``rows`` (what its routers saw): ``[R, S]``
        bool in a layout's slots when that forward runs one (:meth:`layout_for`), else ``[n, forward_width(rows)]``."""
        lay = self.layout_for(model, rows, allow_layout) if model is not None else None
        if lay is not None:
            return lay.source[..., 0] >= 0
        width = self.forward_width(rows)
        lengths = self.lengths[rows] if self.lengths is not None else [self.tokens.size(1)] * len(range(*rows.indices(len(self))))
        return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]

    def routes_for(
        self, rows: slice, model: Optional[nn.Module] = None, allow_layout: bool = True
    ) -> Optional[torch.Tensor]:
        """The engine's routes where ``model``'s forward over ``rows`` has its tokens, or None: ``[R, S, layers, k]``
        in a layout's slots (a shared prompt takes its first sequence's routes; -1 on padding) when that forward
        runs one, else ``[n, forward_width(rows), layers, k]``."""
        if self.routes is None:
            return None
        lay = self.layout_for(model, rows, allow_layout) if model is not None else None
        if lay is None:
            return self.routes[rows, : self.forward_width(rows)].to(self.device)
        routes = self.routes[rows]  # [n, L, layers, k] (CPU)
        source = lay.source.cpu()
        seq, pos = source[..., 0], source[..., 1]
        laid = routes[seq.clamp(min=0), pos.clamp(min=0)]  # [R, S, layers, k]
        laid = torch.where((seq >= 0)[..., None, None], laid, torch.full_like(laid, -1))
        return laid.to(self.device)

    def routing(self, model: nn.Module, rows: slice, allow_layout: bool = True):
        """A context forcing the engine's routes of ``rows`` in ``model``'s forwards (and recomputations) inside
        it, with ``replay``, in the layout that forward runs; otherwise (or for a dense model) it changes nothing."""
        hooks = router_hooks(model) if self.replay else None
        if hooks is None:
            return nullcontext()
        return hooks.forcing(self.routes_for(rows, model, allow_layout))

    def _images(self, model: nn.Module, rows: slice, tokens: torch.Tensor) -> ContextManager:
        """The forwards over ``rows`` (``tokens [n, L]``) with their prompts' images (none: a no-op)."""
        if self.images is None:
            return nullcontext()
        from torchtune_grpo.models._vision import batch_image_inputs, image_inputs

        return image_inputs(model, batch_image_inputs(self.images[rows], tokens.size(1), tokens.device))

    def layout_for(self, model: nn.Module, rows: slice, allow_layout: bool = True
                   ) -> "Optional[SharedPromptLayout | PackedLayout]":
        """The layout ``model``'s forward over ``rows`` runs (shared-prompt or packed rows), or None for one row per
        sequence: no layout asked for (or ``allow_layout`` False), a model that cannot
        (:func:`shared_prompt_unsupported`), or rows longer than the model's ``max_seq_len``."""
        if not (allow_layout and (self.share_prompt or self.pack) and self.prompt_ids is not None):
            return None
        if not install_shared_prompt_attention(model):
            return None
        lay = self.layout(rows)
        max_len = getattr(model, "max_seq_len", None)
        return lay if max_len is None or lay.tokens.size(1) <= max_len else None

    def plan(
        self,
        *,
        max_tokens: int,
        max_rows: int,
        all_reduce: Optional[Callable[[List[float]], List[float]]] = None,
        num_micro_batches: Optional[int] = None,
    ) -> MicroBatchPlan:
        """Token-budget micro-batches of this batch's rows (:mod:`~torchtune_grpo.training.micro_batches`).

        Units and costs follow this batch's layout: groups in the shared-prompt layout, sequences otherwise.

        Args:
            max_tokens (int): tokens per forward, padding included.
            max_rows (int): sequences per micro-batch at most.
            all_reduce (Optional[Callable[[List[float]], List[float]]]): sums floats over ranks; the number
                of micro-batches is then the largest over ranks. Default is None (this rank's own count,
                or ``num_micro_batches``).
            num_micro_batches (Optional[int]): exactly this many (without ``all_reduce``). Default is None.

        Returns:
            MicroBatchPlan: the row order and the micro-batch sizes.
        """
        kw = dict(
            max_tokens=max_tokens, max_rows=max_rows, prompt_ids=self.prompt_ids if self.share_prompt else None,
            packed=self.pack,
        )
        prompt_lens = [len(p) for p in self.prompt_ids]
        response_lens = [len(r) for r in self.response_ids]
        if all_reduce is not None:
            return agreed_plan(prompt_lens, response_lens, all_reduce=all_reduce, **kw)
        return plan_micro_batches(prompt_lens, response_lens, num_micro_batches=num_micro_batches, **kw)

    def real_tokens(self, rows: slice) -> int:
        """Slots of a forward over ``rows`` that hold a real token (the rest of :meth:`padded_tokens` is
        padding): ``prompt + response`` per sequence, or, shared, each row's prompt once and every response
        but its last token."""
        if self.prompt_ids is None:
            return int(self.tokens[rows].numel())
        if self.pack:  # a response's last token is an input to nothing
            return sum(len(p) + max(len(r) - 1, 0) for p, r in zip(self.prompt_ids[rows], self.response_ids[rows]))
        if not self.share_prompt:
            return sum(self.lengths[rows])
        prompts = self.prompt_ids[rows]
        once = sum(len(p) for i, p in enumerate(prompts) if i == 0 or prompts[i - 1] != p)  # one per row
        return once + sum(max(len(r) - 1, 0) for r in self.response_ids[rows])

    def padded_tokens(self, rows: slice) -> int:
        """Tokens a forward over ``rows`` holds, padding included (for padding metrics and benchmarks)."""
        n = len(range(*rows.indices(len(self))))
        if (self.share_prompt or self.pack) and self.prompt_ids is not None:
            return int(self.layout(rows).tokens.numel())
        if self.lengths is None:
            return n * self.tokens.size(1)
        return n * max(self.lengths[rows])

    def layout(self, rows: slice) -> "SharedPromptLayout | PackedLayout":
        """The shared-prompt (or, with ``pack``, packed) layout of ``rows`` (built once, reused by every pass
        over the same rows)."""
        key = (rows.start or 0, rows.stop if rows.stop is not None else len(self))
        if key not in self._layouts:
            a, b = key
            args = (self.prompt_ids[a:b], self.response_ids[a:b], self.pad_id, self.start, self.width, self.device)
            if self.pack:
                self._layouts[key] = packed_layout(*args, row_width=self.row_width, attention=self.packed_attention)
            else:
                self._layouts[key] = shared_prompt_layout(*args)
        return self._layouts[key]

    def logprobs(
        self,
        model: nn.Module,
        rows: slice,
        *,
        temperature: float = 1.0,
        chunk_size: int = 512,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        allow_layout: bool = True,
    ) -> TokenLogprobs:
        """Per-token logprobs (and entropy) of ``rows`` under ``model``: ``[n, T]``, 0 off response tokens.

        Arguments as :func:`~torchtune_grpo.models.logprobs.sequence_logprobs`. One forward over the rows, in the
        batch's layout (:meth:`layout_for`), or one row per sequence with ``allow_layout`` False.
        """
        # The shared-prompt and packed layouts run through the same attention replacement (torchtune modules) or
        # explicit masks (transformers' modules).
        lay = self.layout_for(model, rows, allow_layout)
        shared = lay is not None
        if not shared:
            tokens = self.tokens[rows]  # [n, L]
            if self.lengths is not None:
                # Cut to these rows' longest sequence: the rest is padding after every real token, which
                # causal attention never lets a real token see.
                tokens = tokens[:, : max(max(self.lengths[rows]), self.start + 2)]
            with compiled_layers(model), self.routing(model, rows, allow_layout), self._images(model, rows, tokens):
                out = sequence_logprobs(
                    model, tokens, start=self.start, temperature=temperature, chunk_size=chunk_size,
                    with_entropy=with_entropy, entropy_grad=entropy_grad,
                )
            if self.response_mask is None:
                return out
            # The same convention as the shared layout: 0 wherever no response token is predicted.
            keep = self.response_mask[rows]
            grow = self.width - out.logprobs.size(1)  # back to the batch's T columns

            def zero(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
                if t is None:
                    return None
                t = F.pad(t, (0, grow))
                return torch.where(keep, t, torch.zeros_like(t))

            return TokenLogprobs(zero(out.logprobs), zero(out.entropy))
        n, width = self.tokens[rows].size(0), self.width

        def unembed(h: torch.Tensor) -> torch.Tensor:
            # Only the hidden states that predict response tokens: [K, D].
            picked = model.norm(h.reshape(-1, h.size(-1)).index_select(0, lay.src))
            out = chunked_logprobs(
                picked[None], lay.targets[None], model.output, temperature=temperature,
                chunk_size=chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad,
            )
            if out.entropy is None:
                return out.logprobs[0].clone()  # [K]; a fresh tensor, not a view (FSDP2)
            return torch.stack([out.logprobs[0], out.entropy[0]], dim=-1)  # [K, 2]

        with replace_unembed(model, unembed), compiled_layers(model), self.routing(model, rows, allow_layout):
            out = model(lay.tokens, mask=lay.mask, input_pos=lay.input_pos)

        def scatter(values: torch.Tensor) -> torch.Tensor:
            flat = torch.zeros(n * width, dtype=values.dtype, device=values.device)
            return flat.index_copy(0, lay.dst, values).view(n, width)

        if with_entropy:
            return TokenLogprobs(scatter(out[:, 0]), scatter(out[:, 1]))
        return TokenLogprobs(scatter(out), None)


def training_layout(
    model: nn.Module,
    *,
    share_prompt: bool,
    explicit: bool,
    max_prompt_length: Optional[int],
    max_response_length: int,
    group_size: int,
    micro_batch_size: int,
    pack: bool = False,
) -> Tuple[bool, Optional[str]]:
    """Whether training forwards share each prompt across its group's rows, and what to tell the user.

    With ``share_prompt`` on and a model that cannot share prompts, the default falls back to one row per
    sequence (same results), said in the returned note; asked for explicitly in the config, it is an error.
    When a shared row can exceed the model's ``max_seq_len``, the note says such micro-batches are computed
    one row per sequence.

    Args:
        model (nn.Module): the policy.
        share_prompt (bool): ``share_prompt_in_training``.
        explicit (bool): whether the config wrote ``share_prompt_in_training`` (rather than the default).
        max_prompt_length (Optional[int]): the longest prompt, or None (unknown).
        max_response_length (int): the response budget.
        group_size (int): completions per prompt.
        micro_batch_size (int): rows per forward.
        pack (bool): ``pack_sequences_in_training`` (packed rows are for one row per sequence: with prompts
            shared, the note says it is not used). Default is False.

    Returns:
        Tuple[bool, Optional[str]]: the layout to use, and a note to log (None: nothing to say).

    Raises:
        ValueError: ``share_prompt_in_training: true`` written in the config, with a model that cannot.
    """
    shared, note = _shared_layout(
        model, share_prompt, explicit, max_prompt_length, max_response_length, group_size, micro_batch_size
    )
    if pack and not shared and (reason := shared_prompt_unsupported(model)) is not None:
        # Packed rows run through the same attention replacement as shared prompts (per-sequence positions and a
        # block mask): a model without it trains one row per sequence, the same results unpacked.
        note = (note + " " if note else "") + (
            f"pack_sequences_in_training: not used, because {reason}; one row per sequence (the same results)."
        )
    if pack and shared:
        note = (note + " " if note else "") + (
            "pack_sequences_in_training: not used, prompts are shared (share_prompt_in_training); packed rows "
            "are for one row per sequence."
        )
    return shared, note


def _shared_layout(
    model: nn.Module, share_prompt: bool, explicit: bool, max_prompt_length: Optional[int],
    max_response_length: int, group_size: int, micro_batch_size: int,
) -> Tuple[bool, Optional[str]]:
    if not share_prompt:
        return False, None
    reason = shared_prompt_unsupported(model)
    if reason is not None:
        if explicit:
            raise ValueError(f"share_prompt_in_training: true, but {reason}. Set share_prompt_in_training: false.")
        return False, (
            f"Training layout: one row per sequence, because {reason} (share_prompt_in_training is on by "
            "default; the results are the same, the prompt is computed once per sequence)."
        )
    max_seq_len = getattr(model, "max_seq_len", None)
    per_row = min(group_size, micro_batch_size)
    longest = None if max_prompt_length is None else shared_row_length(max_prompt_length, max_response_length, per_row)
    if max_seq_len is None or (longest is not None and longest <= max_seq_len):
        return True, None
    shown = "unknown (no max_prompt_length)" if longest is None else longest
    return True, (
        f"Training layout: a micro-batch whose shared-prompt row (prompt + {per_row} completions; longest "
        f"{shown}) exceeds the model's max_seq_len {max_seq_len} is computed one row per sequence (same "
        "results, no prompt sharing for it)."
    )


def micro_batches(n: int, size: int, start: int = 0) -> List[slice]:
    """Row slices of at most ``size`` rows covering ``[start, n)``."""
    return [slice(i, min(i + size, n)) for i in range(start, n, size)]


@torch.no_grad()
def batch_token_logprobs(
    model: nn.Module, batch: TrainingBatch, *, micro_batch_size: int, temperature: float = 1.0,
    chunk_size: int = 512, with_entropy: bool = False, plan: Optional[MicroBatchPlan] = None,
) -> TokenLogprobs:
    """Logprobs ``[N, T]`` (and entropy ``[N, T]``) of every row of ``batch`` under ``model``, no grad.

    Micro-batches of ``micro_batch_size`` rows in order, or those of a token-budget ``plan``
    (:meth:`TrainingBatch.plan`; results come back in the batch's row order either way).
    """
    ordered, mbs = batch, micro_batches(len(batch), micro_batch_size)
    if plan is not None:
        ordered, mbs = batch.select(plan.order, row_width=plan.row_width), plan.slices()
    outs = [
        ordered.logprobs(model, mb, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                         entropy_grad=False)
        for mb in mbs
    ]
    logprobs = torch.cat([o.logprobs for o in outs])
    entropy = torch.cat([o.entropy for o in outs]) if with_entropy else None
    if plan is not None:
        logprobs = plan.restore(logprobs)
        entropy = plan.restore(entropy) if entropy is not None else None
    return TokenLogprobs(logprobs, entropy)


def batch_logprobs(
    model: nn.Module, batch: TrainingBatch, *, micro_batch_size: int, temperature: float = 1.0,
    chunk_size: int = 512, plan: Optional[MicroBatchPlan] = None,
) -> torch.Tensor:
    """Logprobs ``[N, T]`` of every row of ``batch`` under ``model``, micro-batch by micro-batch, no grad."""
    return batch_token_logprobs(
        model, batch, micro_batch_size=micro_batch_size, temperature=temperature, chunk_size=chunk_size, plan=plan
    ).logprobs
