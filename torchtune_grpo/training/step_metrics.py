"""Per-step metrics: this rank's quantities, reduced over ranks by key, then the logged metrics.

Two kinds of metric, documented in docs/algorithms.md:

- rollout metrics (``reward/*``, ``response_length/*``, ``truncated_fraction``, ``zero_std_fraction``) describe
  every completion *generated* in the step, all dynamic-sampling rounds included: they measure the policy;
- loss metrics (``loss``, ``policy_loss``, ``kl``, ``entropy``, ``clip_fraction``, ``ratio_mean``),
  ``reward/kl_penalty`` and ``rollout_correction/*`` describe the batch *trained on*.

:func:`step_sums` collects one rank's quantities (:class:`~torchtune_grpo.metrics.sums.StepSums`, each with its
reduction); :func:`~torchtune_grpo.metrics.sums.reduce_over_ranks` combines them by key; :func:`step_metrics`
turns the result into the logged metrics, each declared once below (:func:`declared_metrics`), and
:func:`train_step_metrics` adds the step's timings. :func:`sample_records` makes ``completions.jsonl``'s rows.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch

from torchtune_grpo.rollouts.group_selection import GroupSelection
from torchtune_grpo.metrics.sums import Key, Mean, Metric, Reduce, StepSums, Std, Value
from torchtune_grpo.loss.rollout_correction import CORRECTION_METRICS
from torchtune_grpo.rollouts.groups import RolloutGroups
from torchtune_grpo.training.routes import router_metrics

__all__ = [
    "EPISODE_METRICS", "LOSS_METRICS", "declared_metrics", "rollout_sums", "sample_records", "step_metrics",
    "step_sums", "train_step_metrics",
]

#: Fields of :class:`torchtune_grpo.loss.LossOutput` logged under their own name (already global sums).
LOSS_METRICS = ("loss", "policy_loss", "kl", "clip_fraction", "ratio_mean", "entropy")

#: Per-episode numbers of multi-turn rollouts logged as ``episode/<name>`` (per-episode means). A fixed list:
#: every rank must reduce the same keys, whatever its episodes did (missing ones count 0).
EPISODE_METRICS = ("turns", "tool_calls", "tool_errors", "env_error", "injected_tokens")

_N = ("completions",)  # completions generated (all rounds)

#: The rollout and batch metrics every step logs: name -> how it is computed from the reduced quantities.
STEP_METRICS: Dict[str, Metric] = {
    "reward/mean": Mean(("reward",), _N),
    "reward/std": Std(("reward",), ("reward_sq",), _N),  # population std over the whole batch
    "reward/kl_penalty": Mean(("kl_penalty",), ("trained",)),
    "response_length/mean": Mean(("response_tokens",), _N),
    "response_length/max": Value(("response_length_max",)),
    "response_length/min": Value(("response_length_min",)),
    # mean length of completions that ended with a stop token (0 when none did)
    "response_length/terminated_mean": Mean(("terminated_tokens",), ("terminated",)),
    # fraction cut at max_response_length (verl's response_length/clip_ratio)
    "truncated_fraction": Mean(("truncated",), _N),
    "zero_std_fraction": Mean(("zero_std_groups",), ("groups",)),
    "dynamic_sampling/groups_dropped": Value(("dynamic_sampling", "dropped")),
    "dynamic_sampling/groups_filled": Value(("dynamic_sampling", "filled")),
    "dynamic_sampling/groups_surplus": Value(("dynamic_sampling", "surplus")),
}


def declared_metrics(reduced: Mapping[Key, float]) -> Dict[str, Metric]:
    """Every logged metric of a step whose reduced quantities are ``reduced``: :data:`STEP_METRICS`, the loss
    metrics, and the families whose members depend on the run (reward components, multi-turn episodes,
    rollout correction, GDPO's per-component advantages)."""
    metrics: Dict[str, Metric] = {name: Value(("update", name)) for name in LOSS_METRICS}
    metrics.update(STEP_METRICS)
    if ("episode", "turns") in reduced:  # multi-turn: per-episode means, and the model's share of the tokens
        metrics.update({f"episode/{k}": Mean(("episode", k), _N) for k in EPISODE_METRICS})
        metrics["episode/generated_tokens"] = Mean(("episode", "generated_tokens"), _N)
    if ("rollout_correction", "tokens") in reduced:
        metrics.update(CORRECTION_METRICS)
    metrics.update(router_metrics(reduced))  # a mixture-of-experts policy's (training/routes.py)
    if ("advantage_abs",) in reduced:
        metrics["advantage/abs_mean"] = Mean(("advantage_abs",), ("trained",))
    if ("diagnostics", "tokens") in reduced:  # step_diagnostics (torchtune_grpo/training/diagnostics.py)
        metrics["diagnostics/kl_step"] = Mean(("diagnostics", "kl_sum"), ("diagnostics", "tokens"))
        metrics["diagnostics/sampled_accuracy"] = Mean(("diagnostics", "sampled_correct"), _N)
        metrics["diagnostics/greedy_accuracy"] = Mean(("diagnostics", "greedy_correct"), ("diagnostics", "prompts"))
    for key in reduced:
        if key[0] == "group" and key[2] != "completions":
            # a dataset's metric groups (reasoning-gym tasks...): means over that group's completions only
            name = "mean" if key[2] == "reward" else f"{key[3]}/mean"
            metrics[f"reward_by_group/{key[1]}/{name}"] = Mean(key, ("group", key[1], "completions"))
        elif key[0] == "component":
            metrics[f"reward/{key[1]}/mean"] = Mean(key, _N)
        elif key[0] == "errors":
            metrics[f"reward/{key[1]}/errors"] = Value(key)
        elif key[0] == "advantage" and key[2] == "sum":
            # each reward component's share w_k z_k of the advantage signal (normalize_components, GDPO)
            name = key[1]
            metrics[f"advantage/{name}/mean"] = Mean(key, ("trained",))
            metrics[f"advantage/{name}/std"] = Std(key, ("advantage", name, "sq"), ("trained",))
            metrics[f"advantage/{name}/zero_std_fraction"] = Mean(("advantage", name, "zero_std"), ("advantage_groups",))
    return metrics


def rollout_sums(generated: RolloutGroups, zero_std: torch.Tensor, selection: GroupSelection) -> StepSums:
    """One rank's quantities over the completions it generated this step.

    Args:
        generated (RolloutGroups): every group this rank generated in the step.
        zero_std (torch.Tensor): ``[generated.num_groups]`` bool, zero-variance groups.
        selection (GroupSelection): what dynamic sampling kept.

    Returns:
        StepSums: the quantities :data:`STEP_METRICS` and the per-component families read.
    """
    total = generated.rewards.double()
    lengths = torch.tensor([len(r) for r in generated.response_ids], dtype=torch.float64)
    terminated = ~generated.truncated
    sums = StepSums()
    for key, value in (
        (_N, total.numel()),
        (("reward",), total.sum().item()),
        (("reward_sq",), (total**2).sum().item()),
        (("response_tokens",), lengths.sum().item()),
        (("truncated",), generated.truncated.sum().item()),
        (("terminated",), terminated.sum().item()),
        (("terminated_tokens",), lengths[terminated].sum().item()),
        (("zero_std_groups",), zero_std.sum().item()),
        (("groups",), zero_std.numel()),
        (("tokens",), sum(len(p) + len(r) for p, r in zip(generated.prompt_ids, generated.response_ids))),
        (("dynamic_sampling", "dropped"), selection.dropped),
        (("dynamic_sampling", "filled"), selection.filled),
        (("dynamic_sampling", "surplus"), selection.surplus),
    ):
        sums.add(key, value)
    # A rank without completions adds nothing to the extremes: its max is -inf and min +inf, the identities.
    sums.add(("response_length_max",), lengths.max().item() if lengths.numel() else float("-inf"), Reduce.MAX)
    sums.add(("response_length_min",), lengths.min().item() if lengths.numel() else float("inf"), Reduce.MIN)
    if generated.episode_info is not None:
        for k in EPISODE_METRICS:
            sums.add(("episode", k), sum(i.get(k, 0.0) for i in generated.episode_info))
        sums.add(("episode", "generated_tokens"), lengths.sum().item() - sums[("episode", "injected_tokens")])
    for name, values in generated.per_component.items():
        sums.add(("component", name), values.double().sum().item())
    _add_group_sums(sums, generated, total)
    for name, count in generated.errors.items():
        sums.add(("errors", name), count)
    return sums


def _add_group_sums(sums: StepSums, generated: RolloutGroups, total: torch.Tensor) -> None:
    """Per-group reward sums of datasets whose rows name a ``metric_group`` (e.g. the task of a reasoning-gym
    mix) and list every group in ``metric_groups``: every group of that list gets its keys, 0 when no row of
    it was generated here, so all ranks reduce the same keys whatever their prompts were."""
    declared = {g for f in generated.fields for g in (f.get("metric_groups") or ())}
    if not declared:
        return
    G = generated.group_size
    for g in sorted(declared):
        rows = [i for i, f in enumerate(generated.fields) if f.get("metric_group") == g]
        idx = torch.tensor([r * G + j for r in rows for j in range(G)], dtype=torch.long)
        sums.add(("group", g, "completions"), idx.numel())
        sums.add(("group", g, "reward"), total[idx].sum().item() if idx.numel() else 0.0)
        for name, values in generated.per_component.items():
            sums.add(("group", g, "component", name), values.double()[idx].sum().item() if idx.numel() else 0.0)


def step_metrics(reduced: Mapping[Key, float]) -> Dict[str, float]:
    """The logged metrics (:func:`declared_metrics`) from the quantities reduced over ranks.

    Args:
        reduced (Mapping[Key, float]): :func:`step_sums` reduced over ranks
            (:func:`~torchtune_grpo.metrics.sums.reduce_over_ranks`).

    Returns:
        Dict[str, float]: metric name -> value.
    """
    return {name: metric.value(reduced) for name, metric in declared_metrics(reduced).items()}


def step_sums(
    generated: RolloutGroups,
    zero_std: torch.Tensor,
    selection: GroupSelection,
    losses: Mapping[str, Any],
    kl_penalty: torch.Tensor,
    n_trained: int,
    pre_update: Optional[StepSums] = None,
) -> StepSums:
    """One rank's quantities of a training step: :func:`rollout_sums`, the update's and the KL penalty.

    Args:
        generated (RolloutGroups): every group this rank generated in the step.
        zero_std (torch.Tensor): ``[generated.num_groups]`` bool, zero-variance groups.
        selection (GroupSelection): what dynamic sampling kept.
        losses (Mapping[str, Any]): the update's statistics (global-sum contributions), by metric name.
        kl_penalty (torch.Tensor): ``[n_trained]`` per-sequence KL penalties subtracted from the rewards.
        n_trained (int): sequences trained on.
        pre_update (Optional[StepSums]): what was decided before the update (``Experience.metric_sums``:
            rollout correction, per-component advantages). Default is None.

    Returns:
        StepSums: every quantity :func:`step_metrics` reads.
    """
    sums = rollout_sums(generated, zero_std, selection)
    for name, value in losses.items():
        sums.add(("update", name), float(value))
    sums.add(("kl_penalty",), kl_penalty.double().sum().item())
    sums.add(("trained",), n_trained)
    if pre_update is not None:
        sums.merge(pre_update)
    return sums


def train_step_metrics(
    reduced: Mapping[Key, float],
    *,
    rounds: int,
    lr: float,
    step_seconds: float,
    rollout: RolloutGroups,
    weight_sync: Optional[Dict[str, float]] = None,
    grad_norm: Optional[float] = None,
    peak_memory_gib: Optional[float] = None,
) -> Dict[str, float]:
    """A training step's logged metrics from the reduced :func:`step_sums` and its timings.

    Args:
        reduced (Mapping[Key, float]): :func:`step_sums` reduced over ranks.
        rounds (int): generation rounds run (the same on every rank).
        lr (float): the learning rate.
        step_seconds (float): the whole step's time.
        rollout (RolloutGroups): what this rank generated (its generation and reward times).
        weight_sync (Optional[Dict[str, float]]): the engine weight sync's metrics (``time/weight_sync``,
            maybe ``generation/sync_logprob_diff``); None for an engine without its own weights.
            Default is None.
        grad_norm (Optional[float]): the global gradient norm before clipping. Default is None.
        peak_memory_gib (Optional[float]): peak accelerator memory; None on CPU. Default is None.

    Returns:
        Dict[str, float]: metric name -> value.
    """
    metrics = step_metrics(reduced)
    sync_seconds = weight_sync["time/weight_sync"] if weight_sync is not None else 0.0
    metrics.update(
        {
            "dynamic_sampling/rounds": rounds,
            "lr": lr,
            "tokens_per_second": reduced[("tokens",)] / step_seconds,
            "time/generation": rollout.generation_seconds,
            "time/reward": rollout.reward_seconds,
            **({"time/environment": rollout.environment_seconds} if rollout.episode_info is not None else {}),
            "time/train": step_seconds - rollout.generation_seconds - rollout.reward_seconds - sync_seconds,
            "time/step": step_seconds,
        }
    )
    if weight_sync is not None:
        metrics.update(weight_sync)
    if ("update", "generation/logprob_mismatch") in reduced:
        metrics["generation/logprob_mismatch"] = reduced[("update", "generation/logprob_mismatch")]
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    if peak_memory_gib is not None:
        metrics["memory/peak_allocated_gib"] = peak_memory_gib
    return metrics


def sample_records(
    trained: RolloutGroups, advantages: torch.Tensor, step: int, limit: int
) -> List[Dict[str, Any]]:
    """The first ``limit`` trained completions as ``completions.jsonl`` rows.

    Args:
        trained (RolloutGroups): the groups trained on.
        advantages (torch.Tensor): ``[N]`` their advantages (token-level ones: the mean over the row's tokens).
        step (int): the step number written in each row.
        limit (int): rows at most.

    Returns:
        List[Dict[str, Any]]: ``{step, prompt, completion, reward, advantage, reward/<component>...}``.
    """
    g = trained.group_size
    return [
        {
            "step": step,
            "prompt": trained.prompts[i // g],
            "completion": trained.completions[i],
            "reward": trained.rewards[i].item(),
            "advantage": advantages[i].item(),
            **{f"reward/{k}": v[i].item() for k, v in trained.per_component.items()},
            # multi-turn: the whole episode with roles (the model's turns and the environment's replies)
            **({"conversation": trained.conversations[i]} if trained.conversations is not None else {}),
            # a step-level reward: each step's score and last response token
            **({"step_scores": trained.step_scores[i], "step_ends": trained.step_ends[i]}
               if trained.step_scores is not None else {}),
        }
        for i in range(min(limit, len(trained.response_ids)))
    ]
