"""The native generation engine: batched, KV-cached sampling with the trainer's own model (torchtune's modules, or
transformers' through :mod:`~torchtune_grpo.generation._hf_rollout`)."""

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from torchtune_grpo.models.attention import installable
from torchtune_grpo.generation._cache import attached_caches, attention_modules, KVCachePool
from torchtune_grpo.generation._rollout_caches import PerRowRollout, RolloutResources, SharedPrefixRollout
from torchtune_grpo.generation._engine import GenerationEngine
from torchtune_grpo.generation._output import Rollout
from torchtune_grpo.generation._compact import compacting_decode_loop
from torchtune_grpo.generation._decode import can_skip_module_hooks, to_rollout
from torchtune_grpo.generation._sampling import check_sampling, sample_tokens
from torchtune_grpo.generation._session import NativeSession, RowViews
from torchtune_grpo.generation._hf_rollout import sample_with_hf_cache
from torchtune_grpo.generation._hf_static import StaticDecode
from torchtune_grpo.generation._hf_session import HFSession, hf_session_unsupported
from torchtune_grpo.models import TransformersDecoder
from torchtune_grpo.models.logprobs import replace_unembed

__all__ = ["NativeGenerator", "can_skip_module_hooks"]  # the latter re-exported (tests)


class _LastPositionLogits:
    """``unembed`` replacement: final norm + output projection of the last position only, ``[N, V]`` fp32.

    One instance per model (kept by the engine), so a compiled decode step sees the same object every call.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # The prefill never needs [N, P, V]: only the last position is sampled from.
        return self.model.output(self.model.norm(h[:, -1])).float()


class NativeGenerator(GenerationEngine):
    """Sample ``group_size`` completions per prompt with the training model and a KV cache.

    All ``num_prompts x group_size`` rows decode together in one batch. Prompts are left-padded so every
    row's next token sits in the same cache slot; padded slots are masked out of attention and position
    ids skip them, so a row's samples do not depend on how long the other prompts are.

    Speed (docs/benchmarks/native_engine.md):

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
    - On CUDA the decode step (fixed shapes, see :mod:`~torchtune_grpo.generation._rollout_caches`) is compiled with
      ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); sampling stays eager and sync-free.

    A transformers policy (:class:`~torchtune_grpo.models.TransformersDecoder`) is decoded by the same loops and
    sampler on transformers' own cache (:mod:`~torchtune_grpo.generation._hf_rollout`): ``share_prefill``,
    ``compact_decode``, ``stop_check_interval``, ``reuse_cache`` and ``compile_decode`` apply (a compiled decode
    runs on a fixed-shape transformers cache, :mod:`~torchtune_grpo.generation._hf_static`, for families whose
    layers all have a key/value cache); the shared-prefix attention is the torchtune backend's. Its multi-turn
    sessions keep transformers' cache between turns for every family but linear attention
    (:mod:`~torchtune_grpo.generation._hf_session`).

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
        compact_decode (bool): rows that stopped leave the decode batch (their KV cache rows dropped at the
            stop checks), so decode cost follows the live rows (:mod:`~torchtune_grpo.generation._compact`;
            the same random draws, tokens equal up to last-bit effects of the batch size on matrix
            products). Eager decoding only: a compiled step keeps its fixed shapes. In a multi-turn
            session a later turn runs only the rows it continues (ended episodes leave), and rows whose
            turn stopped leave every turn's batch, their caches written back first (``_session.py``).
            Memory: a compaction copies the live rows' caches into new tensors while the engine's storage stays allocated (up to ~1.75x the KV cache
            during a rollout), and in the shared-prefix layout a group that lost some rows gives each live
            row its own copy of the prompt's keys/values (at most the per-row layout's size). Default is True.
    """

    takes_images = True  # a transformers policy with its image side (generate's images=)

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
        compact_decode: bool = True,
    ) -> None:
        check_sampling(temperature, top_k, top_p)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.stop_check_interval = max(1, stop_check_interval)
        self.share_prefill = share_prefill
        self.reuse_cache = reuse_cache
        self.compile_decode = compile_decode
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self.compact_decode = bool(compact_decode)
        self.cache = KVCachePool(cache_len_multiple)
        # A transformers policy's fixed-shape decode cache, kept between rollouts as the pool is (_hf_static.py).
        self.static_hf_caches = StaticDecode(cache_len_multiple)
        self._unembeds: Dict[int, _LastPositionLogits] = {}
        self._compiled: Dict[str, Callable[..., torch.Tensor]] = {}
        self._write_slots: Dict[str, torch.Tensor] = {}
        # The open multi-turn session, if any: it owns the cache pool until it is closed.
        self._session: Optional["NativeSession"] = None

    # A session (generation/_session.py) drives a rollout through the public steps below, one turn at a time:
    # unembed_for, new_rollout, first_turn, compacting_loop, decode_loop and session_closed.

    def unembed_for(self, model: nn.Module) -> _LastPositionLogits:
        """The last-position unembedding this engine uses for ``model`` (built once per model)."""
        fn = self._unembeds.get(id(model))
        if fn is None or fn.model is not model:
            fn = self._unembeds[id(model)] = _LastPositionLogits(model)
        return fn

    def compiles_decode(self, device: torch.device) -> bool:
        """Whether decode steps on ``device`` run compiled (``compile_decode``; None: on CUDA only)."""
        return self.compile_decode if self.compile_decode is not None else torch.device(device).type == "cuda"

    def compiled_step(self, device: torch.device, step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``step`` compiled by this engine's settings for ``device`` (once per step function), or ``step`` itself."""
        if not self.compiles_decode(device):
            return step
        mode = self.compile_mode
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        key = f"{step.__name__}:{self.compile_backend}:{mode}"
        if key not in self._compiled:
            self._compiled[key] = torch.compile(step, mode=mode, backend=self.compile_backend, dynamic=False)
        return self._compiled[key]

    def _write_slot(self, device: torch.device, *shape: int) -> torch.Tensor:
        # One per device and shape for the engine's lifetime: a CUDA graph records its address.
        key = f"{device}:{shape}"
        slot = self._write_slots.get(key)
        if slot is None:
            slot = self._write_slots[key] = torch.zeros(*shape, dtype=torch.long, device=device)
        return slot

    def release_cache(self) -> None:
        """Free the KV cache now (the next ``generate`` allocates a new one)."""
        self._check_no_open_session("release_cache")
        self.cache.release()
        self.static_hf_caches.release()

    def new_rollout(
        self,
        model: nn.Module,
        attns: List[nn.Module],
        prompts: List[List[int]],
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
    ) -> Union[SharedPrefixRollout, PerRowRollout]:
        """Left-pad the prompts and set up this rollout's KV cache, shared-prefix or per-row (see ``_rollout_caches.py``)."""
        # The caches hold what the attention layers compute in: their weights' dtype (bf16 under mixed
        # precision, whose fp32 master weights stay in the root module).
        param = next(attns[0].parameters()) if attns else next(model.parameters())
        device, dtype = param.device, param.dtype
        prompt_len = max(len(p) for p in prompts)
        # [B] left padding per prompt, [B, P] left-padded prompts.
        pad_b = torch.tensor([prompt_len - len(p) for p in prompts], dtype=torch.long)
        prompt = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            prompt[i, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        layout = [(a.num_kv_heads, a.head_dim) for a in attns]
        all_cached = all(installable(a) for a in attns)  # all run the engine's cached attention
        # The shared-prefix layout needs the engine's attention everywhere and fp32 scores (see
        # _prefix_attention.py); everything else decodes with a per-row cache.
        shared = self.share_prefill and all_cached and dtype == torch.float32
        layout_cls = SharedPrefixRollout if shared else PerRowRollout
        resources = RolloutResources(
            cache=self.cache,
            write_slot=self._write_slot(device, 1),
            compile_step=lambda step: self.compiled_step(device, step),
            share_prefill=self.share_prefill,
            row_write_slot=self._write_slot(device, len(prompts) * group_size, 1),
        )
        return layout_cls(
            resources, layout, prompt.to(device), pad_b.to(device), group_size, max_new_tokens, dtype, device,
            all_cached,
        )

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
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
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
            images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs
                (:class:`~torchtune_grpo.data.ImagePromptDataset`'s ``image_inputs``), for a transformers policy with
                its image side attached (:func:`~torchtune_grpo.models.attach_images`). Default is None.

        Returns:
            Rollout: ``B x G`` rows; row ``i`` belongs to prompt ``i // G``.

        Raises:
            RuntimeError: while a :meth:`session` of this engine is open (it holds the KV cache).
            ValueError: images for a policy without an image side.
        """
        self._check_no_open_session("generate")
        has_images = images is not None and any(i is not None for i in images)
        if has_images and getattr(model, "image_model", None) is None:
            raise ValueError("prompts with images: the policy has no image side (a transformers policy of a "
                             "multimodal directory, with attach_images)")
        temperature = self.temperature if temperature is None else temperature
        if isinstance(model, TransformersDecoder):
            # transformers' own module and KV cache (sliding windows, linear-attention state) on the live weights,
            # decoded by this engine's loops and sampler (_hf_rollout.py).
            try:
                return sample_with_hf_cache(
                    self, model.sampler(), prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                    pad_id=pad_id, stop_tokens=stop_tokens, generator=generator, temperature=float(temperature),
                    image_model=getattr(model, "image_model", None) if has_images else None,
                    images=images if has_images else None,
                )
            finally:
                if not self.reuse_cache:
                    self.static_hf_caches.release()
        # Inference mode, not just no_grad: no version counters or view tracking on the ~1,000 small ops
        # of each decode step (8-10% of a tiny model's rollout on CPU). Nothing it creates escapes: the
        # rollout is built after it, and a functional op there turns its tensors into normal ones.
        with torch.inference_mode(), replace_unembed(model, self.unembed_for(model)):
            attns = attention_modules(model)
            run = self.new_rollout(model, attns, prompts, group_size, max_new_tokens, pad_id)
            stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=run.prompt.device)
            try:
                out, done = self.first_turn(
                    model, attns, run, max_new_tokens, pad_id, stop, temperature, generator,
                    compact=self.compact_decode and not run.compiled,
                )
            finally:
                if not self.reuse_cache:
                    self.cache.release()
        return to_rollout([list(p) for p in prompts for _ in range(group_size)], out, done, stop)

    def session(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    ) -> Optional[Union["NativeSession", HFSession]]:
        """A multi-turn session that keeps each row's KV cache between turns (:class:`NativeSession`).

        For a transformers policy: an :class:`~torchtune_grpo.generation._hf_session.HFSession` where every layer's
        cache can keep a history with holes (full attention, sliding windows by position), None otherwise (linear
        attention: each turn re-sends the history).

        Args:
            model (nn.Module): the torchtune decoder (with FSDP2: unsharded for the session's whole length).
            prompts (List[List[int]]): B prompts.
            group_size (int): rows per prompt, G.
            max_new_tokens (int): each row's token budget after its prompt, over all turns (the cache is
                sized from it once).
            pad_id (int): padding id.
            stop_tokens (Sequence[int]): ids that end a turn.
            images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs, for a
                transformers policy with its image side: the first turn prefills with them. Default is None.

        Returns:
            Optional[Union[NativeSession, HFSession]]: call its ``generate`` once per turn; close it (or use it as a
            context manager).

        Raises:
            RuntimeError: while another session of this engine is open (one KV cache per engine).
            ValueError: images for a policy without an image side.
        """
        self._check_no_open_session("session")
        has_images = images is not None and any(i is not None for i in images)
        if has_images and getattr(model, "image_model", None) is None:
            raise ValueError("prompts with images: the policy has no image side (a transformers policy of a "
                             "multimodal directory, with attach_images)")
        if isinstance(model, TransformersDecoder):
            # transformers' cache kept between turns where its layers allow a history with holes (all but linear
            # attention); None otherwise: each turn re-sends the row's history to generate() (_hf_session.py).
            hf = model.sampler()
            if hf_session_unsupported(hf) is not None:
                return None
            return HFSession(self, hf, prompts, group_size, max_new_tokens, pad_id, stop_tokens,
                             image_model=model.image_model if has_images else None,
                             images=images if has_images else None)
        self._session = NativeSession(self, model, prompts, group_size, max_new_tokens, pad_id, stop_tokens)
        return self._session

    def session_closed(self, session: NativeSession) -> None:
        """Forget ``session`` if it is the open one: the engine may start another or generate again."""
        if self._session is session:
            self._session = None

    def _check_no_open_session(self, call: str) -> None:
        # Sessions and generate() share the engine's one KV cache pool: a second user would overwrite the
        # open session's keys and values, and its next turn would attend to the wrong tokens, silently.
        if self._session is not None:
            raise RuntimeError(
                f"{type(self).__name__}.{call}(): this engine has an open multi-turn session (it holds the KV "
                "cache between turns); close it first (session.close(), or use it in a `with` block)"
            )

    def first_turn(
        self,
        model: nn.Module,
        attns: List[nn.Module],
        run: Union[SharedPrefixRollout, PerRowRollout],
        max_new_tokens: int,
        pad_id: int,
        stop: torch.Tensor,
        temperature: float,
        generator: Optional[torch.Generator],
        compact: bool = False,
        views: Optional["RowViews"] = None,
    ) -> "tuple[torch.Tensor, torch.Tensor]":
        """Prefill the prompts and decode every row: ``out [N, steps]`` and whether each row stopped ``[N]``.

        With ``compact``, rows that stopped leave the decode batch (``_compact.py``): a one-shot rollout
        drops their caches; a session passes ``views`` (its rows' caches, kept as rows leave)."""
        with attached_caches(attns, run.prefill_caches):
            logits = run.prefill(model)  # [N, V]
        # The prefill ran through the model's own forward (FSDP's root hooks included); decode steps may
        # skip per-layer hooks once every parameter is gathered.
        direct = can_skip_module_hooks(model)

        def decoded() -> Union[SharedPrefixRollout, PerRowRollout]:  # a session's copy changes as rows leave
            return run if views is None else views.current

        def feed(token: torch.Tensor, t: int) -> torch.Tensor:
            return decoded().decode(model, token, t, direct)

        with attached_caches(attns, decoded().decode_caches):
            if compact or views is not None:
                return self.compacting_loop(
                    logits, feed, run.compact if views is None else views.compact, max_new_tokens, pad_id, stop,
                    temperature, generator,
                )
            return self.decode_loop(logits, feed, max_new_tokens, pad_id, stop, temperature, generator)

    def compacting_loop(
        self,
        logits: torch.Tensor,
        feed: Callable[[torch.Tensor, int], torch.Tensor],
        compact: Callable[[torch.Tensor], None],
        max_new_tokens: int,
        pad_id: int,
        stop: torch.Tensor,
        temperature: float,
        generator: Optional[torch.Generator],
        room: Optional[torch.Tensor] = None,
    ) -> "tuple[torch.Tensor, torch.Tensor]":
        """:func:`~torchtune_grpo.generation._compact.compacting_decode_loop` with this engine's settings."""
        return compacting_decode_loop(
            logits, feed, compact, max_new_tokens=max_new_tokens, pad_id=pad_id, stop=stop,
            temperature=temperature, top_k=self.top_k, top_p=self.top_p,
            stop_check_interval=self.stop_check_interval, generator=generator, room=room,
            # looked up at each call, so both loops sample through this module's sample_tokens
            sample=lambda logits, **kw: sample_tokens(logits, **kw),
        )

    def decode_loop(
        self,
        logits: torch.Tensor,
        feed: Callable[[torch.Tensor, int], torch.Tensor],
        max_new_tokens: int,
        pad_id: int,
        stop: torch.Tensor,
        temperature: float,
        generator: Optional[torch.Generator],
        rows: Optional[torch.Tensor] = None,
        room: Optional[torch.Tensor] = None,
    ) -> "tuple[torch.Tensor, torch.Tensor]":
        """Sample, feed the tokens back (``feed(token [N], t) -> logits [N, V]``), until every row is done.

        Args:
            logits (torch.Tensor): ``[N, V]`` the first token's logits.
            rows (Optional[torch.Tensor]): ``[n]`` the rows to sample (the others are fed ``pad_id``);
                None: all. Default is None.
            room (Optional[torch.Tensor]): ``[n]`` tokens each sampled row may still take; None: no limit
                but ``max_new_tokens``. Default is None.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: ``out [n, steps]`` and ``stopped [n]`` (a stop token came).
        """
        n = logits.size(0) if rows is None else rows.numel()
        out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=logits.device)
        stopped = torch.zeros(n, dtype=torch.bool, device=logits.device)
        done = stopped.clone()
        padded = None if rows is None else torch.full((logits.size(0),), pad_id, dtype=torch.long, device=logits.device)
        steps = 0
        for t in range(max_new_tokens):
            token = sample_tokens(
                logits if rows is None else logits.index_select(0, rows), temperature=temperature,
                top_k=self.top_k, top_p=self.top_p, generator=generator,
            )
            token = token.masked_fill(done, pad_id)
            out[:, t] = token
            stopped |= torch.isin(token, stop) & ~done  # a pad that is also a stop token stops nothing
            done = stopped if room is None else stopped | (room <= t + 1)
            steps = t + 1
            if steps == max_new_tokens:
                break
            if steps % self.stop_check_interval == 0 and bool(done.all()):
                break
            logits = feed(token if rows is None else padded.index_copy(0, rows, token), t)
        return out[:, :steps], stopped
