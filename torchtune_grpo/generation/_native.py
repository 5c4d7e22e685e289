"""The native generation engine: batched, KV-cached sampling with the torchtune model itself."""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.generation._cache import (
    attached_caches,
    attention_modules,
    CacheState,
    KVCachePool,
    SlotKVCache,
    takes_cached_forward,
)
from torchtune_grpo.generation._prefix_attention import (
    lean_decode_eligible,
    lean_decode_layer,
    PrefixDecodeMask,
    SharedPrefixKVCache,
)
from torchtune_grpo.generation._rollout import Rollout
from torchtune_grpo.generation._sampling import sample_tokens
from torchtune_grpo.logprobs import replace_unembed

__all__ = ["NativeGenerator", "can_skip_module_hooks", "decode_step", "prefix_decode_step"]


class _LastPositionLogits:
    """``unembed`` replacement: final norm + output projection of the last position only, ``[N, V]`` fp32.

    One instance per model (kept by the engine), so a compiled decode step sees the same object every call.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # The prefill never needs [N, P, V]: only the last position is sampled from.
        return self.model.output(self.model.norm(h[:, -1])).float()


def _only_fsdp_hooks(module: nn.Module) -> bool:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(type(getattr(h, "__self__", None)).__name__ == "FSDPState" for h in hooks)


def can_skip_module_hooks(model: nn.Module) -> bool:
    """Whether a decode step may call the decoder's layers directly, skipping their forward hooks.

    True for a torchtune ``TransformerDecoder`` whose parameters are all plain (unsharded) tensors and whose
    layers carry no forward hooks but FSDP2's. FSDP2's per-layer hooks only gather and free parameters;
    with every parameter already gathered for the whole rollout they do nothing but cost time, and under
    ``torch.compile`` they would split the decode step into one graph per layer.
    """
    if not isinstance(model, TransformerDecoder) or model.output_hidden_states:
        return False
    if any(type(p) not in (torch.Tensor, nn.Parameter) for p in model.parameters()):
        return False  # e.g. sharded DTensors: FSDP must gather them in its hooks
    return _only_fsdp_hooks(model) and all(_only_fsdp_hooks(layer) for layer in model.layers)


def _additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep``, ``-inf`` elsewhere, in ``dtype``: what SDPA turns a boolean mask into."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def decode_step(
    model: nn.Module,
    token: torch.Tensor,
    pos: torch.Tensor,
    pad: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    write_slot: torch.Tensor,
    direct: bool = False,
    mask_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """One decode step with fixed shapes and no host synchronisation (what CUDA graphs capture).

    The model must have the engine's caches attached and its ``unembed`` replaced by last-position logits.

    Args:
        model (nn.Module): the torchtune decoder.
        token (torch.Tensor): ``[N]`` the tokens just sampled.
        pos (torch.Tensor): 0-d long: the cache slot ``token`` goes to.
        pad (torch.Tensor): ``[N]`` long: left-padding slots of each row.
        valid (torch.Tensor): ``[N, W]`` bool: slots that hold a real (non-pad) token, over the window.
        slot_ids (torch.Tensor): ``[W]`` ``arange(W)``.
        write_slot (torch.Tensor): ``[1]`` long: the caches' write position (a static buffer, set here).
        direct (bool): run the decoder's layers without module hooks (see :func:`can_skip_module_hooks`).
            Default is False.
        mask_dtype (Optional[torch.dtype]): give attention an additive mask of this dtype (0 where a slot
            is seen, ``-inf`` where not), built once per step, instead of a boolean one: the same numbers
            (SDPA turns a boolean mask into exactly this), but on CPU SDPA otherwise converts the boolean
            mask again in every layer, which costs more than the attention itself at small widths.
            Default is None (boolean).

    Returns:
        torch.Tensor: ``[N, V]`` float32 next-token logits.
    """
    write_slot.copy_(pos.view(1))
    mask = (valid & (slot_ids <= pos)).unsqueeze(1)  # [N, 1, W]: real tokens up to and including pos
    if mask_dtype is not None:
        mask = _additive_mask(mask, mask_dtype)
    input_pos = (pos - pad).unsqueeze(1)  # [N, 1]: position ids skip the padding
    return _run_decoder(model, token, mask, input_pos, direct)


def prefix_decode_step(
    model: nn.Module,
    token: torch.Tensor,
    step: torch.Tensor,
    lengths: torch.Tensor,
    prefix_mask: torch.Tensor,
    write_slot: torch.Tensor,
    completion_slots: Optional[torch.Tensor] = None,
    direct: bool = False,
    lean: bool = False,
) -> torch.Tensor:
    """:func:`decode_step` for the shared-prefix cache layout (:class:`SharedPrefixKVCache` attached).

    Args:
        model (nn.Module): the torchtune decoder.
        token (torch.Tensor): ``[N]`` the tokens just sampled.
        step (torch.Tensor): 0-d long: the completion slot ``token`` goes to (0 for the first token).
        lengths (torch.Tensor): ``[N]`` long: each row's prompt length (its position ids continue there).
        prefix_mask (torch.Tensor): ``[B, 1, 1, Pw]`` additive mask of the prompt slots.
        write_slot (torch.Tensor): ``[1]`` long: the caches' write position (a static buffer, set here).
        completion_slots (Optional[torch.Tensor]): ``[Wc]`` ``arange(Wc)`` for a fixed completion window
            (compiled steps; slots after ``step`` are masked), or None when the caches' window is exactly
            ``step + 1`` slots. Default is None.
        direct (bool): run the decoder's layers without module hooks. Default is False.
        lean (bool): with ``direct``, run each layer as :func:`lean_decode_layer` (see
            :func:`lean_decode_eligible`). Default is False.

    Returns:
        torch.Tensor: ``[N, V]`` float32 next-token logits.
    """
    write_slot.copy_(step.view(1))
    completion = None
    if completion_slots is not None:
        completion = _additive_mask(completion_slots <= step, prefix_mask.dtype).view(1, 1, 1, -1)
    mask = PrefixDecodeMask(prefix_mask, completion)
    input_pos = (lengths + step).unsqueeze(1)
    if not (direct and lean):
        return _run_decoder(model, token, mask, input_pos, direct)
    h = model.tok_embeddings.forward(token.unsqueeze(1))
    for layer in model.layers:
        h = lean_decode_layer(layer, h, mask, input_pos)
    return model.unembed(h)


def _run_decoder(
    model: nn.Module, token: torch.Tensor, mask: object, input_pos: torch.Tensor, direct: bool
) -> torch.Tensor:
    if not direct:
        return model(token.unsqueeze(1), mask=mask, input_pos=input_pos)
    # TransformerDecoder.forward without hooks: embeddings, layers, (replaced) unembed.
    h = model.tok_embeddings(token.unsqueeze(1))
    for layer in model.layers:
        h = layer.forward(h, mask=mask, input_pos=input_pos)
    return model.unembed(h)


class NativeGenerator:
    """Sample ``group_size`` completions per prompt with the training model and a KV cache.

    All ``num_prompts x group_size`` rows decode together in one batch. Prompts are left-padded so every
    row's next token sits in the same cache slot; padded slots are masked out of attention and position
    ids skip them, so a row's samples do not depend on how long the other prompts are.

    Speed (docs/benchmarks.md):

    - The KV cache is allocated once and reused across rollouts while the batch size, dtype and device
      stay the same and the sequence fits (it grows in steps of ``cache_len_multiple`` slots otherwise).
      It is attached to the model only during ``generate``: training forwards never see it.
    - Each prompt is prefilled once (``[B, P]``, not ``[B x G, P]``). With a float32 cache its keys and
      values are then kept once per group and every decode step reads them once per group
      (:mod:`~torchtune_grpo.generation._prefix_attention`); otherwise they are copied to the other
      ``G - 1`` rows of the group.
    - Decoding runs under ``torch.inference_mode`` with little Python around each operation
      (:func:`~torchtune_grpo.generation._prefix_attention.lean_decode_layer`).
    - No device-to-host synchronisation per token: the loop checks whether every row has stopped once
      every ``stop_check_interval`` tokens.
    - On CUDA the decode step (fixed shapes, see :func:`decode_step`) is compiled with
      ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); sampling stays eager and sync-free.

    Args:
        temperature (float): sampling temperature; 0 is greedy. Default is 1.0.
        top_k (Optional[int]): sample only among the ``top_k`` most likely tokens. Default is None.
        top_p (float): nucleus sampling mass. Default is 1.0 (off).
        stop_check_interval (int): check whether every row has stopped once every this many tokens:
            each check is a device-to-host sync. Default is 8.
        share_prefill (bool): prefill each prompt once and share its cache with its group (stored once
            for a float32 cache, copied to each row otherwise); False prefills and caches every row (the
            result is the same up to floating-point effects). Default is True.
        reuse_cache (bool): keep the KV cache between calls (it then also occupies memory during the
            training part of a step: ``2 x layers x h_kv x head_dim`` elements per slot, ``B x P + B x G
            x T`` slots shared, ``B x G x (P + T)`` per row); False
            frees it after each rollout (one allocation per rollout; with a compiled decode step, also
            new CUDA graphs). Default is True.
        cache_len_multiple (int): the cache length is rounded up to a multiple of this. Default is 64.
        compile_decode (Optional[bool]): compile the decode step; None compiles on CUDA only.
            Default is None.
        compile_mode (Optional[str]): ``torch.compile`` mode; None uses ``"reduce-overhead"`` (CUDA
            graphs) on CUDA and the default mode elsewhere. Default is None.
        compile_backend (str): ``torch.compile`` backend. Default is ``"inductor"``.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: float = 1.0,
        stop_check_interval: int = 8,
        share_prefill: bool = True,
        reuse_cache: bool = True,
        cache_len_multiple: int = 64,
        compile_decode: Optional[bool] = None,
        compile_mode: Optional[str] = None,
        compile_backend: str = "inductor",
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be positive or null, got {top_k}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.stop_check_interval = max(1, stop_check_interval)
        self.share_prefill = share_prefill
        self.reuse_cache = reuse_cache
        self.compile_decode = compile_decode
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self.cache = KVCachePool(cache_len_multiple)
        self._unembeds: Dict[int, _LastPositionLogits] = {}
        self._compiled: Dict[str, Callable[..., torch.Tensor]] = {}
        self._write_slots: Dict[str, torch.Tensor] = {}

    def _unembed_for(self, model: nn.Module) -> _LastPositionLogits:
        fn = self._unembeds.get(id(model))
        if fn is None or fn.model is not model:
            fn = self._unembeds[id(model)] = _LastPositionLogits(model)
        return fn

    def compiles_decode(self, device: torch.device) -> bool:
        """Whether decode steps on ``device`` run compiled (``compile_decode``; None: on CUDA only)."""
        return self.compile_decode if self.compile_decode is not None else torch.device(device).type == "cuda"

    def _decode_fn(self, device: torch.device, step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if not self.compiles_decode(device):
            return step
        mode = self.compile_mode
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        key = f"{step.__name__}:{self.compile_backend}:{mode}"
        if key not in self._compiled:
            self._compiled[key] = torch.compile(step, mode=mode, backend=self.compile_backend, dynamic=False)
        return self._compiled[key]

    def _write_slot(self, device: torch.device) -> torch.Tensor:
        # One per device for the engine's lifetime: a CUDA graph records its address.
        slot = self._write_slots.get(str(device))
        if slot is None:
            slot = self._write_slots[str(device)] = torch.zeros(1, dtype=torch.long, device=device)
        return slot

    def release_cache(self) -> None:
        """Free the KV cache now (the next ``generate`` allocates a new one)."""
        self.cache.release()

    def generate(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
    ) -> Rollout:
        """Generate completions.

        Args:
            model (nn.Module): a torchtune decoder; with FSDP2 its parameters should already be unsharded
                (the recipe does this once per rollout, not once per token).
            prompts (List[List[int]]): B prompts as token ids.
            group_size (int): samples per prompt, G.
            max_new_tokens (int): response budget in tokens.
            pad_id (int): padding id.
            stop_tokens (Sequence[int]): ids that end a response (kept as its last token).
            generator (Optional[torch.Generator]): RNG on the model's device. Default is None.
            temperature (Optional[float]): override this engine's temperature (0 for greedy
                evaluation). Default is None.

        Returns:
            Rollout: ``B x G`` rows; row ``i`` belongs to prompt ``i // G``.
        """
        # Inference mode, not just no_grad: no version counters or view tracking on the ~1,000 small ops
        # of each decode step (8-10% of a tiny model's rollout on CPU). Nothing it creates escapes: the
        # rollout is built outside, and a functional op there turns its tensors into normal ones.
        with torch.inference_mode():
            out, done, stop = self._sample(
                model, prompts, group_size, max_new_tokens, pad_id, stop_tokens, generator, temperature
            )
        return _to_rollout(prompts, group_size, out, done, stop)

    def _sample(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        generator: Optional[torch.Generator],
        temperature: Optional[float],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token loop of :meth:`generate`: ``[N, steps]`` tokens, ``[N]`` done flags, the stop ids."""
        temperature = self.temperature if temperature is None else temperature
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        n = len(prompts) * group_size
        prompt_len = max(len(p) for p in prompts)
        # [B] left padding per prompt, [B, P] left-padded prompts.
        pad_b = torch.tensor([prompt_len - len(p) for p in prompts], dtype=torch.long)
        prompt = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            prompt[i, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt, pad_b = prompt.to(device), pad_b.to(device)

        attns = attention_modules(model)
        layout = [(a.num_kv_heads, a.head_dim) for a in attns]
        all_cached = all(takes_cached_forward(a) for a in attns)
        # The shared-prefix layout needs the engine's attention everywhere and fp32 scores (see
        # _prefix_attention.py); everything else decodes with a per-row cache.
        shared = self.share_prefill and all_cached and dtype == torch.float32
        rollout = _SharedPrefixRollout if shared else _PerRowRollout
        run = rollout(self, layout, prompt, pad_b, group_size, max_new_tokens, dtype, device, all_cached)

        stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
        out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        steps = 0
        try:
            with replace_unembed(model, self._unembed_for(model)):
                with attached_caches(attns, run.prefill_caches):
                    logits = run.prefill(model)  # [N, V]
                # The prefill ran through the model's own forward (FSDP's root hooks included); decode
                # steps may skip per-layer hooks once every parameter is gathered.
                direct = can_skip_module_hooks(model)
                with attached_caches(attns, run.decode_caches):
                    for t in range(max_new_tokens):
                        token = sample_tokens(
                            logits,
                            temperature=temperature,
                            top_k=self.top_k,
                            top_p=self.top_p,
                            generator=generator,
                        )
                        token = token.masked_fill(done, pad_id)
                        out[:, t] = token
                        done |= torch.isin(token, stop)
                        steps = t + 1
                        if steps == max_new_tokens:
                            break
                        if steps % self.stop_check_interval == 0 and bool(done.all()):
                            break
                        logits = run.decode(model, token, t, direct)
        finally:
            if not self.reuse_cache:
                self.cache.release()

        return out[:, :steps], done, stop


class _SharedPrefixRollout:
    """One rollout in the shared-prefix layout (:mod:`~torchtune_grpo.generation._prefix_attention`).

    The prefill runs the ``B`` prompts once, writing the prompt part of the cache; the decode steps write
    and read each row's completion part and read the prompt part once per group. Eagerly the completion
    window is exactly the slots written so far (no mask); a compiled step has fixed windows (rounded up
    to ``cache_len_multiple``) and masks the rest.
    """

    def __init__(
        self, engine, layout, prompt, pad_b, group_size, max_new_tokens, dtype, device, all_cached
    ) -> None:
        b, prompt_len = prompt.shape
        self.group_size = group_size
        self.decode_fn = engine._decode_fn(device, prefix_decode_step)
        self.compiled = self.decode_fn is not prefix_decode_step
        mult = engine.cache.len_multiple
        # A compiled step is specialised on its windows: round them up to bound the number of graphs.
        p_window = -(-prompt_len // mult) * mult if self.compiled else prompt_len
        c_window = -(-max_new_tokens // mult) * mult if self.compiled else max_new_tokens
        (pk, pv), (ck, cv) = engine.cache.get(
            layout, [(b, p_window), (b * group_size, c_window)], dtype, device
        )
        if self.compiled:
            # The fixed windows read slots this rollout has not written: they are masked, but zero them
            # so that a non-finite leftover of an earlier rollout cannot leak through (0 x inf = nan).
            for c in (*pk, *pv):
                c[:, :, prompt_len:p_window].zero_()
            for c in (*ck, *cv):
                c[:, :, :c_window].zero_()
        slots = torch.arange(p_window, device=device)
        real = (slots[None, :] >= pad_b[:, None]) & (slots[None, :] < prompt_len)  # [B, Pw]
        self.prefix_mask = _additive_mask(real, dtype)[:, None, None, :]  # [B, 1, 1, Pw]
        # Prefill: [B, P] causal over real tokens; a padded query row sees itself (no NaN softmax).
        p_slots = slots[:prompt_len]
        causal = p_slots[:, None] >= p_slots[None, :]
        self.prefill_mask = (causal[None] & real[:, None, :prompt_len]) | torch.eye(
            prompt_len, dtype=torch.bool, device=device
        )
        self.prefill_pos = (p_slots[None, :] - pad_b[:, None]).clamp(min=0)  # [B, P]
        self.prompt = prompt
        prefill_state = CacheState(slots=p_slots, window=prompt_len)
        self.prefill_caches = [SlotKVCache(k, v, prefill_state) for k, v in zip(pk, pv)]
        self.write_slot = engine._write_slot(device)
        self.state = CacheState(slots=self.write_slot, window=c_window)
        self.decode_caches = [
            SharedPrefixKVCache(pk_i, pv_i, ck_i, cv_i, self.state, p_window)
            for pk_i, pv_i, ck_i, cv_i in zip(pk, pv, ck, cv)
        ]
        self.lengths = (prompt_len - pad_b).repeat_interleave(group_size)  # [N] each row's prompt length
        self.completion_slots = torch.arange(c_window, device=device) if self.compiled else None
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.lean: Optional[bool] = None  # decided at the first decode step (needs `direct`)
        if self.compiled:
            for t in (*pk, *pv, *ck, *cv, self.write_slot):
                torch._dynamo.mark_static_address(t)

    def prefill(self, model: nn.Module) -> torch.Tensor:
        logits = model(self.prompt, mask=self.prefill_mask, input_pos=self.prefill_pos)  # [B, V]
        return logits.repeat_interleave(self.group_size, dim=0)

    def decode(self, model: nn.Module, token: torch.Tensor, t: int, direct: bool) -> torch.Tensor:
        if self.lean is None:
            self.lean = direct and lean_decode_eligible(model.layers)
        self.step.fill_(t)
        if not self.compiled:
            self.state.window = t + 1  # exactly the completion slots written, this token's included
            return prefix_decode_step(
                model, token, self.step, self.lengths, self.prefix_mask, self.write_slot, None, direct,
                self.lean,
            )
        torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, self.step, self.lengths, self.prefix_mask, self.write_slot,
            self.completion_slots, direct, self.lean,
        )
        return logits.clone()  # a CUDA graph's output is overwritten by the next replay


class _PerRowRollout:
    """One rollout in the per-row layout: every row's cache holds its own copy of the prompt.

    Used for half-precision caches, attention modules that keep their own forward, and
    ``share_prefill: false``. The prefill runs each prompt once and copies its cache to the group's rows
    (or, with ``share_prefill: false``, runs every row).
    """

    def __init__(
        self, engine, layout, prompt, pad_b, group_size, max_new_tokens, dtype, device, all_cached
    ) -> None:
        b, prompt_len = prompt.shape
        g = group_size
        self.decode_fn = engine._decode_fn(device, decode_step)
        self.compiled = self.decode_fn is not decode_step
        # The attention window: every slot this rollout writes. A compiled step is specialised on it, so
        # round it up to bound the number of distinct graphs.
        window = prompt_len + max_new_tokens
        if self.compiled:
            window = -(-window // engine.cache.len_multiple) * engine.cache.len_multiple
        slot_ids = torch.arange(window, device=device)
        valid_b = slot_ids[None, :] >= pad_b[:, None]  # [B, W]
        self.pad = pad_b.repeat_interleave(g)  # [N]
        self.valid = valid_b.repeat_interleave(g, dim=0)  # [N, W]
        self.slot_ids = slot_ids
        # Prefill rows: one per prompt (its cache is then copied to the group), or every row.
        self.share = engine.share_prefill and g > 1
        p_pad = pad_b if self.share else self.pad
        p_valid = valid_b if self.share else self.valid
        self.prompt = prompt if self.share else prompt.repeat_interleave(g, dim=0)
        p_slots = slot_ids[:prompt_len]
        self.prefill_pos = (p_slots[None, :] - p_pad[:, None]).clamp(min=0)  # [rows, P]
        causal = p_slots[:, None] >= slot_ids[None, :]  # [P, W]
        # A padded query row would attend to nothing (NaN softmax): let it see itself.
        self.prefill_mask = (causal[None] & p_valid[:, None, :]) | (p_slots[:, None] == slot_ids[None, :])
        ((ks, vs),) = engine.cache.get(layout, [(b * g, window)], dtype, device)
        self.ks, self.vs, self.num_prompts, self.group_size, self.prompt_len = ks, vs, b, g, prompt_len
        state = CacheState(slots=p_slots, window=window)
        if self.share:
            # Rows 0, G, 2G, ...: a strided view, so the prefill writes straight into the big cache.
            self.prefill_caches = [SlotKVCache(k[::g], v[::g], state) for k, v in zip(ks, vs)]
        else:
            self.prefill_caches = [SlotKVCache(k, v, state) for k, v in zip(ks, vs)]
        self.write_slot = engine._write_slot(device)
        decode_state = CacheState(slots=self.write_slot, window=window)
        self.decode_caches = [SlotKVCache(k, v, decode_state) for k, v in zip(ks, vs)]
        for k, v in zip(ks, vs):
            # Stale slots past the prompt are masked until written; zero them anyway so a non-finite
            # leftover can never leak through a 0-weight (0 x inf = nan).
            k[:, :, prompt_len:window].zero_()
            v[:, :, prompt_len:window].zero_()
        if self.compiled:
            for t in (*ks, *vs, self.write_slot):
                torch._dynamo.mark_static_address(t)
        self.pos = torch.tensor(prompt_len, dtype=torch.long, device=device)  # slot of the next token
        # Additive float masks when every attention runs the engine's cached forward; other attention
        # modules keep the boolean mask torchtune documents.
        self.mask_dtype = dtype if all_cached else None

    def prefill(self, model: nn.Module) -> torch.Tensor:
        logits = model(self.prompt, mask=self.prefill_mask, input_pos=self.prefill_pos)  # [rows, V]
        if self.share:
            p, g = self.prompt_len, self.group_size
            for k, v in zip(self.ks, self.vs):
                for c in (k, v):
                    grouped = c.view(self.num_prompts, g, *c.shape[1:])
                    grouped[:, 1:, :, :p].copy_(grouped[:, :1, :, :p])
            logits = logits.repeat_interleave(g, dim=0)  # [N, V]
        return logits

    def decode(self, model: nn.Module, token: torch.Tensor, t: int, direct: bool) -> torch.Tensor:
        self.pos.fill_(self.prompt_len + t)
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, self.pos, self.pad, self.valid, self.slot_ids, self.write_slot, direct, self.mask_dtype
        )
        return logits.clone() if self.compiled else logits  # a CUDA graph's output is overwritten next replay


def _to_rollout(
    prompts: List[List[int]],
    group_size: int,
    out: torch.Tensor,
    done: torch.Tensor,
    stop: torch.Tensor,
) -> Rollout:
    """Cut each row after its first stop token. ``out`` is ``[N, steps]``."""
    n, steps = out.shape
    is_stop = torch.isin(out, stop)
    # Length = index of the first stop token + 1, or every step when none came.
    first_stop = torch.where(
        is_stop.any(-1), is_stop.int().argmax(-1) + 1, torch.full_like(done, steps, dtype=torch.long)
    )
    rows = out.cpu().tolist()
    lengths = first_stop.cpu().tolist()
    response_ids = [row[:length] for row, length in zip(rows, lengths)]
    prompt_ids = [list(p) for p in prompts for _ in range(group_size)]
    return Rollout(prompt_ids=prompt_ids, response_ids=response_ids, truncated=~done.cpu())
