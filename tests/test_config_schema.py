"""The typed config (torchtune_grpo/config/schema.py): one declaration per key, from which the checks, the
derived tables, the recipes' values and the docs' key tables all come."""

import dataclasses
import inspect
from typing import Optional

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO, TINY_CONFIG
from torchtune_grpo.config import (
    DYNAMIC_SAMPLING_KEYS,
    KNOWN_KEYS,
    LoRARecipeConfig,
    MULTI_TURN_KEYS,
    NUMERIC_RULES,
    RecipeConfig,
    REQUIRED_KEYS,
    validate_config,
)
from torchtune_grpo.config.checks import numeric_rules
from torchtune_grpo.config.doc_tables import keys_table, render, update_docs, values_table
from torchtune_grpo.config.fields import setting
from torchtune_grpo.config.schema import DynamicSamplingConfig, MultiTurnConfig
from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.multiturn import MultiTurn


def _tiny(**overrides):
    cfg = OmegaConf.load(TINY_CONFIG)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    return cfg


def test_the_docs_key_tables_are_the_schemas():
    # `python -m torchtune_grpo.config --markdown` rewrites them; this fails when someone forgot to.
    assert update_docs(REPO, write=False) == []
    recipe_md = (REPO / "docs" / "recipe.md").read_text()
    for key in sorted(KNOWN_KEYS | LoRARecipeConfig.keys()):
        assert f"| `{key}` |" in recipe_md, key
    configs_md = (REPO / "docs" / "configs.md").read_text()
    for rule in NUMERIC_RULES:
        assert f"| `{rule.key}` | " in configs_md, rule.key
    # A hand edit of a generated row is found (and undone by rendering).
    edited = recipe_md.replace("| `ppo_epochs` | `1` |", "| `ppo_epochs` | `2` |")
    assert edited != recipe_md and render(edited, {"config-keys": keys_table}) == recipe_md
    with pytest.raises(ValueError, match=r"docs/x\.md has no '<!-- generated: config-keys"):
        render("no markers", {"config-keys": keys_table}, "docs/x.md")


def test_typed_values_take_the_declared_defaults():
    cfg = _tiny()
    for key in ("ppo_epochs", "seed", "micro_batch_size", "log_completions", "kl_coef", "shuffle"):
        cfg.pop(key, None)
    config = RecipeConfig.from_cfg(cfg)
    fields = {f.name: f for f in dataclasses.fields(RecipeConfig)}
    assert config.ppo_epochs == fields["ppo_epochs"].default == 1
    assert config.seed is None and config.log_completions == 2 and config.kl_coef == 0.0 and config.shuffle is True
    assert config.kl_estimator == "k3" and config.kl_placement == "loss" and config.eval_batch_size == 32
    # computed default: one micro-batch per step
    assert config.micro_batch_size == config.batch_size * config.group_size
    # closed sections absent: their declared defaults
    assert config.dynamic_sampling == DynamicSamplingConfig() and config.multi_turn == MultiTurnConfig()
    # components are the config's own nodes, for config.instantiate
    assert OmegaConf.is_dict(config.loss) and config.loss == cfg.loss
    assert config.lr_scheduler == cfg.get("lr_scheduler", None)


def test_typed_values_have_the_declared_types():
    config = RecipeConfig.from_cfg(_tiny(ppo_epochs=2.0, kl_coef=1, max_steps=None, **{"dynamic_sampling.max_rounds": 3.0}))
    assert config.ppo_epochs == 2 and type(config.ppo_epochs) is int  # "2.0 is accepted" as a whole number
    assert type(config.kl_coef) is float and config.max_steps is None
    assert config.dynamic_sampling.max_rounds == 3 and type(config.dynamic_sampling.max_rounds) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ppo_epochs = 3


def test_section_defaults_are_the_components_defaults():
    # MultiTurn and DynamicSampling keep defaults of their own (they are library classes); they must agree.
    for section, cls in ((MultiTurnConfig, MultiTurn), (DynamicSamplingConfig, DynamicSampling)):
        params = inspect.signature(cls.__init__).parameters
        for f in dataclasses.fields(section):
            assert params[f.name].default == f.default, (section.__name__, f.name)
    assert MULTI_TURN_KEYS == {"max_turns", "env_timeout"} and DYNAMIC_SAMPLING_KEYS == {"enabled", "max_rounds", "rtol"}


def test_lora_schema_extends_the_full_one():
    cfg = _tiny(save_adapter_weights_only=True)
    with pytest.raises(ValueError, match=r"Unknown config key\(s\): 'save_adapter_weights_only'"):
        RecipeConfig.from_cfg(cfg)
    config = LoRARecipeConfig.from_cfg(cfg)
    assert config.save_adapter_weights_only is True and config.group_size == RecipeConfig.from_cfg(_tiny()).group_size
    assert LoRARecipeConfig.keys() - RecipeConfig.keys() == {"save_adapter_weights_only"}


def test_a_new_key_is_one_field():
    # Declaring the field is all it takes: known, range-checked, typed with its default, in the docs table.
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(RecipeConfig):
        rollout_workers: Optional[int] = setting(2, ge=1, doc="generation workers", why="processes that generate")

    assert "rollout_workers" in Extended.keys() and "rollout_workers" not in RecipeConfig.keys()
    assert [r for r in numeric_rules(Extended) if r.key == "rollout_workers"][0].op == ">="
    assert Extended.from_cfg(_tiny()).rollout_workers == 2
    with pytest.raises(ValueError, match=r"rollout_workers must be >= 1 \(processes that generate\), got 0"):
        validate_config(_tiny(rollout_workers=0), Extended)
    assert "| `rollout_workers` | `2` | whole number >= 1 | generation workers |" in keys_table(Extended)
    assert "| `rollout_workers` | whole number >= 1: processes that generate | no |" in values_table(Extended)


def test_required_keys_are_the_fields_without_default():
    assert REQUIRED_KEYS == {f.name for f in dataclasses.fields(RecipeConfig)
                             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert {"device", "dtype", "metric_logger", "group_size"} <= REQUIRED_KEYS and "seed" not in REQUIRED_KEYS


def test_cli_reads_the_same_typed_config(tmp_path):
    # tune-grpo (eval, rejection-sample) checks the config as the recipe does and reads the same defaults.
    from torchtune_grpo.cli import _load_config, EVAL_OPTIONS

    cfg = _tiny()
    cfg.pop("eval_batch_size", None)
    path = tmp_path / "c.yaml"
    OmegaConf.save(cfg, path)
    _, config, opts = _load_config(str(path), ["checkpoint_dir=/x", "seed=null"], EVAL_OPTIONS)
    assert opts == {"checkpoint_dir": "/x"} and config.seed is None and config.eval_batch_size == 32
    with pytest.raises(ValueError, match=r"eval_num_samples must be >= 0 .*got -1"):
        _load_config(str(path), ["eval_num_samples=-1"], EVAL_OPTIONS)
