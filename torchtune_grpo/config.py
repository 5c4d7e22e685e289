"""The recipe config's schema: which top-level keys exist, which are required, and their validation.

Both recipes (and ``tune-grpo``, the tests and the benchmarks) read the schema from here, so a key is
declared once. The recipes read the values; nothing else in ``torchtune_grpo/`` reads a config. See
docs/configs.md for what each key does.
"""

import difflib
import operator
from typing import Any, Callable, NamedTuple, Optional, Set, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from torchtune_grpo.loss import KL_ESTIMATORS
from torchtune_grpo.nonfinite import check_policy
from torchtune_grpo.precision import Precision
from torchtune_grpo.resume import BROKEN_CHECKPOINT_POLICIES

__all__ = [
    "DYNAMIC_SAMPLING_KEYS",
    "KL_PLACEMENTS",
    "KNOWN_KEYS",
    "LORA_KEYS",
    "MULTI_TURN_KEYS",
    "NUMERIC_RULES",
    "REQUIRED_KEYS",
    "NumericRule",
    "instantiate_component",
    "validate_config",
]

#: Every top-level key the full fine-tuning recipe reads. Anything else is a typo or another trainer's key.
KNOWN_KEYS: Set[str] = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset", "seed",
    "shuffle", "group_size", "batch_size", "max_prompt_length", "max_response_length", "epochs",
    "max_steps", "ppo_epochs", "micro_batch_size", "kl_coef", "generation", "reward_functions",
    "reward_fallback", "loss", "advantage", "optimizer", "lr_scheduler", "clip_grad_norm", "device",
    "dtype", "enable_activation_checkpointing", "fsdp_cpu_offload", "fsdp_reshard_after_forward",
    "logprob_chunk_size", "save_every_n_steps", "keep_last_n_checkpoints", "metric_logger", "log_every_n_steps",
    "log_completions", "profiler", "kl_estimator", "kl_placement", "mask_truncated_completions",
    "dynamic_sampling", "share_prompt_in_training", "fsdp_single_process",
    # several optimizer steps per step on disjoint mini-batches of whole groups (torchtune_grpo/update.py)
    "ppo_mini_batches", "ppo_mini_batch_shuffle",
    # masks and weights decided before the update (torchtune_grpo/loss_masks.py)
    "rollout_correction", "token_selection",
    # transformers' padding_idx on the input embedding, TRL's behaviour (torchtune_grpo/models/_padding_idx.py)
    "drop_pad_embedding_grad",
    # generation engines with their own weights (vLLM): the check after each weight sync
    "weight_sync",
    # multi-turn episodes (torchtune_grpo/multiturn/, docs/multi_turn.md)
    "environment", "multi_turn",
    # held-out evaluation (torchtune_grpo/evaluation.py)
    "validation", "eval_every_n_steps", "eval_num_samples", "eval_pass_k", "eval_max_prompts",
    "eval_reward", "eval_threshold", "eval_batch_size",
    # faults (docs/recipe.md, "What survives what"): non-finite loss/gradients, an unreadable newest
    # checkpoint on resume, a save when the scheduler sends SIGTERM
    "on_nonfinite", "on_broken_checkpoint", "save_on_sigterm",
}

#: Top-level keys the LoRA recipe reads on top of :data:`KNOWN_KEYS`.
LORA_KEYS: Set[str] = {"save_adapter_weights_only"}

#: Keys without which no run can start.
REQUIRED_KEYS: Set[str] = {
    "output_dir", "model", "tokenizer", "checkpointer", "dataset", "group_size", "batch_size",
    "max_response_length", "generation", "reward_functions", "loss", "advantage", "optimizer",
    "device", "dtype", "metric_logger",
}

#: Where a KL penalty goes: GRPO's term in the loss, or RLHF-PPO's penalty of each sequence's reward.
KL_PLACEMENTS = ("loss", "reward")

#: Keys of the ``multi_turn:`` section (:class:`~torchtune_grpo.multiturn.MultiTurn`).
MULTI_TURN_KEYS: Set[str] = {"max_turns", "env_timeout"}

#: Keys of the ``dynamic_sampling:`` section (:class:`~torchtune_grpo.dynamic_sampling.DynamicSampling`).
DYNAMIC_SAMPLING_KEYS: Set[str] = {"enabled", "max_rounds", "rtol"}


#: Shown in the error when a required component is switched off with ``key=null``.
_COMPONENT_EXAMPLES = {
    "model": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "tokenizer": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
    "checkpointer": "torchtune.training.FullModelHFCheckpointer",
    "dataset": "torchtune_grpo.data.gsm8k_dataset",
    "generation": "torchtune_grpo.generation.NativeGenerator",
    "loss": "torchtune_grpo.loss.GRPOLoss",
    "advantage": "torchtune_grpo.advantages.GroupRelativeAdvantage",
    "optimizer": "torch.optim.AdamW",
    "metric_logger": "torchtune.training.metric_logging.DiskLogger",
}

_COMPARISONS = {">=": operator.ge, ">": operator.gt}


class NumericRule(NamedTuple):
    """One row of :data:`NUMERIC_RULES`: ``key`` (dotted, e.g. ``loss.epsilon``) must be ``op bound``.

    Attributes:
        key (str): the dotted config key; the rule applies when the key is present.
        kind (type): ``int`` (whole numbers only) or ``float``.
        op (str): ``">="`` or ``">"``.
        bound (float): the limit.
        nullable (bool): whether ``null`` is allowed (it then means the key's documented default).
        why (str): what the value means, shown in the error.
    """

    key: str
    kind: type
    op: str
    bound: float
    nullable: bool
    why: str


#: Every numeric setting the recipes read, with its valid range. A key that is absent takes its default.
NUMERIC_RULES: Tuple[NumericRule, ...] = tuple(NumericRule(*row) for row in (
    # key                          kind   op    bound  null   why
    ("batch_size",                 int,   ">=", 1,     False, "prompts per rank per step"),
    ("group_size",                 int,   ">=", 2,     False, "completions per prompt: a group-relative "
                                                             "advantage needs at least 2 to compare"),
    ("micro_batch_size",           int,   ">=", 1,     False, "sequences per forward/backward"),
    ("ppo_epochs",                 int,   ">=", 1,     False, "passes over each batch of rollouts"),
    ("ppo_mini_batches",           int,   ">=", 1,     False, "optimizer steps per pass, on disjoint "
                                                             "mini-batches of whole groups"),
    ("max_response_length",        int,   ">=", 1,     False, "tokens sampled per completion"),
    ("max_prompt_length",          int,   ">=", 1,     True,  "longest prompt kept, in tokens"),
    ("epochs",                     int,   ">=", 1,     False, "passes over the prompts"),
    ("max_steps",                  int,   ">=", 1,     True,  "training steps (null: epochs decide)"),
    ("log_every_n_steps",          int,   ">=", 1,     False, "steps between metric-logger writes"),
    ("save_every_n_steps",         int,   ">=", 1,     True,  "steps between checkpoints (null: only "
                                                             "the final one)"),
    ("keep_last_n_checkpoints",    int,   ">=", 1,     True,  "complete checkpoints kept (null: all)"),
    ("log_completions",            int,   ">=", 0,     False, "completions written per step"),
    ("logprob_chunk_size",         int,   ">=", 1,     False, "positions per log-softmax chunk"),
    ("seed",                       int,   ">=", 0,     True,  "the random seed (null: drawn)"),
    ("kl_coef",                    float, ">=", 0,     False, "weight of the KL penalty (0: none)"),
    ("optimizer.lr",               float, ">",  0,     False, "the learning rate"),
    ("clip_grad_norm",             float, ">",  0,     True,  "gradient-norm clip (null: no clipping)"),
    ("generation.temperature",     float, ">",  0,     False, "the training sampling temperature: 0 is "
                                                             "greedy, so a group's completions are all "
                                                             "the same and there is nothing to compare"),
    ("loss.epsilon",               float, ">",  0,     False, "the PPO clip range (0 clips every ratio "
                                                             "to 1)"),
    ("loss.epsilon_low",           float, ">",  0,     True,  "the lower clip range (null: epsilon)"),
    ("loss.epsilon_high",          float, ">",  0,     True,  "the upper clip range (null: epsilon)"),
    ("loss.dual_clip",             float, ">",  1,     True,  "dual-clip bound on negative advantages"),
    ("loss.tis_cap",               float, ">",  0,     True,  "truncated importance sampling cap"),
    ("loss.entropy_coef",          float, ">=", 0,     False, "entropy bonus weight"),
    ("dynamic_sampling.max_rounds", int,  ">=", 1,     False, "generation rounds per step"),
    ("multi_turn.max_turns",       int,   ">=", 1,     False, "model turns per episode"),
    ("multi_turn.env_timeout",     float, ">",  0,     True,  "seconds per environment call (null: none)"),
    ("eval_every_n_steps",         int,   ">=", 1,     True,  "steps between held-out evaluations"),
    ("eval_num_samples",           int,   ">=", 0,     False, "samples per held-out prompt for pass@k"),
    ("eval_pass_k",                int,   ">=", 1,     True,  "the k of pass@k"),
    ("eval_max_prompts",           int,   ">=", 1,     True,  "held-out prompts evaluated"),
    ("eval_batch_size",            int,   ">=", 1,     False, "held-out prompts per generation call"),
))


def validate_config(cfg: DictConfig, known_keys: Optional[Set[str]] = None) -> None:
    """Fail early, naming the key and value, on unknown (misspelled), missing or invalid settings.

    Runs before anything is built. Also turns a component switched off on the command line into ``null``
    (in place): ``tune run ... validation=null`` makes torchtune's parser write ``validation._component_:
    null``; for an optional component (``validation``, ``lr_scheduler``, ``profiler``, ``weight_sync``)
    that means "off" (``weight_sync``: the default check), for a required one it is an error that says so.

    Args:
        cfg (DictConfig): the run's config.
        known_keys (Optional[Set[str]]): the keys the recipe reads. Default is None (:data:`KNOWN_KEYS`;
            the LoRA recipe passes ``KNOWN_KEYS | LORA_KEYS``).

    Raises:
        ValueError: naming the unknown, missing or invalid key (with a close match for a typo) and its value.
    """
    known_keys = KNOWN_KEYS if known_keys is None else known_keys
    unknown = sorted(set(cfg.keys()) - known_keys)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known_keys, n=1)
            hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ValueError(
            f"Unknown config key(s): {', '.join(hints)}. "
            f"Known keys: {', '.join(sorted(known_keys))}."
        )
    _switch_off_null_components(cfg)
    missing = sorted(key for key in REQUIRED_KEYS if cfg.get(key, None) is None)
    if missing:
        raise ValueError(f"Missing required config key(s): {', '.join(missing)} (absent or null).")
    for rule in NUMERIC_RULES:
        _check_number(cfg, rule)
    for key in ("kl_coef", "kl_estimator", "kl_placement"):
        if key in cfg.get("loss", {}):
            raise ValueError(f"Set {key} at the top level of the config, not under loss.")
    if cfg.get("kl_estimator", "k3") not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {cfg.kl_estimator!r}")
    if cfg.get("kl_placement", "loss") not in KL_PLACEMENTS:
        raise ValueError(f"kl_placement must be one of {list(KL_PLACEMENTS)}, got {cfg.kl_placement!r}")
    unknown = sorted(set(cfg.get("multi_turn", None) or {}) - MULTI_TURN_KEYS)
    if unknown:
        raise ValueError(f"Unknown multi_turn key(s): {unknown}. Known: {sorted(MULTI_TURN_KEYS)}.")
    if cfg.get("multi_turn", None) and cfg.get("environment", None) is None:
        raise ValueError("multi_turn is set but environment is not: multi-turn episodes need an environment "
                         "(e.g. environment: {_component_: torchtune_grpo.multiturn.ToolEnvironment, tools: [...]})")
    if cfg.get("rollout_correction", None) is not None and cfg.loss.get("tis_cap", None) is not None:
        raise ValueError("Set either loss.tis_cap or rollout_correction (it generalises TIS), not both.")
    Precision.from_name(cfg.dtype)  # "dtype must be one of ..."
    if int(cfg.batch_size) % int(cfg.get("ppo_mini_batches", 1)):
        raise ValueError(
            f"batch_size = {cfg.batch_size} (groups per rank) is not divisible by ppo_mini_batches = "
            f"{cfg.ppo_mini_batches}: every mini-batch takes the same number of whole groups on every rank."
        )
    unknown = sorted(set(cfg.get("dynamic_sampling", None) or {}) - DYNAMIC_SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown dynamic_sampling key(s): {unknown}. Known: {sorted(DYNAMIC_SAMPLING_KEYS)}."
        )
    check_policy(cfg.get("on_nonfinite", "stop"))
    if cfg.get("on_broken_checkpoint", "use_previous") not in BROKEN_CHECKPOINT_POLICIES:
        raise ValueError(f"on_broken_checkpoint must be one of {list(BROKEN_CHECKPOINT_POLICIES)}, "
                         f"got {cfg.on_broken_checkpoint!r}")
    if not isinstance(cfg.get("save_on_sigterm", True), bool):
        raise ValueError(f"save_on_sigterm must be true or false, got {cfg.save_on_sigterm!r}")
    if not isinstance(cfg.get("eval_reward", None), (str, type(None))):
        raise ValueError(f"eval_reward must be the name of a reward component, got {cfg.eval_reward!r}")


def _switch_off_null_components(cfg: DictConfig) -> None:
    """``key=null`` on the command line: ``null`` for an optional component, an error for a required one."""
    for key in list(cfg.keys()):
        node = cfg.get(key, None)
        if not (OmegaConf.is_dict(node) and "_component_" in node and node._component_ is None):
            continue
        if key in REQUIRED_KEYS:
            example = _COMPONENT_EXAMPLES.get(key, "a.module.ClassName")
            raise ValueError(
                f"{key} is required and cannot be switched off: {key}._component_ is null (`{key}=null` on the "
                f"command line sets it). Give a class, e.g. `{key}._component_={example}`, or drop the override."
            )
        with open_dict(cfg):
            cfg[key] = None


def _check_number(cfg: DictConfig, rule: NumericRule) -> None:
    """Raise naming ``rule.key`` and its value when the value is not a number in the rule's range."""
    value = OmegaConf.select(cfg, rule.key, default=_ABSENT)
    if value is _ABSENT or (value is None and rule.nullable):
        return
    number = _as_number(value, rule.kind)
    if number is None:
        kind = "a whole number" if rule.kind is int else "a number"
        quoted = " (a string: remove the quotes in the YAML)" if isinstance(value, str) else ""
        raise ValueError(
            f"{rule.key} must be {kind} {rule.op} {rule.bound:g} ({rule.why}), got {value!r}{quoted}"
        )
    if not _COMPARISONS[rule.op](number, rule.bound):
        raise ValueError(f"{rule.key} must be {rule.op} {rule.bound:g} ({rule.why}), got {value!r}")


_ABSENT = object()


def _as_number(value: Any, kind: Callable) -> Optional[float]:
    """``value`` as a number of ``kind`` (``int``: whole numbers only), or None when it is not one.

    A string is not a number, even one that reads as one (``"1e-3 "``): the components it is passed to
    (``torch.optim``) fail on it deep inside, without naming the key.
    """
    if isinstance(value, (bool, str)) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if kind is int and not number.is_integer():
        return None
    return number


def instantiate_component(cfg: DictConfig, key: str, *args: Any, **kwargs: Any) -> Any:
    """``torchtune.config.instantiate(cfg[key], *args, **kwargs)``, naming ``key`` when the component
    rejects its settings.

    A component given a setting of the wrong type fails inside its own code with a ``TypeError`` that names
    neither the config key nor the value (``optimizer: {lr: "1e-3 "}`` fails in ``torch.optim`` comparing a
    float with a str). The error raised instead names the key, the component and any string setting that
    reads as a number.

    Raises:
        TypeError: the component's ``TypeError``, with the key named (the original is chained).
    """
    from torchtune import config as tt_config  # torchtune is imported lazily elsewhere in this module too

    try:
        return tt_config.instantiate(cfg[key], *args, **kwargs)
    except TypeError as e:
        suspects = [
            f"{key}.{name}={value!r}"
            for name, value in cfg[key].items()
            if isinstance(value, str) and _reads_as_number(value)
        ]
        hint = f" Settings that are strings but read as numbers: {', '.join(suspects)} (remove the quotes)." if suspects else ""
        raise TypeError(f"{key} ({cfg[key].get('_component_')}) could not be built from its settings: {e}.{hint}") from e


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
