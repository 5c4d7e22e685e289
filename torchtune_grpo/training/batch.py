"""Training layouts of a GRPO step's sequences, and their per-token logprobs.

:class:`TrainingBatch` lays out a step's ``N`` sequences for the training forwards in one of three layouts:
one row per sequence (``prompt + completion``, right-padded), shared-prompt rows (``share_prompt=True``: the
completions of a group after their prompt, computed once; :mod:`~torchtune_grpo.training.shared_prompt_rows`)
or packed rows (``pack=True``: several sequences per row, none attending to another;
:mod:`~torchtune_grpo.training.packed_rows`). Every logprob is the same function of the same inputs in each
(tested in fp32, gradients included); only the order of some floating-point sums differs.

A layout's attention runs in the torchtune ``MultiHeadAttention`` modules of the model when a forward gets its
mask (an :class:`~torchtune_grpo.models.attention.AttentionLayout`) as ``mask``:
:func:`~torchtune_grpo.training.layout_choice.install_shared_prompt_attention` gives those modules
:mod:`torchtune_grpo.models.attention`'s forward, which recognises it and otherwise runs torchtune's own forward
unchanged. On transformers' own modules (:class:`~torchtune_grpo.models.TransformersDecoder`) the forward turns
the layout's slot pairs into explicit attention masks instead (:mod:`torchtune_grpo.models._transformers_layouts`;
Qwen3.5's Gated DeltaNet layers, whose state runs along a row, take the row's sequences apart:
:mod:`torchtune_grpo.models._transformers_recurrent`). The layout travels as the ``mask`` argument (not as global
state), so activation checkpointing's recomputation in backward sees it.

Results always come back in the unshared layout: column ``j`` of an ``[N, T]`` result is the prediction of
token ``start + j + 1`` of the row ``prompt + response``, as
:func:`~torchtune_grpo.models.logprobs.sequence_logprobs` gives it, with ``start = min(prompt lengths) - 1``;
positions that are not response tokens hold 0. Masks, advantages, reference/old logprobs and loss
aggregation therefore do not depend on the layout.
"""

import copy
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.models.attention import AttentionLayout
from torchtune_grpo.models.compiled import compiled_layers
from torchtune_grpo.models.logprobs import chunked_logprobs, replace_unembed, sequence_logprobs, TokenLogprobs
from torchtune_grpo.models.moe_routing import router_hooks
from torchtune_grpo.training.layout_choice import (
    install_shared_prompt_attention, shared_prompt_unsupported, supports_shared_prompt, training_layout,
)
from torchtune_grpo.training.micro_batches import agreed_plan, MicroBatchPlan, plan_micro_batches
from torchtune_grpo.training.packed_rows import packed_layout, PackedLayout
from torchtune_grpo.training.routes import layout_routes
from torchtune_grpo.training.shared_prompt_rows import (
    shared_prompt_layout, shared_row_length, SharedPromptLayout, SharedPromptMask,
)

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
        # Rows whose prompts have images: each forward with its rows' image inputs (laid out in a layout's slots).
        self.images = None if images is None or all(i is None for i in images) else list(images)
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

    def _images(self, model: nn.Module, rows: slice, tokens: torch.Tensor, lay: Any = None) -> ContextManager:
        """The forwards over ``rows`` (``tokens [n, L]``) with their prompts' images (none: a no-op); with a layout
        ``lay``, laid out in its slots."""
        if self.images is None:
            return nullcontext()
        from torchtune_grpo.models._vision import batch_image_inputs, image_inputs

        per_row = self.images[rows]
        if lay is None:
            return image_inputs(model, batch_image_inputs(per_row, tokens.size(1), tokens.device))
        from torchtune_grpo.models._vision_layouts import layout_image_inputs, ROW_KEYS

        # One row per sequence only for the types and grids: a group's pixels once, taken per sequence there.
        small = [None if r is None else {k: v for k, v in r.items() if k in ROW_KEYS} for r in per_row]
        unshared = batch_image_inputs(small, tokens.size(1), tokens.device)
        return image_inputs(model, layout_image_inputs(model.image_model, per_row, unshared, tokens,
                                                       self.lengths[rows], lay.source))

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

        with replace_unembed(model, unembed), compiled_layers(model) as compiled, \
                self.routing(model, rows, allow_layout), self._images(model, rows, self.tokens[rows], lay):
            if compiled and isinstance(model, TransformerDecoder) and isinstance(lay.mask, AttentionLayout):
                lay.mask.prepare()  # torchtune's layers attend through it: built here, not in the first compiled layer
            out = model(lay.tokens, mask=lay.mask, input_pos=lay.input_pos)

        def scatter(values: torch.Tensor) -> torch.Tensor:
            flat = torch.zeros(n * width, dtype=values.dtype, device=values.device)
            return flat.index_copy(0, lay.dst, values).view(n, width)

        if with_entropy:
            return TokenLogprobs(scatter(out[:, 0]), scatter(out[:, 1]))
        return TokenLogprobs(scatter(out), None)



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
