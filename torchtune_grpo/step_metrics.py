"""Per-step metrics as sums that the recipe all-reduces over ranks, then turns into means.

Two kinds of metric, documented in docs/algorithms.md:

- rollout metrics (``reward/*``, ``response_length/*``, ``truncated_fraction``, ``zero_std_fraction``) describe
  every completion *generated* in the step, all dynamic-sampling rounds included: they measure the policy;
- loss metrics (``loss``, ``policy_loss``, ``kl``, ``entropy``, ``clip_fraction``, ``ratio_mean``),
  ``reward/kl_penalty`` and ``rollout_correction/*`` describe the batch *trained on*.

Every value of :func:`step_sums` is a sum, so summing the dicts of all ranks gives the global sums;
:func:`train_step_metrics` turns them (and the step's timings) into the logged metrics, and
:func:`sample_records` makes the rows of ``completions.jsonl``.
"""

from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch

from torchtune_grpo.dynamic_sampling import GroupSelection
from torchtune_grpo.offpolicy import correction_metrics
from torchtune_grpo.rollout import RolloutGroups

__all__ = [
    "EPISODE_METRICS", "LOSS_METRICS", "rollout_sums", "sample_records", "step_metrics", "step_sums", "train_step_metrics",
]

#: Fields of :class:`torchtune_grpo.loss.LossOutput` logged under their own name (already global sums).
LOSS_METRICS = ("loss", "policy_loss", "kl", "clip_fraction", "ratio_mean", "entropy")

#: Per-episode numbers of multi-turn rollouts logged as ``episode/<name>`` (per-episode means). A fixed list:
#: every rank must all-reduce the same keys, whatever its episodes did (missing ones count 0).
EPISODE_METRICS = ("turns", "tool_calls", "tool_errors", "env_error", "injected_tokens")


def rollout_sums(
    generated: RolloutGroups, zero_std: torch.Tensor, selection: GroupSelection
) -> Dict[str, float]:
    """One rank's sums over the completions it generated this step.

    Args:
        generated (RolloutGroups): every group this rank generated in the step.
        zero_std (torch.Tensor): ``[generated.num_groups]`` bool, zero-variance groups.
        selection (GroupSelection): what dynamic sampling kept.

    Returns:
        Dict[str, float]: sums, keyed for :func:`step_metrics`.
    """
    total = generated.rewards.double()
    lengths = torch.tensor([len(r) for r in generated.response_ids], dtype=torch.float64)
    terminated = ~generated.truncated
    sums = {
        "n": float(total.numel()),
        "reward_sum": total.sum().item(),
        "reward_sq": (total**2).sum().item(),
        "resp_len": lengths.sum().item(),
        "truncated": generated.truncated.sum().item(),
        "terminated": terminated.sum().item(),
        "terminated_len": lengths[terminated].sum().item(),
        "zero_std": zero_std.sum().item(),
        "groups": float(zero_std.numel()),
        "tokens": float(sum(len(p) + len(r) for p, r in zip(generated.prompt_ids, generated.response_ids))),
        "ds_dropped": float(selection.dropped),
        "ds_filled": float(selection.filled),
        "ds_surplus": float(selection.surplus),
    }
    if generated.episode_info is not None:
        sums.update({f"ep:{k}": float(sum(i.get(k, 0.0) for i in generated.episode_info)) for k in EPISODE_METRICS})
    sums.update({f"comp:{k}": v.double().sum().item() for k, v in generated.per_component.items()})
    sums.update({f"err:{k}": float(v) for k, v in generated.errors.items()})
    return sums


def _mean(total: float, count: float) -> float:
    return total / count if count else 0.0


def step_metrics(reduced: Dict[str, float], loss_keys: Iterable[str] = LOSS_METRICS) -> Dict[str, float]:
    """Turns globally reduced sums into the logged metrics.

    Args:
        reduced (Dict[str, float]): :func:`rollout_sums` summed over ranks, plus the loss metrics (already
            global contributions, see :class:`~torchtune_grpo.loss.LossOutput`) and ``kl_penalty`` /
            ``n_trained`` (sum of per-sequence KL penalties and trained sequences), and the rollout
            correction's sums (:class:`~torchtune_grpo.offpolicy.CorrectionOutput`) when there is one.
        loss_keys (Iterable[str]): loss metrics to copy as they are. Default is :data:`LOSS_METRICS`.

    Returns:
        Dict[str, float]: metric name -> value.
    """
    n = reduced["n"]
    mean = _mean(reduced["reward_sum"], n)
    metrics = {k: reduced[k] for k in loss_keys}
    metrics.update(
        {
            "reward/mean": mean,
            "reward/std": max(_mean(reduced["reward_sq"], n) - mean**2, 0.0) ** 0.5,
            "reward/kl_penalty": _mean(reduced["kl_penalty"], reduced["n_trained"]),
            "response_length/mean": _mean(reduced["resp_len"], n),
            # mean length of completions that ended with a stop token (0 when none did)
            "response_length/terminated_mean": _mean(reduced["terminated_len"], reduced["terminated"]),
            # fraction cut at max_response_length (verl's response_length/clip_ratio)
            "truncated_fraction": _mean(reduced["truncated"], n),
            "zero_std_fraction": _mean(reduced["zero_std"], reduced["groups"]),
            "dynamic_sampling/groups_dropped": reduced["ds_dropped"],
            "dynamic_sampling/groups_filled": reduced["ds_filled"],
            "dynamic_sampling/groups_surplus": reduced["ds_surplus"],
        }
    )
    if "ep:turns" in reduced:  # multi-turn: per-episode means, and the model's share of the tokens
        metrics.update({f"episode/{k}": _mean(reduced[f"ep:{k}"], n) for k in EPISODE_METRICS})
        metrics["episode/generated_tokens"] = _mean(reduced["resp_len"] - reduced["ep:injected_tokens"], n)
    metrics.update(correction_metrics(reduced))  # rollout_correction/*, when the run has one
    for key, value in reduced.items():
        if key.startswith("comp:"):
            metrics[f"reward/{key[5:]}/mean"] = _mean(value, n)
        elif key.startswith("err:"):
            metrics[f"reward/{key[4:]}/errors"] = value
        elif key.startswith("adv:"):
            # each reward component's share w_k z_k of the advantage signal (normalize_components, GDPO)
            name, n_seq = key[4:], reduced["n_trained"]
            mean = _mean(value, n_seq)
            metrics[f"advantage/{name}/mean"] = mean
            metrics[f"advantage/{name}/std"] = max(_mean(reduced[f"adv_sq:{name}"], n_seq) - mean**2, 0.0) ** 0.5
            metrics[f"advantage/{name}/zero_std_fraction"] = _mean(reduced[f"adv_zero:{name}"], reduced["adv_groups"])
    return metrics


def step_sums(
    generated: RolloutGroups,
    zero_std: torch.Tensor,
    selection: GroupSelection,
    losses: Mapping[str, Any],
    kl_penalty: torch.Tensor,
    n_trained: int,
    pre_update: Optional[Mapping[str, float]] = None,
) -> Dict[str, float]:
    """One rank's sums of a training step: :func:`rollout_sums`, the loss terms and the KL penalty.

    Args:
        generated (RolloutGroups): every group this rank generated in the step.
        zero_std (torch.Tensor): ``[generated.num_groups]`` bool, zero-variance groups.
        selection (GroupSelection): what dynamic sampling kept.
        losses (Mapping[str, Any]): the update's loss statistics (global-sum contributions).
        kl_penalty (torch.Tensor): ``[n_trained]`` per-sequence KL penalties subtracted from the rewards.
        n_trained (int): sequences trained on.
        pre_update (Optional[Mapping[str, float]]): sums of what was decided before the update
            (``Experience.metric_sums``: rollout correction, per-component advantages). Default is None.

    Returns:
        Dict[str, float]: sums, keyed for :func:`train_step_metrics`.
    """
    return {
        **rollout_sums(generated, zero_std, selection),
        **{k: float(v) for k, v in losses.items()},
        "kl_penalty": kl_penalty.double().sum().item(),
        "n_trained": float(n_trained),
        **{k: float(v) for k, v in (pre_update or {}).items()},
    }


def train_step_metrics(
    reduced: Dict[str, float],
    *,
    rounds: int,
    lr: float,
    step_seconds: float,
    rollout: RolloutGroups,
    weight_sync: Optional[Dict[str, float]] = None,
    grad_norm: Optional[float] = None,
    peak_memory_gib: Optional[float] = None,
) -> Dict[str, float]:
    """A training step's logged metrics from the globally reduced :func:`step_sums` and its timings.

    Args:
        reduced (Dict[str, float]): :func:`step_sums` summed over ranks.
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
            "tokens_per_second": reduced["tokens"] / step_seconds,
            "time/generation": rollout.generation_seconds,
            "time/reward": rollout.reward_seconds,
            **({"time/environment": rollout.environment_seconds} if rollout.episode_info is not None else {}),
            "time/train": step_seconds - rollout.generation_seconds - rollout.reward_seconds - sync_seconds,
            "time/step": step_seconds,
        }
    )
    if weight_sync is not None:
        metrics.update(weight_sync)
    if "generation/logprob_mismatch" in reduced:
        metrics["generation/logprob_mismatch"] = reduced["generation/logprob_mismatch"]
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
        advantages (torch.Tensor): ``[N]`` their advantages.
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
        }
        for i in range(min(limit, len(trained.response_ids)))
    ]
