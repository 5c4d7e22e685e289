"""The native engine's decode on transformers' own modules: one prefill per group, rows leave as they stop.

A :class:`~torchtune_grpo.models.TransformersDecoder` policy (every family the torchtune backend does not build:
Qwen3.5's Gated DeltaNet, Gemma 3/4, OLMo 3, the MoE families, ...) is sampled by
:class:`~torchtune_grpo.generation.NativeGenerator` through :class:`HFRollout`, which drives the causal LM's own
``forward`` and KV cache (sliding windows, linear-attention state, KV-shared layers: whatever the family's cache
is) with the engine's own decode loops and sampler:

- **prefill once per group**: the ``B`` left-padded prompts run once, with the attention mask and the position
  ids transformers' ``generate`` builds (``mask.cumsum(-1) - 1``, 0 on padding; decode positions count on from
  the last). Left padding is exact for every layer kind: softmax attention masks the padded keys, and Gated
  DeltaNet zeroes the padded positions' hidden states before its projections
  (``apply_mask_to_padding_states``), so a padded position adds nothing to the convolution window or the
  recurrent state (zero keys and values leave a zero state zero). The cache is then repeated to the ``G`` rows
  of each group with ``Cache.reorder_cache`` (an ``index_select`` of every layer's tensors), not
  ``batch_repeat_interleave``: in transformers 5.19 the linear-attention cache layers have no
  ``batch_repeat_interleave``/``batch_select_indices`` (the Qwen3.5 cache would fail) and the hybrid layers'
  versions copy the attention part only, while ``reorder_cache`` covers keys/values, convolution and recurrent
  states alike. ``share_prefill=False`` prefills every row instead.
- **rows leave the batch**: with ``compact_decode`` the engine's
  :func:`~torchtune_grpo.generation._compact.compacting_decode_loop` calls :meth:`HFRollout.compact`, which keeps
  the live rows of the cache (``reorder_cache`` again), of the attention mask and of the positions. The sampler
  draws its noise for the whole batch (``noise_rows``/``noise_batch``), so a row's tokens are a function of the
  seed exactly as with the torchtune backend, whichever rows are still decoding.
- **mixture of experts**: the routers' choices are recorded in every forward
  (:func:`~torchtune_grpo.models.moe_routing.router_hooks`); :meth:`HFRollout.routes` lays them out per row as
  :func:`~torchtune_grpo.generation._transformers.routes_of_generate` does for ``generate`` (prompt tokens from the
  prefill, repeated to the group's rows; response token ``j`` from the decode forward that fed it; -1 for the
  last).

- **images in the prompt** (a policy with :func:`~torchtune_grpo.models.attach_images`): the prefill runs the
  image-text class's inner model (``policy.image_model``: the tower, the projector, the family's image masks and
  positions) with the prompts' pixels and the same cache, mask and positions; the decode steps are text and run
  the causal LM on that cache as before. Qwen3.5's M-RoPE: the prefill's positions are transformers' own
  ``get_rope_index`` (3-D on image tokens), passed as ``generate`` passes them (text positions first, then the
  three M-RoPE axes); a decode position is the text position plus the row's ``rope_delta`` on the three axes.

- **compiled decode** (``compile_decode``; on CUDA by default): after the eager prefill the keys and values go
  into a fixed-shape cache and each decode step is one compiled call (:mod:`~torchtune_grpo.generation._hf_static`);
  rows then stay in the batch to the end. Otherwise decode steps run eagerly on transformers' dynamic cache, its
  full-attention layers growing in place (``_hf_cache.py``).

Multi-turn sessions that keep this cache between turns: :mod:`~torchtune_grpo.generation._hf_session`
(full-attention families).
"""

import inspect
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.generation._decode import fsdp_hooks_as_casts, to_rollout
from torchtune_grpo.generation._hf_static import fill_fixed, static_decode_step, static_decode_unsupported, warn_eager_once
from torchtune_grpo.generation._output import Rollout
from torchtune_grpo.models import grouped_kv_attention
from torchtune_grpo.models.moe_routing import router_hooks

__all__ = ["HFRollout", "sample_with_hf_cache"]


def sample_with_hf_cache(
    engine: Any,
    hf: nn.Module,
    prompts: List[List[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    pad_id: int,
    stop_tokens: Sequence[int],
    generator: Optional[torch.Generator],
    temperature: float,
    image_model: Optional[nn.Module] = None,
    images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
) -> Rollout:
    """``group_size`` completions of each prompt, sampled by ``engine``'s decode loop on ``hf``'s cache.

    Args:
        engine (Any): the :class:`~torchtune_grpo.generation.NativeGenerator` (its ``share_prefill``,
            ``compact_decode``, ``compacting_loop`` and ``decode_loop``: the sampling and stop checks of the
            torchtune backend).
        hf (nn.Module): a transformers causal LM (``TransformersDecoder.sampler()``).
        prompts (List[List[int]]): ``B`` prompts.
        group_size (int): completions per prompt, ``G``.
        max_new_tokens (int): the response budget.
        pad_id (int): the padding id.
        stop_tokens (Sequence[int]): ids that end a completion (kept as its last token).
        generator (Optional[torch.Generator]): the sampling RNG, on ``hf``'s device. Default is None.
        temperature (float): 0 is greedy.
        image_model (Optional[nn.Module]): the policy's ``image_model`` (needed with ``images``). Default is None.
        images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs (as
            :class:`~torchtune_grpo.data.ImagePromptDataset` gives them) or None. Default is None.

    Returns:
        Rollout: ``B x G`` rows (row ``i`` answers prompt ``i // G``); ``routed_experts`` for a mixture of experts.
    """
    hooks = router_hooks(hf)
    device = next(hf.parameters()).device
    fixed = None  # compiled decode on a fixed-shape cache (_hf_static.py), where the engine and the family allow
    if engine.compiles_decode(device):
        reason = static_decode_unsupported(hf, records_routes=hooks is not None)
        if reason is None:
            fixed = engine.static_hf_caches
        else:
            warn_eager_once(hf.config.model_type, reason)
    run = HFRollout(hf, prompts, group_size, pad_id, share_prefill=engine.share_prefill, image_model=image_model,
                    images=images, full_history=fixed is not None)
    stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=run.device)
    # Inference mode, as the torchtune path: no autograd bookkeeping on the decode's many small ops. Grouped-query
    # heads attend without copying the cache per step (models/_grouped_attention.py).
    with torch.inference_mode(), grouped_kv_attention(hf), ExitStack() as stack, \
            hooks.recording() if hooks is not None else nullcontext() as recorded:
        try:
            logits = run.prefill()  # [B*G, V]
            # Decode steps run FSDP2's hooks as plain casts: one compiled graph, and less Python per step eagerly.
            stack.enter_context(fsdp_hooks_as_casts(hf))
            if fixed is not None:
                run.fix(fixed.take(hf, logits.size(0), run.slots + max_new_tokens, run.device),
                        engine.compiled_step(device, static_decode_step))
                out, done = engine.decode_loop(logits, run.decode, max_new_tokens, pad_id, stop, temperature,
                                               generator)
            elif engine.compact_decode:
                out, done = engine.compacting_loop(
                    logits, run.decode, run.compact, max_new_tokens, pad_id, stop, temperature, generator)
            else:
                out, done = engine.decode_loop(logits, run.decode, max_new_tokens, pad_id, stop, temperature,
                                               generator)
        finally:
            run.cache = None  # the cache is the rollout's (a fixed one stays with the engine): drop it now
    rollout = to_rollout([p for p in run.prompts for _ in range(group_size)], out, done, stop)
    if recorded is not None:
        rollout = rollout._replace(routed_experts=run.routes(recorded, rollout.response_ids))
    return rollout


class HFRollout:
    """One rollout's transformers cache, attention mask and positions; prefill, decode steps and compaction.

    Args:
        hf (nn.Module): a transformers causal LM (``TransformersDecoder.sampler()``).
        prompts (List[List[int]]): ``B`` prompts, token ids.
        group_size (int): rows per prompt, ``G``; row ``i`` of the rollout belongs to prompt ``i // G``.
        pad_id (int): the padding id.
        share_prefill (bool): prefill each prompt once and repeat its cache to its ``G`` rows; False prefills all
            ``B x G`` rows. Default is True.
        image_model (Optional[nn.Module]): the image-text class's inner model sharing ``hf``'s language model
            (:func:`~torchtune_grpo.models.attach_images`); the prefill runs it when ``images`` are given.
        images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs, or None.
        full_history (bool): every attention layer keeps all its slots (windowed ones too), for :meth:`fix`.
            Default is False.
        by_position (bool): after the prefill, attend by position (explicit masks: causal and windows by position
            id, holes masked) instead of by slot: a multi-turn session's rows with holes on a windowed family
            (``_hf_session.py``). Implies ``full_history``. Default is False.
    """

    def __init__(self, hf: nn.Module, prompts: List[List[int]], group_size: int, pad_id: int, *,
                 share_prefill: bool = True, image_model: Optional[nn.Module] = None,
                 images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
                 full_history: bool = False, by_position: bool = False) -> None:
        self.hf = hf
        self.prompts = [list(p) for p in prompts]
        self.group_size = group_size
        self.share_prefill = share_prefill
        self.device = next(hf.parameters()).device
        self.width = max(len(p) for p in self.prompts)
        b = len(self.prompts)
        ids = torch.full((b, self.width), pad_id, dtype=torch.long)
        mask = torch.zeros((b, self.width), dtype=torch.long)
        for i, p in enumerate(self.prompts):
            ids[i, self.width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, self.width - len(p):] = 1
        self._ids, mask = ids.to(self.device), mask.to(self.device)  # [B, W] each
        # generate()'s positions: count the real tokens, 0 on padding.
        self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, W]
        # generate() drops an all-ones mask (no padding anywhere) once, before the prefill: the same here, so the
        # attention kernels see what they see under generate().
        self.mask: Optional[torch.Tensor] = None if bool((mask == 1).all()) and not by_position else mask
        # by_position: each slot's position id [n, slots] (the masks of later forwards are built from it)
        self.by_position = by_position
        self.key_positions: Optional[torch.Tensor] = None
        # transformers' cache for the model, its full-attention layers growing in place (_hf_cache.py). Imported
        # here, not at the top: transformers is needed for transformers' modules only (`make demo`'s environment
        # has none), and a run without a transformers policy saves its 1.5 s of start-up.
        from torchtune_grpo.generation._hf_cache import growing_cache

        self.cache = growing_cache(hf.config, full_history=full_history or by_position)
        # A fixed-shape cache's decode (fix()): its [N, capacity] mask and the compiled step; None while eager.
        self._fixed_mask: Optional[torch.Tensor] = None
        self._step: Optional[Callable[..., torch.Tensor]] = None
        self.slots = 0  # the cache's sequence length: slots written so far (every row the same)
        # [n] the rollout rows (0 .. B*G-1) in the decode batch, in batch order: which row a decode forward's
        # i-th entry is, for the routes.
        self.rows = torch.arange(b * group_size)
        # Only the last position's logits (as generate() asks, where the family's forward takes it): the prefill
        # never builds [B, W, V].
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
        self._forwards: List[torch.Tensor] = []  # the rows of each decode forward ([n] each, CPU)
        self.image_model = image_model
        self.images = None if images is None or all(i is None for i in images) else list(images)
        if self.images is not None and image_model is None:
            raise ValueError("prompts with images need the policy's image side (attach_images)")
        self.rope_delta: Optional[torch.Tensor] = None  # [n, 1] Qwen3.5's M-RoPE offset of each row's text positions
        # Decode steps get their masks ready-made (_decode_step_mask) on transformers' dynamic cache.
        from torchtune_grpo.models._transformers_layouts import decode_mask_unsupported

        # (Not with every windowed layer's slots kept: those layers' masks then apply the window themselves.)
        self._ready_masks = not (full_history or by_position) and decode_mask_unsupported(hf.config) is None

    def _rope(self, positions: torch.Tensor) -> torch.Tensor:
        if self.rope_delta is None:
            return positions
        shifted = positions + self.rope_delta  # M-RoPE after images: text positions, then the three rotary axes
        return torch.stack([positions, shifted, shifted, shifted])  # [4, n, M]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attention = self.mask
        if self.by_position and self.key_positions is not None:  # after the prefill: the new slots' masks by position
            self.key_positions = torch.cat([self.key_positions, positions], dim=-1)
            attention = self._position_masks(positions)
        elif ids.size(1) == 1 and attention is not None and self._ready_masks:
            attention = self._decode_step_mask(attention)
        positions = self._rope(positions)
        out = self.hf(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=self.cache,
                      use_cache=True, **self._last_only)
        self.cache = out.past_key_values
        self.slots += ids.size(1)
        return out.logits[:, -1].float()  # [n, V]

    def _decode_step_mask(self, mask: torch.Tensor) -> Any:
        """A one-token step's attention mask, ready-made from the ``[n, S]`` padding ``mask``, or ``mask`` itself.

        transformers builds each forward's 4-D masks from the 2-D one (``create_causal_mask``: a few dozen small
        operations and its mask functions); in a decode step that mask keeps exactly the slots that are not
        padding (of a windowed layer, its last ones), so it is handed over built (``decode_step_mask``): 1-7 % of a
        decode step of a tiny Qwen2 on CPU, the same logits bit for bit. Where no slot is padding transformers
        drops the mask (the kernel runs unmasked): the 2-D mask goes on, as before.
        """
        from torchtune_grpo.models._transformers_layouts import decode_step_mask

        visible = mask.bool()  # [n, S]
        if bool(visible.all()):
            return mask
        return decode_step_mask(self.hf.config, self.hf.get_input_embeddings().weight.dtype, visible)

    def _position_masks(self, queries: torch.Tensor) -> Any:
        """The attention masks of ``[n, M]`` query positions (the last ``M`` slots) over every slot, by position.

        A query attends a slot the 2-D mask keeps (not a hole, not padding) whose position is not after its own
        and, in a windowed layer, less than the window before it; every query attends its own slot, so no softmax
        row is empty (a padded query's output is never read). The family's mask format and per-layer-type rule are
        the training layouts' (``models/_transformers_layouts.py``).
        """
        from torchtune_grpo.models._transformers_layouts import masks_by_layer_type

        visible, keys = self.mask.bool(), self.key_positions  # [n, S] each
        m, s = queries.size(1), keys.size(1)
        distance = queries[:, :, None] - keys[:, None, :]  # [n, M, S]
        own = torch.zeros((m, s), dtype=torch.bool, device=self.device)
        own[torch.arange(m), torch.arange(s - m, s)] = True

        def allowed(window: Optional[int]) -> torch.Tensor:
            ok = visible[:, None, :] & (distance >= 0)
            if window is not None:
                ok = ok & (distance < window)
            return ok | own

        return masks_by_layer_type(self.hf.config, self.hf.get_input_embeddings().weight.dtype, allowed)

    def select(self, index: torch.Tensor) -> None:
        """Keep (and repeat) batch entries ``index`` of the cache, the mask and the positions."""
        self._expand(index)
        self.rows = self.rows.index_select(0, index.cpu())

    def full_mask(self) -> torch.Tensor:
        """The ``[n, slots]`` attention mask, made explicit where it was dropped (no padding: all ones)."""
        if self.mask is None:
            self.mask = torch.ones((self.positions.size(0), self.slots), dtype=torch.long, device=self.device)
        return self.mask

    def append(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``[n, M]`` tokens to the rows in the batch after what their caches hold (a later turn's tokens).

        Args:
            ids (torch.Tensor): ``[n, M]`` token ids, each row's right-aligned (its last token in the last column).
            valid (torch.Tensor): ``[n, M]`` 1 where ``ids`` holds a real token, 0 on the padding left of it.
            positions (torch.Tensor): ``[n, M]`` each token's position id.

        Returns:
            torch.Tensor: ``[n, V]`` the logits after each row's last token (fp32).
        """
        self.mask = torch.cat([self.full_mask(), valid.to(self.mask.dtype)], dim=-1)
        logits = self._forward(ids, positions)
        self.positions = positions[:, -1:]
        return logits

    def _expand(self, index: torch.Tensor) -> None:
        """Keep (and repeat) batch entries ``index`` of the cache, the mask and the positions."""
        self.cache.reorder_cache(index)
        self.positions = self.positions.index_select(0, index)
        if self.key_positions is not None:
            self.key_positions = self.key_positions.index_select(0, index)
        if self.rope_delta is not None:
            self.rope_delta = self.rope_delta.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)

    def prefill(self) -> torch.Tensor:
        """Run the prompts; return the first token's logits ``[B x G, V]`` (fp32)."""
        b, g = len(self.prompts), self.group_size
        per_group = torch.arange(b, device=self.device).repeat_interleave(g)  # [B*G] each row's prompt
        ids, positions = self._ids, self.positions
        if not self.share_prefill:
            ids, positions = ids.index_select(0, per_group), positions.index_select(0, per_group)
            self.positions = positions
            if self.mask is not None:
                self.mask = self.mask.index_select(0, per_group)
        if self.images is not None:
            rows = range(b) if self.share_prefill else per_group.tolist()
            logits = self._prefill_with_images(ids, positions, [self.images[i] for i in rows])
        else:
            logits = self._forward(ids, positions)  # [B, V] or [B*G, V]
        if self.by_position:
            self.key_positions = positions
        if self.share_prefill:
            self._expand(per_group)
            logits = logits.index_select(0, per_group)
        self.positions = self.positions[:, -1:]  # [N, 1] only the last position is needed from here on
        return logits

    def _prefill_with_images(self, ids: torch.Tensor, positions: torch.Tensor,
                             images: List[Optional[Mapping[str, torch.Tensor]]]) -> torch.Tensor:
        """The prefill of ``ids [n, W]`` with the rows' ``images``, by the image-text class's inner model."""
        from torchtune_grpo.models._transformers_policy import TransformersHead
        from torchtune_grpo.models._vision import batch_image_inputs, text_ids

        inputs = batch_image_inputs(images, ids.size(1), self.device, left=True)
        inner = self.image_model
        if hasattr(inner, "get_rope_index"):  # Qwen3.5: M-RoPE, as generate() computes it
            mask = self.mask if self.mask is not None else torch.ones_like(ids)
            rotary, delta = inner.get_rope_index(ids, attention_mask=mask, **{
                k: v for k, v in inputs.items() if k in ("mm_token_type_ids", "image_grid_thw")})
            positions = torch.cat([positions[None], rotary], dim=0)  # [4, n, W]
            self.rope_delta = delta.to(self.device).reshape(-1, 1)
        # An image token sampled in an earlier turn of a re-sent history is text (models/_vision.py, text_ids).
        with text_ids(inner, ids, inputs) as fed:
            out = inner(input_ids=fed, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
                        use_cache=True, **inputs)
        self.cache = out.past_key_values
        self.slots += ids.size(1)
        return TransformersHead(self.hf)(out.last_hidden_state[:, -1:])[:, -1].float()  # [n, V]

    def fix(self, held: "tuple[Any, torch.Tensor]", step: Callable[..., torch.Tensor]) -> None:
        """Move the prefilled keys and values into a fixed-shape cache; decode steps then call ``step`` on it.

        Args:
            held (tuple[Any, torch.Tensor]): a zeroed ``StaticCache`` of ``N`` rows and its ``[N, capacity]`` mask
                (:meth:`~torchtune_grpo.generation._hf_static.StaticDecode.take`), ``capacity >= slots + budget``.
            step (Callable[..., torch.Tensor]): :func:`~torchtune_grpo.generation._hf_static.static_decode_step`,
                compiled or not.
        """
        cache, mask = held
        fill_fixed(cache, self.cache)
        mask[:, : self.slots] = 1 if self.mask is None else self.mask
        self.cache, self._fixed_mask, self._step = cache, mask, step

    def decode(self, token: torch.Tensor, t: int) -> torch.Tensor:
        """Feed ``token [n]`` (response token ``t`` of the rows in the batch); return the next logits ``[n, V]``."""
        self.positions = self.positions + 1
        self._forwards.append(self.rows)
        if self._step is not None:  # the fixed cache: this step's slot joins the mask, one compiled call
            self._fixed_mask[:, self.slots] = 1
            self.slots += 1
            return self._step(self.hf, self.cache, token[:, None], self._rope(self.positions), self._fixed_mask)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.size(0), 1)], dim=-1)
        return self._forward(token[:, None], self.positions)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (``[n']`` indices into the batch's rows, ascending) of the decode batch."""
        self._expand(keep.to(self.device))
        self.rows = self.rows.index_select(0, keep.cpu())

    def routes(self, recorded: List[List[torch.Tensor]], responses: List[List[int]]) -> List[torch.Tensor]:
        """Each row's routes, as :func:`~torchtune_grpo.generation._transformers.routes_of_generate` gives them.

        Args:
            recorded (List[List[torch.Tensor]]): per MoE layer, per forward of this rollout (the prefill, then each
                decode step), ``[tokens, k]`` int16 (``RouterHooks.recording``).
            responses (List[List[int]]): the ``B x G`` kept responses.

        Returns:
            List[torch.Tensor]: per row ``[len(prompt) + len(response), layers, k]`` int16: the prompt's tokens
            from the prefill (left padding stripped; with a shared prefill the group's one prefill row), response
            token ``j`` from the decode forward that fed it, -1 for the last response token (sampled, never an
            input).

        Raises:
            RuntimeError: when the recorded forwards do not line up with the prefill and the decode steps.
        """
        per_forward = [torch.stack(f, dim=1) for f in zip(*recorded)]  # each [tokens, layers, k]
        prefilled = len(self.prompts) * (1 if self.share_prefill else self.group_size)
        if len(per_forward) != 1 + len(self._forwards) or per_forward[0].size(0) != prefilled * self.width or any(
                f.size(0) != rows.numel() for f, rows in zip(per_forward[1:], self._forwards)):
            raise RuntimeError(f"routing record: forwards of {[f.size(0) for f in per_forward]} tokens; expected a "
                               f"prefill of {prefilled} x {self.width} then {[r.numel() for r in self._forwards]}")
        prefill = per_forward[0].view(prefilled, self.width, *per_forward[0].shape[1:])  # [B or N, W, layers, k]
        n = len(self.prompts) * self.group_size
        steps = torch.full((n, len(self._forwards), *prefill.shape[2:]), -1, dtype=torch.int16)  # [N, T, layers, k]
        for t, (routes, rows) in enumerate(zip(per_forward[1:], self._forwards)):
            steps[rows, t] = routes
        out = []
        for i, resp in enumerate(responses):
            prompt = self.prompts[i // self.group_size]
            source = i // self.group_size if self.share_prefill else i
            r = torch.full((len(prompt) + len(resp), *prefill.shape[2:]), -1, dtype=torch.int16)
            r[: len(prompt)] = prefill[source, self.width - len(prompt):]
            known = min(max(len(resp) - 1, 0), steps.size(1))  # the last response token is never an input
            r[len(prompt): len(prompt) + known] = steps[i, :known]
            out.append(r)
        return out
