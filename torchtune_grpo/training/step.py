"""One GRPO training step, stage by stage: the object the recipes run ``total_steps`` times.

::

    prompts -> rollouts.collect  -> RolloutGroups   (sampled and scored; dynamic-sampling rounds)
            -> dynamic.select    -> the groups trained on
            -> build_experience  -> Experience      (layout, reference/old logprobs, advantages, masks)
            -> update            -> UpdateStats     (micro-batched loss, backward, clipping, optimizer)
            -> publisher         -> the engine's weights synced and checked (an engine with its own copy)
            -> metrics           -> reduced over ranks by key, declared once (training/step_metrics.py)

Each stage is a public, swappable part (:attr:`GRPOStep.rollouts` takes any object with
``collect(policy, batch)``, e.g. :class:`~torchtune_grpo.rollouts.producer.FixedRollouts` to replay rollouts), so
tests and benchmarks run the recipe's real step without patching it.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn
from torchtune import utils
from torchtune.training.lr_schedulers import get_lr

from torchtune_grpo.training.diagnostics import advantage_sums, StepDiagnostics
from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.training.experience import ExperienceBuilder
from torchtune_grpo.metrics.sums import Key, Reduce, reduce_over_ranks, StepSums
from torchtune_grpo.metrics.timing import device_clock
from torchtune_grpo.models.compiled import compile_seconds
from torchtune_grpo.runtime.nonfinite import advice, count_nonfinite, NonFiniteError
from torchtune_grpo.runtime.crash_points import crash_point
from torchtune_grpo.data import PromptBatch
from torchtune_grpo.training.step_metrics import sample_records, step_sums, train_step_metrics
from torchtune_grpo.training.update import PolicyUpdate
from torchtune_grpo.loss.token_advantages import sequence_advantages

__all__ = [
    "GRPOStep", "StepResult", "count_nonfinite_weights", "staleness_metrics", "staleness_sums", "trained_parameters",
]

log = utils.get_logger("INFO")


class StepResult(NamedTuple):
    """What a step leaves: its metrics (global, the same on every rank) and this rank's logged completions.

    Attributes:
        metrics (Dict[str, Any]): ``reward/mean``, ``kl``, ``loss``, ``time/step``, ... (docs/metrics.md).
        samples (List[Dict[str, Any]]): ``completions.jsonl`` rows (``log_completions`` per step).
    """

    metrics: Dict[str, Any]
    samples: List[Dict[str, Any]]


@dataclass
class GRPOStep:
    """One GRPO step on one rank's prompt batch, every stage a public part.

    Attributes:
        rollouts (Any): ``collect(policy, batch) -> (RolloutGroups, rounds)``
            (:class:`~torchtune_grpo.rollouts.producer.RolloutProducer`).
        dynamic (DynamicSampling): which groups are trained on.
        build_experience (ExperienceBuilder): selected rollouts -> the update's :class:`Experience`.
        update (PolicyUpdate): the policy update (its optimizer gives the logged learning rate).
        publisher (Optional[Any]): syncs an engine with its own weights (a :class:`WeightPublisher` for vLLM,
            the :class:`~torchtune_grpo.workers.client.WorkerRollouts` for a generation worker) after the
            update: ``publish(policy, step) -> metrics``.
        all_reduce (Callable[[List[float], Reduce], List[float]]): elementwise reduction over ranks.
        batch_size (int): prompts per rank per step.
        log_completions (int): completions per step written to ``completions.jsonl``.
        on_nonfinite (str): ``stop`` or ``skip`` (torchtune_grpo/runtime/nonfinite.py).
        device (torch.device): for the peak-memory metric on CUDA.
        max_staleness (int): a generation worker's bound (the staleness histogram's range). Default is 0.
        diagnostics (Optional[StepDiagnostics]): closed-loop diagnostics (``step_diagnostics``). Default is None.
    """

    rollouts: Any
    dynamic: DynamicSampling
    build_experience: ExperienceBuilder
    update: PolicyUpdate
    publisher: Optional[Any]
    all_reduce: Callable[..., List[float]]
    batch_size: int
    log_completions: int = 0
    on_nonfinite: str = "stop"
    device: torch.device = torch.device("cpu")
    max_staleness: int = 0
    diagnostics: Optional[StepDiagnostics] = None

    def __call__(self, policy: nn.Module, step: int, batch: Optional[PromptBatch] = None) -> StepResult:
        """Train ``policy`` on the rollouts of this step, as training step ``step + 1``.

        Args:
            policy (nn.Module): the trained model.
            step (int): training steps done before this one.
            batch (Optional[PromptBatch]): this rank's ``batch_size`` prompts; default: the producer draws
                the next ones (a generation worker's were drawn when they were requested).

        Returns:
            StepResult: the step's metrics and logged completions.

        Raises:
            NonFiniteError: on non-finite weights (always) or loss (``on_nonfinite: stop``).
        """
        t0 = time.perf_counter()
        generated, num_rounds = self.rollouts.collect(policy, batch)  # sampled and scored
        t_rollouts = time.perf_counter() - t0
        crash_point("rollout", step + 1)  # test-only (torchtune_grpo/runtime/crash_points.py)
        selection = self.dynamic.select(generated, self.batch_size)
        trained = generated.select(selection.indices)
        diagnosed = self.diagnostics.before_update(policy, generated) if self.diagnostics is not None else None
        compiled0 = compile_seconds()  # compile_training: its compile time, apart from the phases' work
        t_experience = device_clock(self.device)
        exp, kl_penalty = self.build_experience(policy, trained)
        t_update = device_clock(self.device)
        stats = self.update(exp, step=step)
        phases = {**exp.seconds, "time/experience": t_update - t_experience,
                  "time/update": device_clock(self.device) - t_update, "time/compile": compile_seconds() - compiled0}
        if diagnosed is not None:
            diagnosed.merge(self.diagnostics.after_update(policy, exp, exp.old_logprobs))
        crash_point("update", step + 1)
        # The engine (vLLM) samples the next step from the weights just updated.
        sync = self.publisher.publish(policy, step=step + 1) if self.publisher is not None else None
        t_step = time.perf_counter() - t0

        # This rank's sums, reduced over ranks by key, then the declared metrics (training/step_metrics.py).
        zero_std = self.dynamic.informative(generated).logical_not()
        local = step_sums(generated, zero_std, selection, stats.losses, kl_penalty, len(exp), exp.metric_sums)
        local.add(("nonfinite_weights",), count_nonfinite(trained_parameters(policy)))  # this rank's shards
        if stats.sums is not None:  # a mixture-of-experts policy's router metrics
            local.merge(stats.sums)
        seq_advantages = sequence_advantages(exp.advantages, exp.mask)  # [N]: token-level ones averaged
        local.merge(advantage_sums(seq_advantages))
        if diagnosed is not None:
            local.merge(diagnosed)
        if generated.weight_versions is not None:
            local.merge(staleness_sums(generated.weight_versions, step, self.max_staleness, generated.token_versions))
        reduced = reduce_over_ranks(local, self.all_reduce)
        self._check_finite(reduced, stats.skipped_steps, step + 1)
        metrics = train_step_metrics(
            reduced,
            rounds=num_rounds,  # the same on every rank
            lr=get_lr(self.update.optimizer),
            step_seconds=t_step,
            rollout=generated,
            weight_sync=sync,
            grad_norm=stats.grad_norm,
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None,
        )
        metrics["nonfinite/skipped_optimizer_steps"] = stats.skipped_steps
        metrics.update(phases)
        if generated.weight_versions is not None:  # sampled by a generation worker, overlapped with training
            metrics.update(staleness_metrics(reduced, self.max_staleness))
            # The worker's own generation and reward times overlap training: the trainer waited t_rollouts.
            metrics["time/rollout_wait"] = t_rollouts
            metrics["time/train"] = t_step - t_rollouts - (sync or {}).get("time/weight_sync", 0.0)
        return StepResult(metrics, sample_records(trained, seq_advantages, step + 1, self.log_completions))

    def _check_finite(self, reduced: Dict[Key, float], skipped_steps: int, step: int) -> None:
        # ``reduced`` is global, so every rank raises at the same step (torchtune_grpo/runtime/nonfinite.py).
        if (broken := reduced[("nonfinite_weights",)]) > 0:
            raise NonFiniteError(advice(f"{int(broken)} weight tensor(s) hold NaN or inf after training step {step}"))
        loss = reduced[("update", "loss")]
        if not math.isfinite(loss):
            if self.on_nonfinite == "stop":
                raise NonFiniteError(advice(f"The loss is {loss} at training step {step}"))
            utils.log_rank_zero(log, f"Step {step}: the loss is {loss} (on_nonfinite=skip)", level=logging.WARNING)
        if skipped_steps:
            utils.log_rank_zero(
                log, f"Step {step}: {skipped_steps} optimizer step(s) skipped, non-finite gradient norm "
                "(on_nonfinite=skip; metric nonfinite/skipped_optimizer_steps)"
            )


def trained_parameters(policy: nn.Module) -> List[torch.Tensor]:
    """The parameters the optimizer changes (frozen ones, NF4 included, cannot turn non-finite)."""
    return [p for p in policy.parameters() if p.requires_grad]


def count_nonfinite_weights(policy: nn.Module, all_reduce_sum: Callable[[List[float]], List[float]]) -> int:
    """Trained weight tensors holding NaN or inf, over all ranks (a save refuses them)."""
    return int(all_reduce_sum([float(count_nonfinite(trained_parameters(policy)))])[0])



def staleness_sums(
    versions: List[int], step: int, max_staleness: int, token_versions: Optional[List[List[int]]] = None
) -> StepSums:
    """One rank's staleness counts: rows sampled ``s`` steps behind the trainer's weights, ``s = 0 .. max``.

    Args:
        versions (List[int]): per row, the training steps of the weights that sampled it (its oldest token's,
            when a row spans several versions).
        step (int): the trainer's training steps (its weights' version) when it trains on them.
        max_staleness (int): the bound (every rank reduces the same keys: ``0 .. max_staleness``).
        token_versions (Optional[List[List[int]]]): per row and token, the version that sampled it (in-flight
            weight updates); counted into ``("newer_tokens",)`` (tokens newer than their row's oldest) and
            ``("versioned_tokens",)``. Default is None.

    Returns:
        StepSums: ``("staleness", s)`` counts and ``("staleness_max",)`` (and the token counts).

    Raises:
        RuntimeError: if a row is staler than the bound (the schedule forbids it: a bug, not a setting).
    """
    staleness = [step - v for v in versions]
    if staleness and (max(staleness) > max_staleness or min(staleness) < 0):
        raise RuntimeError(f"rows sampled {max(staleness)} steps behind at step {step + 1}: bound {max_staleness}")
    sums = StepSums()
    for s in range(max_staleness + 1):
        sums.add(("staleness", s), sum(1 for x in staleness if x == s))
    sums.add(("staleness_max",), max(staleness, default=0), Reduce.MAX)
    if token_versions is not None:
        sums.add(("newer_tokens",), sum(sum(1 for v in row if v > oldest) for row, oldest in zip(token_versions, versions)))
        sums.add(("versioned_tokens",), sum(len(row) for row in token_versions))
    return sums


def staleness_metrics(reduced: Dict[Key, float], max_staleness: int) -> Dict[str, float]:
    """``staleness/mean``, ``staleness/max`` and the histogram ``staleness/fraction_<s>`` over all ranks' rows."""
    counts = [reduced[("staleness", s)] for s in range(max_staleness + 1)]
    rows = sum(counts) or 1.0
    metrics = {"staleness/mean": sum(s * c for s, c in enumerate(counts)) / rows,
               "staleness/max": reduced[("staleness_max",)]}
    metrics.update({f"staleness/fraction_{s}": c / rows for s, c in enumerate(counts)})
    if ("versioned_tokens",) in reduced:  # in-flight weight updates: tokens sampled after their row's first version
        metrics["staleness/newer_token_fraction"] = reduced[("newer_tokens",)] / max(reduced[("versioned_tokens",)], 1.0)
    return metrics
