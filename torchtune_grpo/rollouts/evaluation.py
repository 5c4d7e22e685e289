"""Held-out evaluation: greedy accuracy, mean reward and pass@k of a model on a prompt dataset.

Pure in the sense of the stage modules (docs/architecture.md): a model, a tokenizer, a generation engine,
prompts and a reward set in, sums out. No ``torch.distributed`` and no config reading: the recipe shards
the prompts over ranks, all-reduces :meth:`EvalSums.as_list` and turns the result into metrics with
:meth:`EvalSums.metrics`; ``tune-grpo eval`` calls the same function on one process.

Metrics (the keys the recipe logs, each prefixed ``eval/``):

- ``accuracy``: fraction of prompts whose **greedy** completion (engine temperature 0) is correct, i.e. its
  ``correctness`` reward component is ``>= threshold``;
- ``reward/mean``: mean total (weighted) reward of the greedy completions;
- ``tool_use_rate`` (multi-turn evaluation only): fraction of prompts whose greedy episode called a tool at
  least once (the environment's ``tool_calls`` info, which :class:`~torchtune_grpo.multiturn.ToolEnvironment`
  reports);
- ``pass@k``: with ``n = num_samples`` completions sampled per prompt at the engine's temperature and ``c``
  of them correct, the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, "Evaluating Large
  Language Models Trained on Code"), ``1 - C(n - c, k) / C(n, k)``, averaged over prompts. The default
  ``k = n`` makes it exactly "at least one of the n samples is correct".
"""

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from torchtune_grpo.data import collate_prompts
from torchtune_grpo.rollouts.groups import sample_and_score

__all__ = [
    "check_evaluation_keys", "correctness_name", "EvalSums", "evaluate", "HeldOutEvaluation", "pass_at_k",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021).

    ``1 - C(n-c, k) / C(n, k)``; e.g. ``n=4, c=1, k=2``: ``1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5``.

    Raises:
        ValueError: unless ``1 <= k <= n`` and ``0 <= c <= n``.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def correctness_name(reward_names: Sequence[str], name: Optional[str] = None) -> str:
    """The reward component that decides "correct": ``name``, else the one named ``correctness``.

    Raises:
        ValueError: when there is no such component (the message lists the names there are).
    """
    if name is not None and name not in reward_names:
        raise ValueError(
            f"eval_reward={name!r} names no reward component: the reward set has {list(reward_names)}. "
            "Set eval_reward to one of these names (or leave it out to use the one named `correctness`)."
        )
    wanted = name or "correctness"
    if wanted not in reward_names:
        raise ValueError(
            f"Evaluation needs a reward component named '{wanted}' to decide correctness, but the reward "
            f"set has {list(reward_names)}. Name one `correctness` in reward_functions, or set eval_reward "
            "to one of these names."
        )
    return wanted


@dataclass
class EvalSums:
    """Sums over prompts (additive across ranks: all-reduce :meth:`as_list`, then :meth:`from_list`).

    Attributes:
        prompts (float): prompts evaluated.
        correct (float): prompts whose greedy completion is correct.
        reward (float): summed total reward of the greedy completions.
        response_length (float): summed greedy completion length in tokens.
        pass_at_k (float): summed per-prompt pass@k (0 when ``k == 0``).
        tool_use (float): prompts whose greedy episode called a tool (0 for single-turn evaluation).
        k (int): the k of pass@k; 0 when no samples were drawn. Not summed.
        multi_turn (bool): the completions were multi-turn episodes (``tool_use`` is a metric). Not summed.
    """

    prompts: float = 0.0
    correct: float = 0.0
    reward: float = 0.0
    response_length: float = 0.0
    pass_at_k: float = 0.0
    tool_use: float = 0.0
    k: int = 0
    multi_turn: bool = False

    def as_list(self) -> List[float]:
        return [self.prompts, self.correct, self.reward, self.response_length, self.pass_at_k, self.tool_use]

    @classmethod
    def from_list(cls, values: Sequence[float], k: int, multi_turn: bool = False) -> "EvalSums":
        return cls(*[float(v) for v in values], k=k, multi_turn=multi_turn)

    def metrics(self, prefix: str = "eval/") -> Dict[str, float]:
        """``{prefix}accuracy``, ``{prefix}reward/mean``, ``{prefix}response_length/mean``,
        ``{prefix}pass@k`` (when ``k > 0``), ``{prefix}tool_use_rate`` (multi-turn) and
        ``{prefix}num_prompts``."""
        n = max(self.prompts, 1.0)
        out = {
            f"{prefix}accuracy": self.correct / n,
            f"{prefix}reward/mean": self.reward / n,
            f"{prefix}response_length/mean": self.response_length / n,
            f"{prefix}num_prompts": self.prompts,
        }
        if self.k > 0:
            out[f"{prefix}pass@{self.k}"] = self.pass_at_k / n
        if self.multi_turn:
            out[f"{prefix}tool_use_rate"] = self.tool_use / n
        return out


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    engine,
    prompts: Sequence[Dict[str, Any]],
    rewards,
    *,
    max_new_tokens: int,
    num_samples: int = 0,
    k: Optional[int] = None,
    correctness: Optional[str] = None,
    threshold: float = 1.0,
    batch_size: int = 32,
    generator: Optional[torch.Generator] = None,
    progress: Optional[Callable[[int], None]] = None,
    records: Optional[List[Dict[str, Any]]] = None,
    multi_turn=None,
) -> EvalSums:
    """Evaluate ``model`` on ``prompts``: greedy accuracy and reward, and pass@k from sampled completions.

    Args:
        model (torch.nn.Module): a torchtune decoder (with FSDP2: already unsharded by the caller).
        tokenizer: its tokenizer (``pad_id``, ``stop_tokens``, ``decode``).
        engine: a generation engine with ``generate(model, prompts, group_size=..., temperature=...)``.
        prompts (Sequence[Dict[str, Any]]): dataset items ``{"tokens", "prompt", "answer", ...}``.
        rewards: a :class:`~torchtune_grpo.rewards.RewardSet` (its per-component scores are read).
        max_new_tokens (int): response budget.
        num_samples (int): completions sampled per prompt for pass@k (n); 0 skips sampling. Default is 0.
        k (Optional[int]): the k of pass@k, ``1 <= k <= num_samples``. Default is None (``k = num_samples``).
        correctness (Optional[str]): the reward component deciding correctness. Default is None
            (``"correctness"``).
        threshold (float): a completion is correct when that component is ``>= threshold``. Default is 1.0.
        batch_size (int): prompts per generation call. Default is 32.
        generator (Optional[torch.Generator]): RNG for the sampled completions. Default is None.
        progress (Optional[Callable[[int], None]]): called with the number of prompts done after each
            batch (e.g. ``tqdm.update``). Default is None.
        records (Optional[List[Dict[str, Any]]]): when given, one dict per prompt is appended (prompt,
            answer, greedy completion, correct, reward). Default is None.
        multi_turn (Optional[MultiTurn]): evaluate multi-turn episodes with this environment, as trained.
            Default is None.

    Returns:
        EvalSums: sums over ``prompts`` (see :meth:`EvalSums.metrics`).

    Raises:
        ValueError: on a missing correctness component or a bad ``k``.
    """
    name = correctness_name(list(rewards.names), correctness)
    k = (num_samples if k is None else int(k)) if num_samples > 0 else 0
    if num_samples > 0 and not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    was_training = model.training
    model.eval()
    sums = EvalSums(k=k, multi_turn=multi_turn is not None)
    try:
        for start in range(0, len(prompts), batch_size):
            items = [prompts[i] for i in range(start, min(start + batch_size, len(prompts)))]
            batch = collate_prompts(items)
            greedy = sample_and_score(
                model, tokenizer, engine, batch, rewards, group_size=1, max_new_tokens=max_new_tokens,
                temperature=0.0, generator=generator, multi_turn=multi_turn,
            )
            greedy_correct = (greedy.per_component[name] >= threshold).tolist()
            greedy_total = greedy.rewards.tolist()
            sums.prompts += len(items)
            sums.correct += sum(greedy_correct)
            sums.reward += sum(greedy_total)
            sums.response_length += sum(len(r) for r in greedy.response_ids)
            if greedy.episode_info is not None:
                sums.tool_use += sum(info.get("tool_calls", 0.0) > 0 for info in greedy.episode_info)
            if num_samples > 0:
                sampled = sample_and_score(
                    model, tokenizer, engine, batch, rewards, group_size=num_samples,
                    max_new_tokens=max_new_tokens, generator=generator, multi_turn=multi_turn,
                )
                correct = (sampled.per_component[name] >= threshold).tolist()
                for i in range(len(items)):
                    c = sum(correct[i * num_samples : (i + 1) * num_samples])
                    sums.pass_at_k += pass_at_k(num_samples, c, k)
            if records is not None:
                for i, item in enumerate(items):
                    records.append(
                        {
                            "prompt": item["prompt"],
                            "answer": item.get("answer"),
                            "completion": greedy.completions[i],
                            "correct": bool(greedy_correct[i]),
                            "reward": greedy_total[i],
                        }
                    )
            if progress is not None:
                progress(len(items))
    finally:
        model.train(was_training)
    return sums


class HeldOutEvaluation:
    """Held-out evaluation during training: this rank's share of the validation prompts, evaluated with the
    run's engine, rewards and episode settings; the metrics are global (summed over ranks), the same on
    every rank.

    Args:
        prompts (Sequence[Dict[str, Any]]): this rank's validation items (every ``world_size``-th prompt).
        tokenizer: the policy's tokenizer.
        engine: the run's generation engine.
        rewards: the run's :class:`~torchtune_grpo.rewards.RewardSet`.
        num_prompts (int): validation prompts over all ranks (for the log line).
        all_reduce_sum (Callable[[List[float]], List[float]]): sums a list over ranks.
        every_n_steps (Optional[int]): evaluation period; None: only at step 0 and at the end.
        seed (int): the run's seed; evaluation samples from its own stream (``seed + 7919 (rank + 1)``) so
            it does not change the training samples drawn afterwards.
        rank (int): this process's rank.
        device (torch.device): the generator's device.
        **settings (Any): the keyword arguments of :func:`evaluate` (``max_new_tokens``, ``num_samples``, ``k``,
            ``correctness``, ``threshold``, ``batch_size``, ``multi_turn``).
    """

    def __init__(
        self, prompts: Sequence[Dict[str, Any]], *, tokenizer, engine, rewards, num_prompts: int,
        all_reduce_sum: Callable[[List[float]], List[float]], every_n_steps: Optional[int], seed: int, rank: int,
        device: torch.device, **settings: Any,
    ) -> None:
        correctness_name(list(rewards.names), settings.get("correctness"))  # fails now, not at the first evaluation
        self.prompts = list(prompts)
        self._tokenizer, self._engine, self._rewards = tokenizer, engine, rewards
        self.num_prompts = num_prompts
        self.every_n_steps = every_n_steps
        self._all_reduce_sum = all_reduce_sum
        self._seed = seed + 7919 * (rank + 1)
        self._device = device
        self._settings = settings

    @classmethod
    def from_config(
        cls, config: Any, dataset: Sequence[Dict[str, Any]], *, rank: int, world_size: int, **run: Any
    ) -> "HeldOutEvaluation":
        """This rank's share of ``dataset`` (every ``world_size``-th of its first ``eval_max_prompts`` items) with
        the recipe config's evaluation settings.

        Args:
            config (Any): a :class:`~torchtune_grpo.config.schema.RecipeConfig` (its ``eval_*`` settings and
                ``max_response_length``).
            dataset (Sequence[Dict[str, Any]]): the validation dataset, tokenized.
            rank (int): this process's rank.
            world_size (int): processes.
            **run (Any): the run's ``tokenizer``, ``engine``, ``rewards``, ``all_reduce_sum``, ``seed``, ``device``
                and ``multi_turn`` (None for single-turn episodes).

        Returns:
            HeldOutEvaluation: the evaluation of this rank's prompts.
        """
        c = config
        n = len(dataset) if c.eval_max_prompts is None else min(len(dataset), c.eval_max_prompts)
        return cls(
            [dataset[i] for i in range(rank, n, world_size)], num_prompts=n, every_n_steps=c.eval_every_n_steps,
            rank=rank, max_new_tokens=c.max_response_length, num_samples=c.eval_num_samples, k=c.eval_pass_k,
            correctness=c.eval_reward, threshold=c.eval_threshold, batch_size=c.eval_batch_size, **run,
        )

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to evaluate after training step ``step`` (the final evaluation is the caller's)."""
        return bool(self.every_n_steps) and step < total_steps and step % int(self.every_n_steps) == 0

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, generation_context: Callable[[], ContextManager]) -> Dict[str, float]:
        """Held-out metrics ``eval/*`` (greedy accuracy, mean reward, pass@k) and ``time/eval``.

        Args:
            model (torch.nn.Module): the policy (left in the mode it was in).
            generation_context (Callable[[], ContextManager]): entered around generation (FSDP2 gathers).

        Returns:
            Dict[str, float]: the metrics, the same on every rank.
        """
        t0 = time.perf_counter()
        generator = torch.Generator(device=self._device)
        generator.manual_seed(self._seed)
        with generation_context():
            sums = evaluate(
                model, self._tokenizer, self._engine, self.prompts, self._rewards, generator=generator, **self._settings
            )
        reduced = EvalSums.from_list(self._all_reduce_sum(sums.as_list()), k=sums.k, multi_turn=sums.multi_turn)
        metrics = reduced.metrics()
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics


def check_evaluation_keys(
    cfg: Any, has_validation: bool, reward_names: Sequence[str], eval_reward: Optional[str]
) -> Optional[str]:
    """Fail on an ``eval_reward`` that names no reward (before any model is built); without ``validation``,
    say which ``eval_*`` keys go unused.

    Args:
        cfg (Any): the run's config (its keys).
        has_validation (bool): whether ``validation`` is set.
        reward_names (Sequence[str]): the reward components' names.
        eval_reward (Optional[str]): the ``eval_reward`` key.

    Returns:
        Optional[str]: a note for the log, or None.

    Raises:
        ValueError: if ``eval_reward`` names no reward component.
    """
    if has_validation:
        correctness_name(list(reward_names), eval_reward)
        return None
    unused = sorted(k for k in cfg if k.startswith("eval_") and cfg[k] is not None)
    return f"No held-out evaluation (validation is not set): {unused} are not used." if unused else None
