"""What a run optimises, as plain values: :class:`AlgorithmSpec`, built from the recipe's components, config and
run facts; :mod:`~torchtune_grpo.config.algorithm_card` writes the card from it."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["AlgorithmSpec", "config_values"]


@dataclass
class AlgorithmSpec:
    """Plain values that define a GRPO run (all from the resolved config and the instantiated components).

    Attributes:
        world_size (int): processes.
        batch_size (int): prompts per process per optimizer step.
        group_size (int): completions per prompt, ``G``.
        micro_batch_size (int): sequences per forward/backward.
        ppo_epochs (int): passes over each step's rollouts.
        max_response_length (int): generation budget in tokens.
        advantage (str): the advantage estimator's formula.
        rewards (List[Tuple[str, float]]): reward components as ``(name, weight)``.
        step_reward (Optional[str]): the step-level reward component's name, or None. Default is None.
        token_level_advantage (bool): the advantage is per token, from step scores. Default is False.
        loss_agg_mode (Optional[str]): None for a loss component without one (then only ``loss_name`` is
            reported).
        loss_name (str): the loss component. Default is ``"GRPOLoss"``.
        epsilon_low (float): lower clip range. Default is 0.2.
        epsilon_high (float): upper clip range. Default is 0.2.
        dual_clip (Optional[float]): dual-clip bound. Default is None.
        tis_cap (Optional[float]): truncated importance sampling cap against the engine's sampling
            logprobs. Default is None (off).
        ratio_level (str): ``"token"`` or ``"sequence"``. Default is ``"token"``.
        rollout_correction (Optional[List[str]]): the rollout correction's ``formula_lines()``. Default is
            None (none).
        token_selection (Optional[str]): the token selection's ``formula_line()``. Default is None (none).
        policy_lines (Optional[List[str]]): the ratio and policy-term lines of the loss component's
            ``formula_lines()``; None renders GRPOLoss's PPO clip from the clip fields above. Default is None.
        entropy_coef (float): entropy bonus weight. Default is 0.0.
        kl_coef (float): KL weight. Default is 0.0.
        kl_estimator (str): KL estimator. Default is ``"k3"``.
        kl_placement (str): ``"loss"`` or ``"reward"``. Default is ``"loss"``.
        reference_model (bool): whether a reference model is loaded. Default is False.
        reference_description (str): what the reference policy is, when there is one. Default is
            "loaded (frozen copy of the initial policy)".
        mask_truncated_completions (bool): truncated completions are left out of the loss. Default is
            False.
        dynamic_sampling (bool): DAPO dynamic sampling on. Default is False.
        max_rounds (int): generation rounds per step at most. Default is 1.
        optimizer (str): optimizer description. Default is ``""``.
        clip_grad_norm (Optional[float]): gradient norm clipping. Default is None.
        on_nonfinite (str): a NaN/inf gradient norm ``"stop"``s the run or ``"skip"``s the optimizer step.
            Default is ``"stop"``.
        environment (Optional[str]): multi-turn episodes: the environment and its limits, e.g.
            ``"ToolEnvironment, at most 4 turns"``. Default is None (one completion per sample).
        ppo_mini_batches (int): disjoint mini-batches per pass, one optimizer step each. Default is 1.
        ppo_mini_batch_shuffle (bool): groups reshuffled across mini-batches before every pass. Default is
            True.
        precision (Optional[str]): the training precision (``Precision.describe()``). Default is None.
        policy_model (Optional[str]): which module the policy is (torchtune's or transformers' own, and its
            attention implementation). Default is None.
        max_staleness (Optional[int]): rollouts from generation workers at this bound (docs/async.md); None:
            sampled by the trainer's own weights. Default is None.
        in_flight_updates (bool): generation workers take new weights while they generate (partial rollouts).
            Default is False.
        max_tokens_per_micro_batch (Optional[int]): micro-batches by token budget (their number then
            depends on the lengths). Default is None (``micro_batch_size`` rows each).
        weight_sync (Optional[str]): how an engine with its own weights (vLLM) gets the policy
            (``WeightPublisher.describe``). Default is None (the engine samples with the trainer's model).
        routing_replay (Optional[str]): a mixture-of-experts policy's ``moe.routing_replay`` (``"off"`` or
            ``"rollout"``); None for a dense policy. Default is None.
        load_balance_coef (float): ``moe.load_balance_coef``. Default is 0.0.
        z_loss_coef (float): ``moe.z_loss_coef``. Default is 0.0.
    """

    world_size: int
    batch_size: int
    group_size: int
    micro_batch_size: int
    ppo_epochs: int
    max_response_length: int
    advantage: str
    rewards: List[Tuple[str, float]] = field(default_factory=list)
    step_reward: Optional[str] = None
    token_level_advantage: bool = False
    loss_agg_mode: Optional[str] = "token-mean"
    loss_name: str = "GRPOLoss"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    ratio_level: str = "token"
    policy_lines: Optional[List[str]] = None
    rollout_correction: Optional[List[str]] = None
    token_selection: Optional[str] = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_placement: str = "loss"
    reference_model: bool = False
    reference_description: str = "loaded (frozen copy of the initial policy)"
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    max_rounds: int = 1
    optimizer: str = ""
    clip_grad_norm: Optional[float] = None
    on_nonfinite: str = "stop"
    environment: Optional[str] = None
    ppo_mini_batches: int = 1
    ppo_mini_batch_shuffle: bool = True
    precision: Optional[str] = None
    policy_model: Optional[str] = None
    max_staleness: Optional[int] = None
    in_flight_updates: bool = False
    max_tokens_per_micro_batch: Optional[int] = None
    weight_sync: Optional[str] = None
    routing_replay: Optional[str] = None
    load_balance_coef: float = 0.0
    z_loss_coef: float = 0.0

    @classmethod
    def from_components(
        cls, *, loss: Any, advantage: Any, rewards: Any, optimizer: Any, lr_schedule: Optional[str] = None, **values: Any
    ) -> "AlgorithmSpec":
        """A spec from the run's instantiated components (read, never called) and plain ``values``.

        A loss without ``loss_agg_mode`` (not a :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`) is
        reported by name.

        Args:
            loss (Any): the loss component; its ``loss_agg_mode``, clip ranges, ``ratio_level`` and
                ``entropy_coef`` are read when present.
            advantage (Any): the advantage estimator; its ``formula`` when present, else its class name.
            rewards (Any): the :class:`~torchtune_grpo.rewards.RewardSet` (``names``, ``weights``).
            optimizer (Any): the torch optimizer (its type and initial learning rate).
            lr_schedule (Optional[str]): the LR schedule's name. Default is None.
            **values (Any): the other fields of :class:`AlgorithmSpec`.

        Returns:
            AlgorithmSpec: the spec.
        """
        group = optimizer.param_groups[0]
        described = f"{type(optimizer).__name__}(lr={group.get('initial_lr', group['lr']):g})"
        return cls(
            advantage=getattr(advantage, "formula", type(advantage).__name__),
            rewards=list(zip(rewards.names, rewards.weights)),
            step_reward=getattr(rewards, "step_component", None),
            token_level_advantage=bool(getattr(advantage, "token_level", False)),
            loss_agg_mode=getattr(loss, "loss_agg_mode", None),
            loss_name=type(loss).__name__,
            epsilon_low=getattr(loss, "epsilon_low", 0.0),
            epsilon_high=getattr(loss, "epsilon_high", 0.0),
            dual_clip=getattr(loss, "dual_clip", None),
            tis_cap=getattr(loss, "tis_cap", None),
            ratio_level=getattr(loss, "ratio_level", "token"),
            policy_lines=loss.formula_lines() if hasattr(loss, "formula_lines") else None,
            entropy_coef=getattr(loss, "entropy_coef", 0.0),
            optimizer=described + (f", schedule {lr_schedule}" if lr_schedule else ""),
            **values,
        )

    @classmethod
    def from_run(
        cls, config: Any, *, loss: Any, advantage: Any, rewards: Any, optimizer: Any, lr_schedule: Optional[str],
        world_size: int, precision: str, policy_model: Optional[str], reference_description: Optional[str],
        dynamic: Any, multi_turn: Any, routing_replay: Optional[str], weight_sync: Optional[str],
        formula_lines: Dict[str, Any],
    ) -> "AlgorithmSpec":
        """The recipe's spec: its components (:meth:`from_components`), its config
        (:func:`config_values`, the logprob head, the MoE terms, the generation workers) and its run's facts.

        Args:
            config (Any): a :class:`~torchtune_grpo.config.schema.RecipeConfig`.
            loss (Any), advantage (Any), rewards (Any), optimizer (Any): as :meth:`from_components`.
            lr_schedule (Optional[str]): the LR schedule's component path, or None.
            world_size (int): processes.
            precision (str): the placement's precision, described.
            policy_model (Optional[str]): the policy's backend note (None: torchtune's modules).
            reference_description (Optional[str]): the reference model, described; None: no reference model.
            dynamic (Any): the :class:`~torchtune_grpo.rollouts.group_selection.DynamicSampling`.
            multi_turn (Any): the episodes' settings (``environment``, ``max_turns``), or None (single turn).
            routing_replay (Optional[str]): ``moe.routing_replay`` for a mixture of experts, else None.
            weight_sync (Optional[str]): the weight publisher's description, or None (the engine uses the
                trainer's weights).
            formula_lines (Dict[str, Any]): the loss masks' formula lines (``LossMasks.formula_lines()``).

        Returns:
            AlgorithmSpec: the spec the algorithm card is written from.
        """
        c, workers = config, config.generation_workers
        reference = {} if reference_description is None else dict(reference_description=reference_description)
        if c.logprob_head == "bf16":
            precision += "; logprob head: bf16 products with fp32 accumulation (logprob_head: bf16)"
        return cls.from_components(
            loss=loss, advantage=advantage, rewards=rewards, optimizer=optimizer, lr_schedule=lr_schedule,
            world_size=world_size, precision=precision,
            policy_model=policy_model or "torchtune TransformerDecoder (built from torchtune's modules)",
            reference_model=reference_description is not None, **reference,
            dynamic_sampling=dynamic.enabled, max_rounds=dynamic.max_rounds, **config_values(c),
            environment=None if multi_turn is None else (
                f"{type(multi_turn.environment).__name__}, at most {multi_turn.max_turns} turns"),
            max_staleness=workers.max_staleness if workers.enabled else None, routing_replay=routing_replay,
            load_balance_coef=c.moe.load_balance_coef, z_loss_coef=c.moe.z_loss_coef,
            in_flight_updates=workers.enabled and workers.in_flight_updates, weight_sync=weight_sync,
            **formula_lines,
        )


def config_values(config: Any) -> Dict[str, Any]:
    """The :class:`AlgorithmSpec` fields a recipe config decides by itself.

    Args:
        config (Any): a :class:`~torchtune_grpo.config.schema.RecipeConfig`.

    Returns:
        Dict[str, Any]: batch shape, update schedule, KL settings, clipping, masking.
    """
    kl_in_reward = config.kl_coef > 0 and config.kl_placement == "reward"
    return dict(
        batch_size=config.batch_size,
        group_size=config.group_size,
        micro_batch_size=config.micro_batch_size,
        max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        ppo_epochs=config.ppo_epochs,
        ppo_mini_batches=config.ppo_mini_batches,
        ppo_mini_batch_shuffle=config.ppo_mini_batch_shuffle,
        max_response_length=config.max_response_length,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        kl_placement="reward" if kl_in_reward else "loss",
        mask_truncated_completions=config.mask_truncated_completions,
        clip_grad_norm=None if config.clip_grad_norm is None else float(config.clip_grad_norm),
        on_nonfinite=config.on_nonfinite,
    )
