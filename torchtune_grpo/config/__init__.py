"""The recipe config: its schema's derived tables, its checks, and building components from it.

Every key is declared once, as a field of :class:`~torchtune_grpo.config.schema.RecipeConfig` (type,
default, range, one-line doc); everything here is derived from it. The recipes read a config with
``RecipeConfig.from_cfg(cfg)`` (checked, defaults applied); ``tune-grpo``, the tests and the benchmarks
use the same. Nothing else in ``torchtune_grpo/`` reads a config. The key tables in docs/recipe.md and
docs/configs.md are generated from the schema: ``python -m torchtune_grpo.config --markdown``.
"""

import sys
from typing import Any, List, Optional, Set, Tuple

from omegaconf import DictConfig

from torchtune_grpo.config import checks
from torchtune_grpo.config.checks import NumericRule, numeric_rules, required_keys
from torchtune_grpo.config.schema import (
    DynamicSamplingConfig,
    KL_PLACEMENTS,
    LoRARecipeConfig,
    MultiTurnConfig,
    RecipeConfig,
)

__all__ = [
    "DYNAMIC_SAMPLING_KEYS",
    "KL_PLACEMENTS",
    "KNOWN_KEYS",
    "LORA_KEYS",
    "LoRARecipeConfig",
    "MULTI_TURN_KEYS",
    "NUMERIC_RULES",
    "REQUIRED_KEYS",
    "NumericRule",
    "RecipeConfig",
    "build_multi_turn",
    "instantiate_component",
    "validate_config",
]

#: Every top-level key the full fine-tuning recipe reads. Anything else is a typo or another trainer's key.
KNOWN_KEYS: Set[str] = RecipeConfig.keys()

#: Top-level keys the LoRA recipe reads on top of :data:`KNOWN_KEYS`.
LORA_KEYS: Set[str] = LoRARecipeConfig.keys() - KNOWN_KEYS

#: Keys without which no run can start.
REQUIRED_KEYS: Set[str] = required_keys(RecipeConfig)

#: Keys of the ``multi_turn:`` section (:class:`~torchtune_grpo.multiturn.MultiTurn`).
MULTI_TURN_KEYS: Set[str] = MultiTurnConfig.keys()

#: Keys of the ``dynamic_sampling:`` section (:class:`~torchtune_grpo.rollouts.group_selection.DynamicSampling`).
DYNAMIC_SAMPLING_KEYS: Set[str] = DynamicSamplingConfig.keys()

#: Every numeric setting the recipes read, with its valid range. A key that is absent takes its default.
NUMERIC_RULES: Tuple[NumericRule, ...] = numeric_rules(RecipeConfig)


def validate_config(cfg: DictConfig, schema: type = RecipeConfig) -> None:
    """:func:`~torchtune_grpo.config.checks.validate_config` with the full recipe's schema by default.

    Args:
        cfg (DictConfig): the run's config; components switched off with ``key=null`` become ``null``.
        schema (type): the recipe's config dataclass. Default is :class:`RecipeConfig` (the LoRA recipe's is
            :class:`LoRARecipeConfig`).

    Raises:
        ValueError: naming the unknown, missing or invalid key and its value.
    """
    checks.validate_config(cfg, schema)


def build_multi_turn(config: RecipeConfig) -> Optional[Any]:
    """The config's multi-turn episodes (``environment`` with the ``multi_turn`` limits), or None for single
    turns: what the recipes train and ``tune-grpo eval`` evaluates.

    Args:
        config (RecipeConfig): the typed config.

    Returns:
        Optional[MultiTurn]: not yet attached to a tokenizer (``MultiTurn.attach``).
    """
    if config.environment is None:
        return None
    from torchtune import config as tt_config

    from torchtune_grpo.multiturn import MultiTurn

    limits = config.multi_turn
    return MultiTurn(
        tt_config.instantiate(config.environment), max_turns=limits.max_turns, env_timeout=limits.env_timeout
    )


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


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m torchtune_grpo.config --markdown``: write the key tables of docs/recipe.md and
    docs/configs.md from the schema; ``--check``: exit 1 when they differ from it."""
    from torchtune_grpo.config.doc_tables import main as docs_main

    return docs_main(argv)


if __name__ == "__main__":
    sys.exit(main())
