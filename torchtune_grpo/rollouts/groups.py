"""A step's scored rollout, and the one function that samples and scores completions.

:class:`RolloutGroups` is what leaves the rollout stage: ``group_size`` completions per prompt with their
token ids, text, rewards, truncation, the engine's sampling logprobs (an engine with its own weights,
vLLM) and how long generating and scoring took. Dynamic sampling selects from it, the training layout
and the metrics read it.

:func:`sample_and_score` is how every part of the project gets one: training rollouts (the recipe),
held-out evaluation (:mod:`torchtune_grpo.rollouts.evaluation`) and rejection sampling
(:mod:`torchtune_grpo.rollouts.rejection_sampling`) all sample, decode and score through it.
"""

import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.data import PromptBatch
from torchtune_grpo.generation import decode_responses, GenerationEngine
from torchtune_grpo.multiturn import MultiTurn
from torchtune_grpo.rewards import RewardBatch, RewardSet, token_offsets

__all__ = ["RolloutGroups", "sample_and_score"]


@dataclass
class RolloutGroups:
    """Scored completions of ``num_groups`` prompts, ``group_size`` each: what generation rounds produced.

    Row ``i`` (of ``N = num_groups x group_size``) answers prompt ``i // group_size``.

    Attributes:
        group_size (int): completions per prompt, ``G``.
        prompts (List[str]): prompt text, one per group.
        fields (List[Dict[str, Any]]): the prompt's dataset columns, one per group.
        prompt_ids (List[List[int]]): prompt token ids, one per row.
        response_ids (List[List[int]]): completion token ids, one per row.
        completions (List[str]): decoded completions, one per row.
        truncated (torch.Tensor): ``[N]`` bool, True where no stop token came within the budget.
        rewards (torch.Tensor): ``[N]`` float32, the weighted sum of the reward components.
        per_component (Dict[str, torch.Tensor]): each component's ``[N]`` scores.
        errors (Dict[str, int]): samples given the fallback, per component, counted when scored (a
            selection keeps the counts of everything that was scored).
        engine_logprobs (Optional[List[List[float]]]): per row, the engine's log-probability of each sampled
            response token (an engine with its own weights, e.g. vLLM); None when the engine samples with the
            trainer's model (:class:`~torchtune_grpo.generation.Rollout`'s ``logprobs``). Default is None.
        generation_seconds (float): time spent generating (a selection keeps the total of everything
            generated). Default is 0.
        reward_seconds (float): time spent decoding and scoring. Default is 0.
        action_mask (Optional[List[List[int]]]): multi-turn episodes: per row and response token, 1 where the
            model sampled it, 0 where the environment injected it (context: no loss term, not counted). None:
            every response token is the model's. Default is None.
        conversations (Optional[List[List[Dict[str, Any]]]]): multi-turn episodes: each row's messages after
            the prompt (the model's turns and the environment's replies). Default is None.
        episode_info (Optional[List[Dict[str, float]]]): multi-turn episodes: per row, ``turns``,
            ``env_error`` (0/1), ``injected_tokens`` and the environment's summed step infos. Default is None.
        environment_seconds (float): multi-turn episodes: time spent waiting for the environment (part of
            ``generation_seconds``). Default is 0.
        weight_versions (Optional[List[int]]): per row, the training steps the weights that sampled it had
            taken (a generation worker's, torchtune_grpo/workers/client.py); None when sampled with the
            trainer's current weights. Default is None.
        token_versions (Optional[List[List[int]]]): per row and response token, the version of the weights that
            sampled it, where one completion may span several (a generation worker with
            ``generation_workers.in_flight_updates``: training steps; ``weight_versions`` is then each row's
            oldest). None otherwise. Default is None.
        step_scores (Optional[List[List[float]]]): per row, the step-level reward's score of each step of the
            completion (:class:`~torchtune_grpo.rewards.StepReward`); None without a step-level reward.
            Default is None.
        step_ends (Optional[List[List[int]]]): per row, the response-token index of each step's last token.
            Default is None.
        step_component (Optional[str]): the step-level reward's name. Default is None.
        routed_experts (Optional[List[torch.Tensor]]): a mixture-of-experts engine's routes, per row int16
            ``[prompt + response, layers, top_k]`` (:class:`~torchtune_grpo.generation.Rollout`'s), or None.
            Default is None.
    """

    group_size: int = field(metadata={"kind": "constant"})
    prompts: List[str] = field(metadata={"kind": "group"})
    fields: List[Dict[str, Any]] = field(metadata={"kind": "group"})
    prompt_ids: List[List[int]] = field(metadata={"kind": "row"})
    response_ids: List[List[int]] = field(metadata={"kind": "row"})
    completions: List[str] = field(metadata={"kind": "row"})
    truncated: torch.Tensor = field(metadata={"kind": "row"})
    rewards: torch.Tensor = field(metadata={"kind": "row"})
    per_component: Dict[str, torch.Tensor] = field(default_factory=dict, metadata={"kind": "rows_by_name"})
    errors: Dict[str, int] = field(default_factory=dict, metadata={"kind": "count"})
    engine_logprobs: Optional[List[List[float]]] = field(default=None, metadata={"kind": "row"})
    generation_seconds: float = field(default=0.0, metadata={"kind": "total"})
    reward_seconds: float = field(default=0.0, metadata={"kind": "total"})
    action_mask: Optional[List[List[int]]] = field(default=None, metadata={"kind": "row"})
    conversations: Optional[List[List[Dict[str, Any]]]] = field(default=None, metadata={"kind": "row"})
    episode_info: Optional[List[Dict[str, float]]] = field(default=None, metadata={"kind": "row"})
    environment_seconds: float = field(default=0.0, metadata={"kind": "total"})
    weight_versions: Optional[List[int]] = field(default=None, metadata={"kind": "row"})
    token_versions: Optional[List[List[int]]] = field(default=None, metadata={"kind": "row"})
    step_scores: Optional[List[List[float]]] = field(default=None, metadata={"kind": "row"})
    step_ends: Optional[List[List[int]]] = field(default=None, metadata={"kind": "row"})
    step_component: Optional[str] = field(default=None, metadata={"kind": "constant"})
    routed_experts: Optional[List[torch.Tensor]] = field(default=None, metadata={"kind": "row"})

    # Each field's "kind" says how select and concat carry it, so a new field is one line here:
    # constant (the same in every part), group (one per prompt), row (one per completion: a list or a
    # tensor, or None when a part lacks it), rows_by_name (a dict of per-row tensors), count and total
    # (what was scored or timed: kept whole by a selection, summed by concat).

    @property
    def num_groups(self) -> int:
        """Number of prompt groups."""
        return len(self.prompts)

    def select(self, groups: Sequence[int]) -> "RolloutGroups":
        """The given groups, in that order (errors and timings: those of everything scored)."""
        rows = [gi * self.group_size + j for gi in groups for j in range(self.group_size)]
        index = torch.tensor(rows, dtype=torch.long)

        def take(value: Any, which: List[int]) -> Any:
            if value is None:
                return None
            if isinstance(value, torch.Tensor):
                return value[torch.tensor(which, dtype=torch.long)]
            return [value[i] for i in which]

        out = {}
        for f in fields(self):
            kind, value = f.metadata["kind"], getattr(self, f.name)
            if kind == "group":
                out[f.name] = take(value, list(groups))
            elif kind == "row":
                out[f.name] = take(value, rows)
            elif kind == "rows_by_name":
                out[f.name] = {k: v[index] for k, v in value.items()}
            else:  # constant, count, total
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return RolloutGroups(**out)

    @staticmethod
    def concat(parts: Sequence["RolloutGroups"]) -> "RolloutGroups":
        """The groups of several rounds, one after the other (errors and timings are summed)."""
        if not parts:
            raise ValueError("concat needs at least one RolloutGroups")
        if len(parts) == 1:
            return parts[0]
        out: Dict[str, Any] = {}
        for f in fields(RolloutGroups):
            kind, values = f.metadata["kind"], [getattr(p, f.name) for p in parts]
            if kind == "constant":
                out[f.name] = values[0]
            elif kind in ("group", "row"):
                if any(v is None for v in values):  # e.g. engine logprobs from some rounds only
                    out[f.name] = None
                elif isinstance(values[0], torch.Tensor):
                    out[f.name] = torch.cat(values)
                else:
                    out[f.name] = [x for v in values for x in v]
            elif kind == "rows_by_name":
                out[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
            elif kind == "count":
                counts: Dict[str, int] = {}
                for v in values:
                    for k, c in v.items():
                        counts[k] = counts.get(k, 0) + int(c)
                out[f.name] = counts
            else:  # total
                out[f.name] = sum(values)
        return RolloutGroups(**out)


def sample_and_score(
    model: nn.Module,
    tokenizer,
    engine: GenerationEngine,
    batch: PromptBatch,
    rewards: RewardSet,
    *,
    group_size: int,
    max_new_tokens: int,
    generator: Optional[torch.Generator] = None,
    temperature: Optional[float] = None,
    generation_context: Optional[ContextManager] = None,
    multi_turn: Optional[MultiTurn] = None,
) -> RolloutGroups:
    """Sample ``group_size`` completions for each prompt of ``batch``, decode them and score them.

    Args:
        model (nn.Module): the policy (the engine samples with it, or ignores it when it holds its own
            weights). The caller puts it in eval mode.
        tokenizer: its tokenizer (``pad_id``, ``stop_tokens``, ``decode``).
        engine (GenerationEngine): the generation engine.
        batch (PromptBatch): the prompts (``collate_prompts``).
        rewards (RewardSet): the reward functions.
        group_size (int): completions per prompt, ``G``.
        max_new_tokens (int): the response budget.
        generator (Optional[torch.Generator]): sampling RNG. Default is None.
        temperature (Optional[float]): override the engine's temperature (0: greedy); None leaves the
            engine's. Default is None.
        generation_context (Optional[ContextManager]): entered around the generation call only, and counted
            in its time (the recipe's FSDP2 unshard). Default is None.
        multi_turn (Optional[MultiTurn]): run multi-turn episodes with this environment instead of single
            completions (:mod:`torchtune_grpo.multiturn`): rewards score each episode's final answer and see
            the conversation as ``fields["conversation"]`` (``fields["episode"]``: turns, errors, infos); an
            episode the environment failed gets the reward set's fallback. Default is None.

    Returns:
        RolloutGroups: ``len(batch.tokens) x group_size`` scored rows, with timings.
    """
    t0 = time.perf_counter()
    # Only an override is passed: an engine's generate need not take `temperature`.
    kwargs = {} if temperature is None else {"temperature": temperature}
    images = [f.get("image_inputs") for f in batch.fields]
    if multi_turn is not None:  # the episodes take each prompt's images from its fields
        return _sample_and_score_episodes(
            model, tokenizer, engine, batch, rewards, multi_turn, group_size=group_size,
            max_new_tokens=max_new_tokens, generator=generator, temperature=temperature,
            generation_context=generation_context,
        )
    if any(i is not None for i in images):  # prompts with images: only engines that take them (the native engine)
        kwargs["images"] = images
    with generation_context if generation_context is not None else nullcontext():
        rollout = engine.generate(
            model,
            batch.tokens,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_id,
            stop_tokens=tokenizer.stop_tokens,
            generator=generator,
            **kwargs,
        )
    t1 = time.perf_counter()
    completions = decode_responses(tokenizer, rollout.response_ids)
    offsets = None
    if getattr(rewards, "step_component", None) is not None:  # step boundaries are token positions
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        offsets = [token_offsets(decode, ids, text) for ids, text in zip(rollout.response_ids, completions)]
    scored = rewards(
        RewardBatch.for_groups(batch.prompts, batch.fields, completions, rollout.response_ids, group_size, offsets)
    )
    t2 = time.perf_counter()
    return RolloutGroups(
        group_size=group_size,
        prompts=list(batch.prompts),
        fields=list(batch.fields),
        prompt_ids=rollout.prompt_ids,
        response_ids=rollout.response_ids,
        completions=completions,
        truncated=rollout.truncated.cpu().bool(),
        rewards=scored.total,
        per_component=scored.per_component,
        errors=scored.errors,
        engine_logprobs=rollout.logprobs,
        token_versions=rollout.token_versions,
        routed_experts=rollout.routed_experts,
        generation_seconds=t1 - t0,
        reward_seconds=t2 - t1,
        **_step_fields(scored),
    )


def _step_fields(scored: Any) -> Dict[str, Any]:
    """The step-level reward's steps as :class:`RolloutGroups` fields (none without one)."""
    steps = getattr(scored, "steps", None)
    if steps is None:
        return {}
    return {
        "step_scores": [list(s.scores) for s in steps],
        "step_ends": [list(s.ends) for s in steps],
        "step_component": scored.step_component,
    }


def _sample_and_score_episodes(
    model: nn.Module,
    tokenizer,
    engine: GenerationEngine,
    batch: PromptBatch,
    rewards: RewardSet,
    multi_turn: MultiTurn,
    *,
    group_size: int,
    max_new_tokens: int,
    generator: Optional[torch.Generator],
    temperature: Optional[float],
    generation_context: Optional[ContextManager],
) -> RolloutGroups:
    """:func:`sample_and_score` for multi-turn episodes (generation time includes the environment's)."""
    if getattr(rewards, "step_component", None) is not None:
        raise ValueError(
            f"the step-level reward {rewards.step_component!r} does not work with multi-turn episodes yet (its "
            "steps would span the environment's tokens): remove it or the environment"
        )
    t0 = time.perf_counter()
    with generation_context if generation_context is not None else nullcontext():
        episodes = multi_turn.run(
            engine, model, tokenizer, batch.tokens, batch.fields, group_size=group_size,
            max_new_tokens=max_new_tokens, generator=generator, temperature=temperature,
        )
    t1 = time.perf_counter()
    n = len(episodes.response_ids)
    info = [
        {
            **episodes.info[i],
            "turns": float(episodes.turns[i]),
            "env_error": float(bool(episodes.env_errors[i])),
            "injected_tokens": float(episodes.action_mask[i].count(0)),
        }
        for i in range(n)
    ]
    row_fields = [
        {**batch.fields[i // group_size], "conversation": episodes.messages[i],
         "episode": {**info[i], "error": episodes.env_errors[i]}}
        for i in range(n)
    ]
    scored = rewards(
        RewardBatch(
            prompts=[batch.prompts[i // group_size] for i in range(n)],
            completions=episodes.final_answers(),
            completion_ids=episodes.response_ids,
            fields=row_fields,
        )
    )
    failed = torch.tensor([bool(e) for e in episodes.env_errors], dtype=torch.bool)
    total = torch.where(failed, torch.full_like(scored.total, float(rewards.fallback)), scored.total)
    # The components too (each its own fallback): GDPO's advantage signal and the per-component metrics
    # read them, and must not score a failed episode's partial answer.
    fallbacks = dict(zip(rewards.names, rewards.fallbacks))
    per_component = {
        name: torch.where(failed, torch.full_like(values, fallbacks[name]), values)
        for name, values in scored.per_component.items()
    }
    t2 = time.perf_counter()
    return RolloutGroups(
        group_size=group_size,
        prompts=list(batch.prompts),
        fields=list(batch.fields),
        prompt_ids=episodes.prompt_ids,
        response_ids=episodes.response_ids,
        completions=decode_responses(tokenizer, episodes.response_ids),
        truncated=episodes.truncated,
        rewards=total,
        per_component=per_component,
        errors={**scored.errors, "environment": int(failed.sum())},
        engine_logprobs=episodes.logprobs,
        generation_seconds=t1 - t0,
        reward_seconds=t2 - t1,
        action_mask=episodes.action_mask,
        conversations=episodes.messages,
        episode_info=info,
        environment_seconds=episodes.env_seconds,
    )
