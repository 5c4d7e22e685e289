"""From a step's scored rollouts to what the update trains on: :class:`Experience`, and :class:`ExperienceBuilder`
that builds it.

The selected :class:`~torchtune_grpo.rollouts.groups.RolloutGroups` become an :class:`Experience`:

1. the training layout (:class:`~torchtune_grpo.training.batch.TrainingBatch`; with ``share_prompt`` a micro-batch's
   completions of one prompt share one row, the prompt computed once);
2. the loss mask: response tokens, minus the environment's tokens of multi-turn episodes (context, not
   actions), minus truncated completions with ``mask_truncated`` (DAPO's overlong filtering: they leave
   the loss and the sequence count but still shaped their group's advantage baseline);
3. reference logprobs (a frozen model, or the policy in a context such as LoRA's adapters switched off;
   none without a KL term) and ``pi_old``'s logprobs when anything needs them before the update;
4. the advantage signal (the weighted reward, or GDPO's normalised components), the KL penalty taken off
   each sequence's reward with ``kl_placement: reward``, and the advantages (batch statistics global);
5. the masks and weights decided from ``pi_old`` before the update (rollout correction, token selection).

Collectives are passed in (``all_reduce``, ``all_gather``), so the same code runs on one process, on N,
and in benchmarks and tests without a process group.
"""

from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.rollouts.advantages import advantage_signal, RewardStats
from torchtune_grpo.models.logprobs import TokenLogprobs
from torchtune_grpo.loss import kl_reward_penalty
from torchtune_grpo.loss.masks import LossMasks
from torchtune_grpo.metrics.sums import one_process_sum, StepSums
from torchtune_grpo.metrics.timing import device_clock
from torchtune_grpo.training.micro_batches import MicroBatchPlan
from torchtune_grpo.training.batch import batch_logprobs, batch_token_logprobs, TrainingBatch
from torchtune_grpo.training.routes import expert_fractions
from torchtune_grpo.rollouts.groups import RolloutGroups

__all__ = ["BuiltExperience", "Experience", "ExperienceBuilder", "Reference"]


@dataclass
class Experience:
    """The rows a step trains on, laid out for the update. ``N`` sequences, ``T`` logprob columns.

    Attributes:
        batch (TrainingBatch): the ``N`` sequences in the training layout.
        mask (torch.Tensor): ``[N, T]`` bool, the tokens the loss sees (response tokens of kept rows, minus
            what the rollout correction or the token selection removed).
        kept (torch.Tensor): ``[N]`` bool, the sequences that count in the loss's sequence count.
        advantages (torch.Tensor): ``[N]`` per-sequence advantages, or ``[N, T]`` per-token ones (a
            token-level estimator over step scores, in the logprob layout, 0 off the response), on the
            training device.
        old_logprobs (Optional[torch.Tensor]): ``[N, T]`` logprobs under the sampling policy, or None when
            the update takes one optimizer step (the current policy *is* the old one: ratio 1).
        ref_logprobs (Optional[torch.Tensor]): ``[N, T]`` reference-policy logprobs, or None (no KL term).
        engine_logprobs (Optional[torch.Tensor]): ``[N, T]`` the generation engine's sampling logprobs (an
            engine with its own weights; truncated importance sampling and the mismatch metric), or None.
        importance_weights (Optional[torch.Tensor]): ``[N, T]`` constants multiplying each token's policy
            term (the rollout correction's), or None. Default is None.
        metric_sums (StepSums): this rank's quantities of what was decided before the update (rollout
            correction, per-component advantages), reduced with the step's metrics. Default is empty.
        seconds (Dict[str, float]): this rank's time building it by phase (``time/reference``,
            ``time/old_logprobs``: the no-grad forwards, device work included). Default is empty.
        expert_fractions (Optional[torch.Tensor]): ``[layers, E]`` a mixture-of-experts batch's routing-assignment
            fractions over every process's real tokens, from the engine's routes (the load-balancing loss's
            constant ``f``; not per row), or None. Default is None.
    """

    batch: TrainingBatch
    mask: torch.Tensor
    kept: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    engine_logprobs: Optional[torch.Tensor]
    importance_weights: Optional[torch.Tensor] = None
    metric_sums: StepSums = field(default_factory=StepSums)
    seconds: Dict[str, float] = field(default_factory=dict)
    expert_fractions: Optional[torch.Tensor] = field(default=None, metadata={"per_row": False})

    def __len__(self) -> int:
        return len(self.batch)

    def select(self, rows: torch.Tensor, row_width: Optional[int] = None) -> "Experience":
        """The experience of ``rows`` (``[n]`` indices into the ``N`` rows, in that order; ``row_width`` as
        :meth:`TrainingBatch.select`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        per_row = {f.name for f in fields(self) if f.metadata.get("per_row", True)}
        for name, value in out.items():
            if isinstance(value, torch.Tensor) and name in per_row:
                out[name] = value[rows.to(value.device)]
        out["batch"] = self.batch.select(rows.tolist(), row_width=row_width)
        return replace(self, **out)


def _local_gather(values: torch.Tensor) -> torch.Tensor:
    return values


class Reference(NamedTuple):
    """The policy the KL term is measured against.

    Attributes:
        model (nn.Module): a frozen model, or the policy itself (then ``context`` changes what it computes).
        context (Callable[[], ContextManager]): entered around its forwards, e.g. LoRA's "adapters off".
            Default is no context.
    """

    model: nn.Module
    context: Callable[[], ContextManager] = nullcontext


class BuiltExperience(NamedTuple):
    """What :class:`ExperienceBuilder` returns.

    Attributes:
        experience (Experience): the update's input.
        kl_penalty (torch.Tensor): ``[N]`` the per-sequence KL penalty taken off the rewards (zeros unless
            ``kl_placement: reward``), for the metrics.
    """

    experience: Experience
    kl_penalty: torch.Tensor


class ExperienceBuilder:
    """Selected rollouts -> :class:`Experience` (see the module docstring).

    Args:
        advantage: the advantage estimator (``advantage(rewards [N], group_size, batch_stats=...)``), or a
            token-level one (``token_level = True``: ``advantage(outcome [N], step_scores, step_ends,
            response_lengths, group_size)``, :mod:`~torchtune_grpo.rollouts.process_advantages`).
        reward_weights (Sequence[float]): each reward component's weight (GDPO's signal).
        group_size (int): completions per prompt.
        pad_id (int): the tokenizer's pad id.
        loss_masks (LossMasks): rollout correction and token selection.
        micro_batch_size (int): rows per logprob forward (with ``max_tokens_per_micro_batch``: at most).
        temperature (float): the sampling temperature the logprobs are computed at (> 0).
        device (torch.device): the training device.
        chunk_size (int): positions per log-softmax chunk. Default is 512.
        share_prompt (bool): the shared-prompt training layout. Default is True.
        pack_sequences (bool): without ``share_prompt``, pack several sequences per row
            (:mod:`~torchtune_grpo.training.packed_rows`). Default is False.
        packed_attention (str): packed rows' attention, ``"sdpa"`` or ``"flex"`` (FlexAttention on CUDA).
            Default is ``"sdpa"``.
        max_tokens_per_micro_batch (Optional[int]): logprob forwards by token budget (padding included,
            :mod:`~torchtune_grpo.training.micro_batches`; the same number on every rank); None: ``micro_batch_size``
            rows each. Default is None.
        mask_truncated (bool): DAPO's overlong filtering. Default is False.
        kl_coef (float): weight of the KL penalty (0: none). Default is 0.
        kl_estimator (str): ``k1``, ``k2`` or ``k3``. Default is ``"k3"``.
        kl_in_reward (bool): the KL penalty goes into each sequence's reward, not the loss. Default is False.
        reference (Optional[Reference]): where reference logprobs come from; None: no reference (no KL).
            Default is None.
        update_needs_old_logprobs (bool): the update takes more than one optimizer step per rollout, so it
            needs ``pi_old`` (``PolicyUpdate.needs_old_logprobs``). Default is False.
        all_reduce (Callable[[List[float]], List[float]]): sums floats over ranks (batch statistics).
            Default is the identity (one process).
        all_gather (Callable[[torch.Tensor], torch.Tensor]): concatenates a 1-D CPU tensor of every rank
            (token selection's global threshold). Default is the identity.
        routing_replay (bool): ``moe.routing_replay: rollout``: force the engine's routes in the reference and
            old forwards (and, through the batch, the update's). Default is False.
        num_experts (Optional[int]): a mixture-of-experts policy's experts per layer: the batch's assignment
            fractions are measured from the engine's routes (the load-balancing loss). None: a dense policy.
            Default is None.
    """

    def __init__(
        self,
        *,
        advantage: Any,
        reward_weights: Sequence[float],
        group_size: int,
        pad_id: int,
        loss_masks: LossMasks,
        micro_batch_size: int,
        temperature: float,
        device: torch.device,
        chunk_size: int = 512,
        share_prompt: bool = True,
        pack_sequences: bool = False,
        packed_attention: str = "sdpa",
        max_tokens_per_micro_batch: Optional[int] = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_in_reward: bool = False,
        reference: Optional[Reference] = None,
        update_needs_old_logprobs: bool = False,
        all_reduce: Callable[[List[float]], List[float]] = one_process_sum,
        all_gather: Callable[[torch.Tensor], torch.Tensor] = _local_gather,
        routing_replay: bool = False,
        num_experts: Optional[int] = None,
    ) -> None:
        self.advantage = advantage
        self.reward_weights = list(reward_weights)
        self.group_size = int(group_size)
        self.pad_id = pad_id
        self.loss_masks = loss_masks
        self.micro_batch_size = int(micro_batch_size)
        self.temperature = float(temperature)
        self.device = device
        self.chunk_size = int(chunk_size)
        self.share_prompt = bool(share_prompt)
        self.pack_sequences = bool(pack_sequences)
        self.packed_attention = packed_attention
        self.max_tokens = None if max_tokens_per_micro_batch is None else int(max_tokens_per_micro_batch)
        self.mask_truncated = bool(mask_truncated)
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.kl_in_reward = bool(kl_in_reward)
        self.reference = reference
        self.update_needs_old_logprobs = bool(update_needs_old_logprobs)
        self.all_reduce = all_reduce
        self.all_gather = all_gather
        self.routing_replay = bool(routing_replay)
        self.num_experts = num_experts

    def logprobs(
        self, model: nn.Module, layout: "TrainingBatch | torch.Tensor", start: int = 0,
        plan: Optional[MicroBatchPlan] = None,
    ) -> torch.Tensor:
        """Logprobs ``[N, T]`` of a ``TrainingBatch`` (or of packed rows ``[N, L]`` from ``start``), no grad;
        micro-batches of ``plan`` (:meth:`plan`) when given."""
        if isinstance(layout, torch.Tensor):
            layout = TrainingBatch.from_tokens(layout, start)
        return batch_logprobs(
            model, layout, micro_batch_size=self.micro_batch_size, temperature=self.temperature,
            chunk_size=self.chunk_size, plan=plan,
        )

    def planned_logprobs(self, model: nn.Module, layout: TrainingBatch) -> torch.Tensor:
        """:meth:`logprobs` in the micro-batches :meth:`plan` gives (as pi_old's pass): the same values to the
        last bit for the same weights (one all-reduce with a token budget: every rank calls it)."""
        return self.logprobs(model, layout, plan=self.plan(layout))

    def plan(self, layout: TrainingBatch) -> Optional[MicroBatchPlan]:
        """The token-budget micro-batches of ``layout`` (one all-reduce agrees on their number), or None
        without ``max_tokens_per_micro_batch``."""
        if self.max_tokens is None:
            return None
        return layout.plan(max_tokens=self.max_tokens, max_rows=self.micro_batch_size, all_reduce=self.all_reduce)

    def reference_logprobs(
        self, layout: "TrainingBatch | torch.Tensor", start: int = 0, plan: Optional[MicroBatchPlan] = None
    ) -> Optional[torch.Tensor]:
        """Reference logprobs ``[N, T]`` of ``layout`` (in eval mode, inside the reference's context); None
        without a reference."""
        if self.reference is None:
            return None
        model = self.reference.model
        was_training = model.training
        model.eval()
        try:
            with self.reference.context():
                return self.logprobs(model, layout, start, plan)
        finally:
            model.train(was_training)

    def needs_old_logprobs(self, has_engine_logprobs: bool) -> bool:
        """Whether anything needs ``pi_old``'s logprobs before the update (see :meth:`old_logprobs`)."""
        return (
            self.update_needs_old_logprobs or self.kl_in_reward
            or self.loss_masks.needs_old_logprobs(has_engine_logprobs)
        )

    def old_logprobs(
        self, policy: nn.Module, layout: TrainingBatch, has_engine_logprobs: bool,
        plan: Optional[MicroBatchPlan] = None,
    ) -> TokenLogprobs:
        """``pi_old``'s logprobs (and, for token selection, entropy) ``[N, T]``; None fields when not needed.

        With a single optimizer step the old policy *is* the current one (ratio 1): no extra forward,
        unless the KL penalty in the reward or a loss mask needs ``pi_old`` before the update.
        """
        if not self.needs_old_logprobs(has_engine_logprobs):
            return TokenLogprobs(None, None)
        return batch_token_logprobs(
            policy, layout, micro_batch_size=self.micro_batch_size, temperature=self.temperature,
            chunk_size=self.chunk_size, with_entropy=self.loss_masks.needs_entropy, plan=plan,
        )

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages ``[N]`` of this rank's sequences; batch-level statistics are global (all-reduced)."""
        if not getattr(self.advantage, "uses_batch_stats", False):
            return self.advantage(rewards, self.group_size).advantages
        stats = RewardStats(*self.all_reduce(list(RewardStats.of(rewards))))
        return self.advantage(rewards, self.group_size, batch_stats=stats).advantages

    def token_advantages(self, trained: RolloutGroups, kl_penalty: torch.Tensor, layout: TrainingBatch) -> torch.Tensor:
        """Token-level advantages ``[N, T]`` (in ``layout``'s columns) from the step-level reward's steps.

        The outcome is the weighted sum of the other reward components, less the KL penalty with
        ``kl_placement: reward``; the step component's own weight only scales its share of the logged total.

        Raises:
            ValueError: when the rollouts carry no step scores (no step-level reward configured).
        """
        if trained.step_scores is None or trained.step_ends is None:
            raise ValueError(
                f"advantage {type(self.advantage).__name__} needs a step-level reward in reward_functions (e.g. "
                "torchtune_grpo.rewards.PythonStepReward or PRMStepReward): these rollouts have no step scores"
            )
        outcome = torch.zeros(len(trained.response_ids), dtype=torch.float64)
        for (name, values), w in zip(trained.per_component.items(), self.reward_weights):
            if name != trained.step_component:
                outcome += w * values.double()
        outcome = outcome - kl_penalty.double()
        out = self.advantage(
            outcome, trained.step_scores, trained.step_ends, [len(r) for r in trained.response_ids], self.group_size
        )
        rows = [out.advantages[i, : len(r)].tolist() for i, r in enumerate(trained.response_ids)]
        return layout.response_values(rows)  # [N, T]

    def __call__(self, policy: nn.Module, trained: RolloutGroups) -> BuiltExperience:
        """Lay out ``trained`` for the update (the policy is left in train mode).

        Args:
            policy (nn.Module): the policy (``pi_old``: the weights that sampled ``trained``).
            trained (RolloutGroups): the groups the step trains on.

        Returns:
            BuiltExperience: the experience and the per-sequence KL penalty ``[N]``.
        """
        n = len(trained.response_ids)
        layout = TrainingBatch(
            trained.prompt_ids, trained.response_ids, self.pad_id, share_prompt=self.share_prompt,
            pack=self.pack_sequences, device=self.device, packed_attention=self.packed_attention,
            routed_experts=trained.routed_experts, replay=self.routing_replay, images=row_images(trained),
        )
        fractions = None  # [layers, E] the load-balancing loss's f: the engine's routes over every process's batch
        if self.num_experts is not None and layout.routes is not None:
            fractions = expert_fractions(layout.routes, layout.lengths, self.num_experts, self.all_reduce)
        kept = ~trained.truncated if self.mask_truncated else torch.ones(n, dtype=torch.bool)
        kept = kept.to(self.device)  # [N]
        actions = layout.response_mask  # [N, T]
        if trained.action_mask is not None:  # multi-turn: the environment's tokens are context, not actions
            actions = actions & layout.response_values(trained.action_mask).bool()
        mask = actions & kept.unsqueeze(1)  # [N, T]

        # [N, T] the engine's sampling logprobs (vLLM; TIS, rollout correction, logprob_mismatch) or None
        engine_logprobs = None
        if trained.engine_logprobs is not None:
            engine_logprobs = layout.response_values(trained.engine_logprobs)
        plan = None  # token-budget micro-batches of the no-grad forwards (one all-reduce), when any runs
        if self.reference is not None or self.needs_old_logprobs(engine_logprobs is not None):
            plan = self.plan(layout)
        t0 = device_clock(self.device)
        ref_logprobs = self.reference_logprobs(layout, plan=plan)  # [N, T] or None
        t1 = device_clock(self.device)
        policy.train()
        old = self.old_logprobs(policy, layout, engine_logprobs is not None, plan)  # pi_old [N, T] (+ entropy)
        seconds = {"time/reference": t1 - t0, "time/old_logprobs": device_clock(self.device) - t1}
        rewards, components = advantage_signal(  # the weighted sum, or GDPO's normalised components
            self.advantage, trained.rewards, trained.per_component, self.reward_weights, self.group_size
        )
        kl_penalty = torch.zeros(n)
        if self.kl_in_reward:
            kl_penalty = kl_reward_penalty(old.logprobs, ref_logprobs, actions, self.kl_coef, self.kl_estimator).cpu()
            rewards = rewards - kl_penalty
        if getattr(self.advantage, "token_level", False):  # from step scores: [N, T]
            advantages = self.token_advantages(trained, kl_penalty, layout)
        else:
            advantages = self.advantages(rewards).to(self.device)  # [N]
        # Rollout correction and token selection, decided before the update: the update's global
        # token/sequence counts (per mini-batch, torchtune_grpo/training/update.py) include them.
        masks = self.loss_masks(
            mask, kept, advantages, old_logprobs=old.logprobs, old_entropy=old.entropy,
            engine_logprobs=engine_logprobs, gather=self.all_gather,
        )
        experience = Experience(
            batch=layout, mask=masks.mask, kept=masks.kept, advantages=advantages,
            old_logprobs=old.logprobs, ref_logprobs=ref_logprobs, engine_logprobs=engine_logprobs,
            importance_weights=masks.weights,
            metric_sums=masks.sums.merge(components.sums()) if components is not None else masks.sums,
            seconds=seconds, expert_fractions=fractions,
        )
        return BuiltExperience(experience, kl_penalty)


def row_images(groups: Any) -> Optional[List[Optional[Dict[str, torch.Tensor]]]]:
    """Each sequence's prompt image inputs (its group's ``image_inputs`` field), or None when no prompt has any."""
    per_group = [f.get("image_inputs") for f in groups.fields]
    if all(i is None for i in per_group):
        return None
    return [per_group[i // groups.group_size] for i in range(len(groups.response_ids))]
