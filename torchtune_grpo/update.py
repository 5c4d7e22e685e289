"""The policy update: one step's experience in, optimizer steps and loss statistics out.

:class:`Experience` is everything the update needs of the rows a step trains on, already in the
training layout ``[N, T]`` (column ``j`` predicts token ``start + j + 1``, see
:class:`~torchtune_grpo.packing.TrainingBatch`): the loss mask, advantages, the old/reference/engine
logprobs and the *global* token and sequence counts (all ranks).

:class:`PolicyUpdate` runs ``ppo_epochs`` optimizer steps on it. Each step accumulates gradients over
micro-batches; every loss term is a sum over the micro-batch divided by the global counts, so the summed
gradient does not depend on the micro-batch size or the number of processes. FSDP2 averages gradients
over ranks, so the loss is multiplied by the world size before ``backward``, and it reduce-scatters
gradients only after a step's last micro-batch. Then: gradient clipping, the optimizer and learning-rate
scheduler steps.

An optimizer step takes a *mini-batch*: today every row of the experience (:meth:`PolicyUpdate.mini_batches`
gives one); several optimizer steps per epoch on disjoint mini-batches plug in there. New loss inputs are
added to :class:`Experience` and passed in :meth:`PolicyUpdate.loss_inputs`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtune_grpo.offpolicy import logprob_mismatch_sum
from torchtune_grpo.packing import TrainingBatch
from torchtune_grpo.step_metrics import LOSS_METRICS

__all__ = ["Experience", "PolicyUpdate", "UpdateStats", "micro_batches", "batch_logprobs"]


@dataclass
class Experience:
    """The rows a step trains on, laid out for the update. ``N`` sequences, ``T`` logprob columns.

    Attributes:
        batch (TrainingBatch): the ``N`` sequences in the training layout.
        mask (torch.Tensor): ``[N, T]`` bool, the tokens the loss sees (response tokens of kept rows).
        advantages (torch.Tensor): ``[N]`` per-sequence advantages, on the training device.
        old_logprobs (Optional[torch.Tensor]): ``[N, T]`` logprobs under the sampling policy, or None when
            the update makes one pass (the current policy *is* the old one: ratio 1).
        ref_logprobs (Optional[torch.Tensor]): ``[N, T]`` reference-policy logprobs, or None (no KL term).
        engine_logprobs (Optional[torch.Tensor]): ``[N, T]`` the generation engine's sampling logprobs (an
            engine with its own weights; truncated importance sampling and the mismatch metric), or None.
        num_tokens (float): loss tokens over all ranks (``mask`` summed globally).
        num_seqs (float): kept sequences over all ranks.
    """

    batch: TrainingBatch
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    engine_logprobs: Optional[torch.Tensor]
    num_tokens: float
    num_seqs: float

    def __len__(self) -> int:
        return len(self.batch)


class UpdateStats(NamedTuple):
    """What an update reports.

    Attributes:
        losses (Dict[str, Any]): :data:`~torchtune_grpo.step_metrics.LOSS_METRICS` (this rank's
            contributions to the global sums, averaged over epochs; tensors or floats), plus
            ``generation/logprob_mismatch`` when the experience has engine logprobs.
        grad_norm (Optional[torch.Tensor]): the last optimizer step's total gradient norm (before
            clipping); None without clipping.
    """

    losses: Dict[str, Any]
    grad_norm: Optional[torch.Tensor]


def micro_batches(n: int, size: int, start: int = 0) -> List[slice]:
    """Row slices of at most ``size`` rows covering ``[start, n)``."""
    return [slice(i, min(i + size, n)) for i in range(start, n, size)]


@torch.no_grad()
def batch_logprobs(
    model: nn.Module, batch: TrainingBatch, *, micro_batch_size: int, temperature: float = 1.0,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Logprobs ``[N, T]`` of every row of ``batch`` under ``model``, micro-batch by micro-batch, no grad."""
    return torch.cat(
        [
            batch.logprobs(model, mb, temperature=temperature, chunk_size=chunk_size).logprobs
            for mb in micro_batches(len(batch), micro_batch_size)
        ]
    )


class PolicyUpdate:
    """``ppo_epochs`` optimizer steps on an :class:`Experience` (see the module docstring).

    Args:
        model (nn.Module): the policy (plain or FSDP2-sharded), in train mode.
        optimizer (torch.optim.Optimizer): its optimizer.
        loss_fn: a GRPO-family loss (:mod:`torchtune_grpo.loss`): ``loss_fn(logprobs, old_logprobs,
            advantages, mask, ref_logprobs=, entropy=, num_tokens=, num_seqs=[, sampler_logprobs=])``.
        lr_scheduler (Optional[Any]): stepped after every optimizer step. Default is None.
        ppo_epochs (int): passes over the experience. Default is 1.
        micro_batch_size (int): rows per forward/backward.
        clip_grad_norm (Optional[float]): clip the total gradient norm to this. Default is None.
        world_size (int): processes sharing the global batch (FSDP2 averages their gradients). Default is 1.
        temperature (float): the sampling temperature the logprobs are computed at. Default is 1.0.
        chunk_size (int): positions per chunk of the logprob computation. Default is 512.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn,
        *,
        lr_scheduler: Optional[Any] = None,
        ppo_epochs: int = 1,
        micro_batch_size: int,
        clip_grad_norm: Optional[float] = None,
        world_size: int = 1,
        temperature: float = 1.0,
        chunk_size: int = 512,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.ppo_epochs = int(ppo_epochs)
        self.micro_batch_size = int(micro_batch_size)
        self.clip_grad_norm = clip_grad_norm
        self.world_size = int(world_size)
        self.temperature = temperature
        self.chunk_size = int(chunk_size)
        # Only a loss with truncated importance sampling takes the engine's logprobs (custom losses need not).
        self._takes_engine_logprobs = getattr(loss_fn, "tis_cap", None) is not None
        # Entropy comes from the same chunked forward (never full logits); it carries a gradient only
        # when the loss has an entropy bonus.
        self._entropy_grad = getattr(loss_fn, "entropy_coef", 0.0) > 0

    def mini_batches(self, exp: Experience) -> List[slice]:
        """The rows of each optimizer step of an epoch: today one mini-batch, every row."""
        return [slice(0, len(exp))]

    def __call__(self, exp: Experience) -> UpdateStats:
        """Run the update.

        Args:
            exp (Experience): the step's rows.

        Returns:
            UpdateStats: loss statistics (global-sum contributions, summed on device) and the grad norm.
        """
        stats: Dict[str, Any] = dict.fromkeys(LOSS_METRICS, 0.0)
        mismatch = 0.0
        grad_norm = None
        for epoch in range(self.ppo_epochs):
            for rows in self.mini_batches(exp):
                mismatch = mismatch + self._accumulate(exp, rows, stats, first_epoch=epoch == 0)
                grad_norm = self._optimizer_step()
        if exp.engine_logprobs is not None:
            stats["generation/logprob_mismatch"] = mismatch
        return UpdateStats(stats, grad_norm)

    def _accumulate(self, exp: Experience, rows: slice, stats: Dict[str, Any], first_epoch: bool):
        """Forward/backward over the micro-batches of ``rows``; adds to ``stats``, returns the mismatch sum."""
        mbs = micro_batches(rows.stop, self.micro_batch_size, rows.start)
        mismatch = 0.0
        for i, mb in enumerate(mbs):
            # Reduce-scatter gradients only after the last micro-batch.
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            out_lp = exp.batch.logprobs(
                self.model,
                mb,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=True,
                entropy_grad=self._entropy_grad,
            )
            old = exp.old_logprobs[mb] if exp.old_logprobs is not None else out_lp.logprobs.detach()
            if exp.engine_logprobs is not None and first_epoch:
                # The trainer's pi_old vs the engine's sampling logprobs of the same tokens.
                mismatch += logprob_mismatch_sum(old, exp.engine_logprobs[mb], exp.mask[mb]) / max(
                    exp.num_tokens, 1
                )
            out = self.loss_fn(out_lp.logprobs, old, exp.advantages[mb], exp.mask[mb], **self.loss_inputs(exp, mb, out_lp))
            # FSDP averages gradients over ranks; the loss is already a global sum.
            (out.loss * self.world_size).backward()
            for key in LOSS_METRICS:
                stats[key] = stats[key] + getattr(out, key).detach() / self.ppo_epochs
        return mismatch

    def loss_inputs(self, exp: Experience, mb: slice, out_lp) -> Dict[str, Any]:
        """The loss's keyword inputs for micro-batch ``mb`` (``out_lp``: its logprobs and entropy)."""
        inputs: Dict[str, Any] = {
            "ref_logprobs": exp.ref_logprobs[mb] if exp.ref_logprobs is not None else None,
            "entropy": out_lp.entropy,
            "num_tokens": exp.num_tokens,
            "num_seqs": exp.num_seqs,
        }
        if exp.engine_logprobs is not None and self._takes_engine_logprobs:
            inputs["sampler_logprobs"] = exp.engine_logprobs[mb]
        return inputs

    def _optimizer_step(self) -> Optional[torch.Tensor]:
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=float(self.clip_grad_norm))
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return grad_norm
