"""The recipe config's checks, derived from a schema's fields, and :class:`ConfigSchema`, the base of every
config dataclass, which reads a config through them (the schema itself: torchtune_grpo/config/schema.py).

The checks take the schema as an argument, so they work for any schema and need none in particular.
Every error names the key and the value. The per-key checks (numbers and their ranges, choices, true/false,
text, unknown keys of closed sections) come from the schema's fields; the few checks that relate two keys
are written out in :func:`validate_config`.
"""

import dataclasses
import difflib
import operator
from typing import Any, Callable, Dict, NamedTuple, Optional, Set

from omegaconf import DictConfig, OmegaConf, open_dict

from torchtune_grpo.config.fields import COMPONENT, LIST, SECTION, Setting, settings

__all__ = ["ConfigSchema", "NumericRule", "numeric_rules", "required_keys", "validate_config"]

#: Shown in the error when a required component is switched off with ``key=null``.
_COMPONENT_EXAMPLES = {
    "model": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "tokenizer": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
    "checkpointer": "torchtune.training.FullModelHFCheckpointer",
    "dataset": "torchtune_grpo.data.gsm8k_dataset",
    "generation": "torchtune_grpo.generation.NativeGenerator",
    "loss": "torchtune_grpo.loss.GRPOLoss",
    "advantage": "torchtune_grpo.rollouts.advantages.GroupRelativeAdvantage",
    "optimizer": "torch.optim.AdamW",
    "metric_logger": "torchtune.training.metric_logging.DiskLogger",
}

_COMPARISONS = {">=": operator.ge, ">": operator.gt}


class NumericRule(NamedTuple):
    """A numeric key's range: ``key`` (dotted, e.g. ``loss.epsilon``) must be ``op bound``.

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


def numeric_rules(schema: type) -> tuple:
    """The :class:`NumericRule` of every key of ``schema`` with a range, in declaration order."""
    return tuple(
        NumericRule(s.key, s.kind, s.op, s.bound, s.nullable, s.why) for s in settings(schema) if s.op is not None
    )


def required_keys(schema: type) -> Set[str]:
    """The top-level keys of ``schema`` without which no run can start."""
    return {s.key for s in settings(schema) if s.required}


def validate_config(cfg: DictConfig, schema: type) -> None:
    """Fail early, naming the key and value, on unknown (misspelled), missing or invalid settings.

    Runs before anything is built. Also turns a component switched off on the command line into ``null``
    (in place): ``tune run ... validation=null`` makes torchtune's parser write ``validation._component_:
    null``; for an optional component (``validation``, ``lr_scheduler``, ``profiler``, ``weight_sync``)
    that means "off" (``weight_sync``: the default check), for a required one it is an error that says so.

    Args:
        cfg (DictConfig): the run's config.
        schema (type): the recipe's config dataclass (:class:`~torchtune_grpo.config.schema.RecipeConfig`, the
            LoRA recipe's :class:`~torchtune_grpo.config.schema.LoRARecipeConfig`; :func:`torchtune_grpo.config.validate_config`
            defaults to the first).

    Raises:
        ValueError: naming the unknown, missing or invalid key (with a close match for a typo) and its value.
    """
    known_keys = schema.keys()
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
    required = required_keys(schema)
    _switch_off_null_components(cfg, required)
    missing = sorted(key for key in required if cfg.get(key, None) is None)
    if missing:
        raise ValueError(f"Missing required config key(s): {', '.join(missing)} (absent or null).")
    for key in ("kl_coef", "kl_estimator", "kl_placement"):
        if key in cfg.get("loss", {}):
            raise ValueError(f"Set {key} at the top level of the config, not under loss.")
    for setting in settings(schema):
        _check_setting(cfg, setting)
    if cfg.get("multi_turn", None) and cfg.get("environment", None) is None:
        raise ValueError("multi_turn is set but environment is not: multi-turn episodes need an environment "
                         "(e.g. environment: {_component_: torchtune_grpo.multiturn.ToolEnvironment, tools: [...]})")
    if cfg.get("rollout_correction", None) is not None and cfg.loss.get("tis_cap", None) is not None:
        raise ValueError("Set either loss.tis_cap or rollout_correction (it generalises TIS), not both.")
    if int(cfg.batch_size) % int(cfg.get("ppo_mini_batches", 1)):
        raise ValueError(
            f"batch_size = {cfg.batch_size} (groups per rank) is not divisible by ppo_mini_batches = "
            f"{cfg.ppo_mini_batches}: every mini-batch takes the same number of whole groups on every rank."
        )


def _switch_off_null_components(cfg: DictConfig, required: Set[str]) -> None:
    """``key=null`` on the command line: ``null`` for an optional component, an error for a required one."""
    for key in list(cfg.keys()):
        node = cfg.get(key, None)
        if not (OmegaConf.is_dict(node) and "_component_" in node and node._component_ is None):
            continue
        if key in required:
            example = _COMPONENT_EXAMPLES.get(key, "a.module.ClassName")
            raise ValueError(
                f"{key} is required and cannot be switched off: {key}._component_ is null (`{key}=null` on the "
                f"command line sets it). Give a class, e.g. `{key}._component_={example}`, or drop the override."
            )
        with open_dict(cfg):
            cfg[key] = None


_ABSENT = object()


def _check_setting(cfg: DictConfig, s: Setting) -> None:
    """Raise naming ``s.key`` and its value when the value is not of the key's kind, range or choices."""
    value = OmegaConf.select(cfg, s.key, default=_ABSENT)
    if value is _ABSENT or (value is None and s.nullable) or s.kind in (COMPONENT, LIST):
        return
    if s.kind == SECTION:
        if value is not None and not OmegaConf.is_dict(value):
            raise ValueError(f"{s.key} must be a section of keys ({s.why}), got {value!r}")
        if s.section is not None and value is not None:  # a closed section: its keys are known
            unknown = sorted(set(value) - s.section.keys())
            if unknown:
                raise ValueError(f"Unknown {s.key} key(s): {unknown}. Known: {sorted(s.section.keys())}.")
        return
    if s.choices is not None:
        if value not in s.choices:
            raise ValueError(f"{s.key} must be one of {list(s.choices)}, got {value!r}")
    elif s.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{s.key} must be true or false, got {value!r}")
    elif s.kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{s.key} must be text ({s.why}), got {value!r}")
    else:
        _check_number(s, value)


def _check_number(s: Setting, value: Any) -> None:
    number = _as_number(value, s.kind)
    where = f" {s.op} {s.bound:g}" if s.op is not None else ""
    if number is None:
        kind = "a whole number" if s.kind is int else "a number"
        quoted = " (a string: remove the quotes in the YAML)" if isinstance(value, str) else ""
        raise ValueError(f"{s.key} must be {kind}{where} ({s.why}), got {value!r}{quoted}")
    if s.op is not None and not _COMPARISONS[s.op](number, s.bound):
        raise ValueError(f"{s.key} must be{where} ({s.why}), got {value!r}")


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


class ConfigSchema:
    """The base of every config dataclass: its keys, and its typed values read from a checked config."""

    @classmethod
    def keys(cls) -> set:
        """The top-level keys of this schema."""
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> Any:
        """Check ``cfg`` (:func:`validate_config`; the errors name key and value) and return its
        typed values, defaults applied.

        ``cfg`` is changed in place as :func:`validate_config` says
        (components switched off with ``key=null`` become ``null``). Component values are ``cfg``'s own
        nodes, for ``config.instantiate``.

        Raises:
            ValueError: naming the unknown, missing or invalid key and its value.
        """
        validate_config(cfg, cls)
        return cls._typed(cfg)

    @classmethod
    def _typed(cls, node: Any) -> Any:
        """The dataclass of ``node``'s (checked) values; absent keys take their defaults."""
        node = node if node is not None else {}
        values: Dict[str, Any] = {}
        for s in settings(cls):
            if "." in s.key:
                continue
            if s.section is not None:
                values[s.key] = s.section._typed(node.get(s.key, None))
            elif s.key in node:
                values[s.key] = _coerce(node[s.key], s.kind)
        return cls(**values)


def _coerce(value: Any, kind: Any) -> Any:
    """A checked value as its kind: ``2.0`` for an int key is 2; nodes and None as they are."""
    if value is None or kind not in (int, float, bool, str):
        return value
    return kind(value)
