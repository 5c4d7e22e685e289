"""Trainer -> engine weights: :class:`WeightPublisher` sends every new version and checks it arrived.

An engine with its own copy of the weights (vLLM) must get the trainer's after every optimizer step. The
publisher streams them (gathered from FSDP2 one tensor at a time: no second full state dict), and every
``check.every_n_syncs`` versions scores a fixed probe sequence with the trainer and with the engine
(:class:`~torchtune_grpo.generation.WeightSyncCheck`): a stale or mis-converted engine stops the run instead of
silently sampling from other weights. The collective is passed in (``all_reduce_max``), so the publisher is
the same on one process and on N, and is the one place a future out-of-process engine plugs in.

A LoRA policy (docs/lora.md) sends what the engine's ``lora_sync`` asks for (``adapter``: the base weights
once, then only the adapter, as a new adapter version; ``merge``: full weights with the adapter merged in;
torchtune_grpo/generation/_lora_sync.py). The probe is scored by the trainer's model as it is (adapters on,
NF4 base for QLoRA), so the check covers the adapter path too.
"""

import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._engine import GenerationEngine
from torchtune_grpo.generation._lora_sync import (
    adapter_weights,
    base_weights,
    lora_model,
    LORA_SYNC_MODES,
    merged_weights,
)
from torchtune_grpo.generation._weight_sync import WeightSyncCheck
from torchtune_grpo.models import image_state_dict
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.runtime.sharding import gather_full_tensor

__all__ = ["WeightPublisher", "full_weights", "on_disk_vision_names"]


def full_weights(
    model: nn.Module, device: torch.device, names: Optional[Set[str]] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(torchtune name, full tensor)`` of every weight of ``model`` (or of those in ``names``), gathered from
    FSDP2 one at a time.

    A generator with collectives inside: every rank must consume it completely, in the same order (and
    pass the same ``names``).
    """
    for name, param in model.state_dict().items():
        if names is not None and name not in names:
            continue
        yield name, gather_full_tensor(param, device).detach()  # fsdp_cpu_offload: gathered on the compute device


def on_disk_vision_names(model: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]]
                         ) -> Iterator[Tuple[str, torch.Tensor]]:
    """``weights`` with trained vision tensors (``train_vision``: ``trained_vision.*``) under their checkpoint names,
    as :func:`~torchtune_grpo.models.image_state_dict` saves them: an engine that loads the image-text directory
    (vLLM) knows them by those names. Everything else passes unchanged."""
    for name, tensor in weights:
        yield next(iter(image_state_dict(model, {name: tensor}).items()))


class WeightPublisher:
    """Loads the policy's weights into an engine that holds its own, and checks it samples from them.

    Args:
        engine (GenerationEngine): the engine (``holds_weights``: ``load_weights``, ``prompt_logprobs``).
        check (WeightSyncCheck): when and how closely to compare trainer and engine.
        probe_prompt (List[int]): token ids the probe starts from (the same on every rank and every check).
        device (torch.device): the training device.
        all_reduce_max (Callable[[float], float]): the maximum of a float over all ranks.
        chunk_size (int): positions per log-softmax chunk of the trainer's probe forward. Default is 512.
        trainer_dtype (Optional[torch.dtype]): what the trainer computes in. An engine whose ``dtype`` is
            unset follows it (``follow_trainer_dtype``), NF4 base weights are dequantised to it, and a
            failed check names both dtypes when they differ. Default is None (unknown: fp32 for NF4).
    """

    def __init__(
        self,
        engine: GenerationEngine,
        check: WeightSyncCheck,
        probe_prompt: List[int],
        device: torch.device,
        all_reduce_max: Callable[[float], float],
        chunk_size: int = 512,
        trainer_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.engine = engine
        self.check = check
        self.probe_prompt = list(probe_prompt)
        self.device = device
        self.all_reduce_max = all_reduce_max
        self.chunk_size = int(chunk_size)
        self.versions_published = 0
        self.trainer_dtype = trainer_dtype
        follow = getattr(engine, "follow_trainer_dtype", None)
        if follow is not None and trainer_dtype is not None:
            follow(trainer_dtype)  # before the engine starts (it starts at the first publish)
        self._lora_mode: Optional[str] = None  # "adapter" | "merge" for a LoRA policy, set at the first publish
        self._lora_scale = 1.0
        self._lora = None  # the policy's LoRAHyperparams (adapter mode)

    def publish(self, model: nn.Module, step: int) -> Dict[str, float]:
        """Send ``model``'s weights; when due, compare log-probabilities (every rank calls it).

        The largest difference over all ranks is logged as ``generation/sync_logprob_diff``, and every rank
        raises ``WeightSyncError`` when it exceeds the check's tolerance.

        Args:
            model (nn.Module): the policy (FSDP2-sharded or plain); left in eval mode after a check.
            step (int): optimizer steps the weights have taken (for messages).

        Returns:
            Dict[str, float]: ``time/weight_sync``, ``generation/sync_bytes`` (what was sent: every weight,
            or the adapter alone) and, when checked, ``generation/sync_logprob_diff``.
        """
        t0 = time.perf_counter()
        if self.versions_published == 0:
            self._start(model)
        sent = self._send(model, first=self.versions_published == 0)
        metrics = {}
        if self.check.due(self.versions_published):
            probe = self.check.probe(self.engine.vocab_size, prompt=self.probe_prompt)
            model.eval()
            with torch.no_grad():
                trainer = sequence_logprobs(
                    model, torch.tensor([probe], device=self.device), chunk_size=self.chunk_size
                ).logprobs[0]
            diff = self.check.measure(trainer, self.engine.prompt_logprobs(probe))
            # NaN -> +inf first: gloo's MAX can drop a NaN, and a broken rank must stop every rank.
            diff = self.all_reduce_max(self.check.reducible(diff))
            self.check.verify(
                diff, step=step, trainer_dtype=self.trainer_dtype,
                engine_dtype=getattr(self.engine, "compute_dtype", None),
            )
            metrics["generation/sync_logprob_diff"] = diff
        self.versions_published += 1
        metrics["time/weight_sync"] = time.perf_counter() - t0
        metrics["generation/sync_bytes"] = float(sent)
        return metrics

    def describe(self, model: nn.Module) -> str:
        """What every sync sends and how it is checked, for the algorithm card."""
        lora = lora_model(model)
        dtype = str(self.trainer_dtype or torch.float32).removeprefix("torch.")
        if lora is None:
            what = "its own copy, every weight sent after every optimizer step"
        elif getattr(self.engine, "lora_sync", "merge") == "adapter":
            what = (
                f"its own copy of the base weights (sent once) plus the LoRA adapter (rank {lora.rank}, alpha "
                f"{lora.alpha:g}), sent alone after every optimizer step as a new adapter version "
                "(lora_sync: adapter)"
            )
        else:
            what = (
                "its own copy, sent after every optimizer step with the LoRA adapter merged: W + (alpha / r) B A "
                f"computed in fp32 and cast to {dtype} once (lora_sync: merge)"
            )
        check = self.check
        checked = (
            "never checked" if check.every_n_syncs == 0
            else f"checked after every {check.every_n_syncs} sync(s) against the trainer's log-probabilities "
            f"(tolerance {check.tolerance:g})"
        )
        return f"{what}; {checked}"

    # ------------------------------------------------------------------------------------------ LoRA

    def _start(self, model: nn.Module) -> None:
        """Decide, from the model and the engine, what every sync sends (before the engine starts)."""
        lora = lora_model(model)
        if lora is None:
            return
        mode = getattr(self.engine, "lora_sync", "merge")
        if mode not in LORA_SYNC_MODES:
            raise ValueError(f"generation.lora_sync must be one of {list(LORA_SYNC_MODES)}, got {mode!r}")
        if mode == "adapter":
            if not hasattr(self.engine, "load_adapter"):
                raise ValueError(
                    f"generation.lora_sync: adapter needs an engine that loads adapters (load_adapter); "
                    f"{type(self.engine).__name__} has none: use lora_sync: merge"
                )
            self.engine.enable_lora(lora)  # before the engine starts: vLLM sizes its adapter slots then
        self._lora_mode, self._lora_scale = mode, lora.alpha / lora.rank
        self._lora = lora

    def _send(self, model: nn.Module, *, first: bool) -> int:
        """Load this version into the engine; the bytes sent (what crossed from trainer to engine)."""
        dtype = self.trainer_dtype or torch.float32
        if self._lora_mode is None:
            return self._load(on_disk_vision_names(model, full_weights(model, self.device)))
        if self._lora_mode == "merge":
            return self._load(merged_weights(model, self.device, dtype, self._lora_scale))
        sent = self._load(base_weights(model, self.device, dtype)) if first else 0  # the frozen base: once
        adapter = adapter_weights(model, self.device)
        self.engine.load_adapter(adapter, self._lora, version=self.versions_published)
        return sent + sum(t.numel() * t.element_size() for t in adapter.values())

    def _load(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        sent = 0

        def counted():
            nonlocal sent
            for name, tensor in weights:
                sent += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.engine.load_weights(counted())
        return sent
