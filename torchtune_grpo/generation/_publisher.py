"""Trainer -> engine weights: :class:`WeightPublisher` sends every new version and checks it arrived.

An engine with its own copy of the weights (vLLM) must get the trainer's after every optimizer step. The
publisher streams them (gathered from FSDP2 one tensor at a time: no second full state dict), and every
``check.every_n_syncs`` versions scores a fixed probe sequence with the trainer and with the engine
(:class:`~torchtune_grpo.generation.WeightSyncCheck`): a stale or mis-converted engine stops the run instead of
silently sampling from other weights. The collective is passed in (``all_reduce_max``), so the publisher is
the same on one process and on N, and is the one place a future out-of-process engine plugs in.
"""

import time
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._engine import GenerationEngine
from torchtune_grpo.generation._weight_sync import WeightSyncCheck
from torchtune_grpo.logprobs import sequence_logprobs

__all__ = ["WeightPublisher", "full_weights"]


def full_weights(model: nn.Module, device: torch.device) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(torchtune name, full tensor)`` of every weight of ``model``, gathered from FSDP2 one at a time.

    A generator with collectives inside: every rank must consume it completely, in the same order.
    """
    for name, param in model.state_dict().items():
        if param.device != device:
            param = param.to(device)  # fsdp_cpu_offload: gather on the compute device
        if hasattr(param, "full_tensor"):  # a DTensor shard
            param = param.full_tensor()
        yield name, param.detach()


class WeightPublisher:
    """Loads the policy's weights into an engine that holds its own, and checks it samples from them.

    Args:
        engine (GenerationEngine): the engine (``holds_weights``: ``load_weights``, ``prompt_logprobs``).
        check (WeightSyncCheck): when and how closely to compare trainer and engine.
        probe_prompt (List[int]): token ids the probe starts from (the same on every rank and every check).
        device (torch.device): the training device.
        all_reduce_max (Callable[[float], float]): the maximum of a float over all ranks.
        chunk_size (int): positions per log-softmax chunk of the trainer's probe forward. Default is 512.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        check: WeightSyncCheck,
        probe_prompt: List[int],
        device: torch.device,
        all_reduce_max: Callable[[float], float],
        chunk_size: int = 512,
    ) -> None:
        self.engine = engine
        self.check = check
        self.probe_prompt = list(probe_prompt)
        self.device = device
        self.all_reduce_max = all_reduce_max
        self.chunk_size = int(chunk_size)
        self.versions_published = 0

    def publish(self, model: nn.Module, step: int) -> Dict[str, float]:
        """Send ``model``'s weights; when due, compare log-probabilities (every rank calls it).

        The largest difference over all ranks is logged as ``generation/sync_logprob_diff``, and every rank
        raises ``WeightSyncError`` when it exceeds the check's tolerance.

        Args:
            model (nn.Module): the policy (FSDP2-sharded or plain); left in eval mode after a check.
            step (int): optimizer steps the weights have taken (for messages).

        Returns:
            Dict[str, float]: ``time/weight_sync`` and, when checked, ``generation/sync_logprob_diff``.
        """
        t0 = time.perf_counter()
        self.engine.load_weights(full_weights(model, self.device))
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
            self.check.verify(diff, step=step)
            metrics["generation/sync_logprob_diff"] = diff
        self.versions_published += 1
        metrics["time/weight_sync"] = time.perf_counter() - t0
        return metrics
