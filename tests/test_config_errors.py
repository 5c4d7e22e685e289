"""Every bad setting stops a run at setup, before a model is built, with a message naming key and value.

One table. ``stage`` says how far a case goes:

- ``config``: ``validate_config`` on the tiny config with the overrides (most cases; no I/O).
- ``cli``: the overrides as command-line arguments through torchtune's real parser (``config.parse``, what
  ``tune run`` uses), then ``validate_config``.
- ``setup``: the recipe itself, in process: ``__init__`` and ``setup``, for checks that need the file
  system or built objects (output directory, resume directory, reward names, checkpoint shapes). Each
  such case also asserts that no model was built.
"""

import functools
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, NamedTuple, Tuple

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config

from tests.conftest import TINY_CONFIG
from tests.recipe_utils import write_config
from torchtune_grpo.config import instantiate_component, validate_config
from torchtune_grpo.runtime.model_setup import check_device


class Case(NamedTuple):
    stage: str  # "config", "cli" or "setup"
    overrides: Dict[str, Any]  # dotted key -> value, or -> fn(ctx) giving the value
    message: str  # a regular expression the error must match
    cli: Tuple[str, ...] = ()  # command-line arguments (stage "cli")


class Context:
    """What a case's override functions may use: a fresh directory and, built once, another-shape model."""

    def __init__(self, tmp_path: Path, other_shape: Callable[[], Path]) -> None:
        self.tmp_path = tmp_path
        self._other_shape = other_shape

    @property
    def other_shape(self) -> Path:
        return self._other_shape()


def _file_in_the_way(ctx: Context) -> str:
    # Root can write into any directory, so "unwritable" is made by a file where a directory must go.
    blocker = ctx.tmp_path / "blocker"
    blocker.write_text("")
    return str(blocker / "out")


def _run_dir_with(*names: str) -> Callable[[Context], str]:
    def make(ctx: Context) -> str:
        run = ctx.tmp_path / "run"
        run.mkdir()
        for name in names:
            (run / name).mkdir()
            (run / name / "model.safetensors").write_text("")  # an interrupted save: no recipe_state.pt
        return str(run)

    return make


_SHAPE_ERROR = (
    r"The checkpoint in .*other_shape is from a model of another shape: "
    r"tok_embeddings\.weight: checkpoint \(512, 64\), model \(512, 128\); "
    r"layers\.0\.attn\.q_proj\.weight: checkpoint \(64, 64\), model \(128, 128\).*\(and \d+ more\)"
)

CASES = {
    # ---- numbers (torchtune_grpo/config/__init__.py NUMERIC_RULES)
    "ppo_epochs": Case("config", {"ppo_epochs": 0}, r"ppo_epochs must be >= 1 \(passes over each batch of rollouts\), got 0"),
    "ppo_epochs_text": Case("config", {"ppo_epochs": "two"}, r"ppo_epochs must be a whole number >= 1 .*got 'two'"),
    "ppo_epochs_fraction": Case("config", {"ppo_epochs": 1.5}, r"ppo_epochs must be a whole number >= 1 .*got 1.5"),
    "micro_batch_size": Case("config", {"micro_batch_size": 0}, r"micro_batch_size must be >= 1 .*got 0"),
    "batch_size": Case("config", {"batch_size": -4}, r"batch_size must be >= 1 \(prompts per rank .*got -4"),
    "group_size": Case("config", {"group_size": 1}, r"group_size must be >= 2 \(.*at least 2 to compare\), got 1"),
    "log_every_n_steps": Case("config", {"log_every_n_steps": 0}, r"log_every_n_steps must be >= 1 .*got 0"),
    "save_every_n_steps": Case("config", {"save_every_n_steps": 0}, r"save_every_n_steps must be >= 1 .*got 0"),
    "keep_last_n_checkpoints": Case("config", {"keep_last_n_checkpoints": 0},
                                    r"keep_last_n_checkpoints must be >= 1 \(complete checkpoints kept .*got 0"),
    "max_response_length": Case("config", {"max_response_length": 0}, r"max_response_length must be >= 1 .*got 0"),
    "temperature": Case("config", {"generation.temperature": 0.0},
                        r"generation\.temperature must be > 0 \(.*greedy.*\), got 0\.0"),
    "epsilon": Case("config", {"loss.epsilon": -0.2}, r"loss\.epsilon must be > 0 \(the PPO clip range.*got -0\.2"),
    "epsilon_low": Case("config", {"loss.epsilon_low": 0}, r"loss\.epsilon_low must be > 0 .*got 0"),
    "epsilon_high": Case("config", {"loss.epsilon_high": -1.0}, r"loss\.epsilon_high must be > 0 .*got -1\.0"),
    "dual_clip": Case("config", {"loss.dual_clip": 1.0}, r"loss\.dual_clip must be > 1 .*got 1\.0"),
    "kl_coef": Case("config", {"kl_coef": -0.01}, r"kl_coef must be >= 0 \(weight of the KL .*got -0\.01"),
    # a quoted number in the YAML: torch.optim would fail on it with a TypeError naming no key
    "lr_string": Case("config", {"optimizer.lr": "1e-3 "},
                      r"optimizer\.lr must be a number > 0 \(the learning rate\), got '1e-3 ' \(a string: remove the quotes"),
    "kl_coef_string": Case("config", {"kl_coef": "0.1"}, r"kl_coef must be a number >= 0 .*got '0\.1' \(a string"),
    "on_nonfinite": Case("config", {"on_nonfinite": "ignore"}, r"on_nonfinite must be one of \['stop', 'skip'\], got 'ignore'"),
    "on_broken_checkpoint": Case("config", {"on_broken_checkpoint": "newest"},
                                 r"on_broken_checkpoint must be one of \['use_previous', 'error'\], got 'newest'"),
    "save_on_sigterm": Case("config", {"save_on_sigterm": "yes"}, r"save_on_sigterm must be true or false, got 'yes'"),
    "ppo_epochs_null": Case("config", {"ppo_epochs": None}, r"ppo_epochs must be a whole number >= 1 .*got None"),
    # ---- the other kinds of key (torchtune_grpo/config/schema.py): choices, true/false, text, sections
    "kl_estimator": Case("config", {"kl_estimator": "k4"}, r"kl_estimator must be one of \['k1', 'k2', 'k3', 'k3\+'\], got 'k4'"),
    "dtype": Case("config", {"dtype": "fp16"}, r"dtype must be one of \['bf16', 'bf16_pure', 'fp32'\], got 'fp16'"),
    "bool_text": Case("config", {"mask_truncated_completions": "no"},
                      r"mask_truncated_completions must be true or false, got 'no'"),
    "section_bool": Case("config", {"dynamic_sampling.enabled": 1}, r"dynamic_sampling\.enabled must be true or false, got 1"),
    "rtol": Case("config", {"dynamic_sampling.rtol": -1.0}, r"dynamic_sampling\.rtol must be >= 0 .*got -1\.0"),
    "section_keys": Case("config", {"dynamic_sampling.max_round": 2},
                         r"Unknown dynamic_sampling key\(s\): \['max_round'\]\. Known: \['enabled', 'max_rounds', 'rtol'\]"),
    "section_not_a_dict": Case("config", {"multi_turn": 3}, r"multi_turn must be a section of keys .*got 3"),
    "eval_reward_text": Case("config", {"eval_reward": 5}, r"eval_reward must be text \(the name of a reward component\), got 5"),
    "reward_fallback": Case("config", {"reward_fallback": "zero"}, r"reward_fallback must be a number \(.*got 'zero' \(a string"),
    "mini_batches": Case("config", {"ppo_mini_batches": 3}, r"batch_size = \d+ \(groups per rank\) is not divisible by ppo_mini_batches = 3"),
    # ---- keys
    "typo": Case("config", {"ppo_epoch": 2}, r"Unknown config key\(s\): 'ppo_epoch' \(did you mean 'ppo_epochs'\?\)"),
    "required_null": Case("config", {"reward_functions": None}, r"Missing required config key\(s\): reward_functions"),
    # ---- components switched off on the command line: optional ones are off, required ones say how to set them
    "optimizer=null": Case("cli", {}, r"optimizer is required and cannot be switched off: optimizer\._component_ "
                           r"is null .*`optimizer\._component_=torch\.optim\.AdamW`", cli=("optimizer=null",)),
    "model=None": Case("cli", {}, r"model is required and cannot be switched off.*`model\._component_=",
                       cli=("model=None",)),
    # ---- checks that need the file system or built objects (recipe setup, before any model)
    "output_dir": Case("setup", {"output_dir": _file_in_the_way},
                       r"output_dir='.*blocker/out' is not writable \((NotADirectoryError|FileExistsError)"),
    "resume_interrupted": Case("setup",
                               {"resume_from_checkpoint": True, "output_dir": _run_dir_with("step_4", "step_2")},
                               r"resume_from_checkpoint=True but output_dir='.*run' holds no readable checkpoint: "
                               r".*step_4 has no recipe_state\.pt \(deleted, or not written by this recipe\); "
                               r".*step_2 has no recipe_state\.pt"),
    "resume_empty": Case("setup", {"resume_from_checkpoint": True, "output_dir": _run_dir_with()},
                         r"holds no readable checkpoint: no step_N directories"),
    "eval_reward": Case("setup", {"validation": {"_component_": "torchtune_grpo.data.arithmetic_dataset",
                                                 "num_samples": 4}, "eval_reward": "exact"},
                        r"eval_reward='exact' names no reward component: the reward set has "
                        r"\['format', 'correctness', 'vowels'\]"),
    "shape_torchtune_checkpointer": Case("setup", {"checkpointer.checkpoint_dir": lambda ctx: str(ctx.other_shape)},
                                         _SHAPE_ERROR),
    "shape_hf_checkpointer": Case("setup", {"checkpointer": lambda ctx: {
        "_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": str(ctx.other_shape),
        "output_dir": str(ctx.tmp_path / "out")}}, _SHAPE_ERROR),
}


@pytest.fixture(scope="module")
def other_shape_factory(tmp_path_factory):
    """A Qwen2 checkpoint 64 wide where the tiny config's model is 128 wide (built on first use)."""

    @functools.lru_cache(maxsize=None)
    def build() -> Path:
        from tests.hf_models import make_hf_model

        directory = tmp_path_factory.mktemp("ckpt") / "other_shape"
        make_hf_model(directory, "qwen2", vocab_size=512, num_attention_heads=4, num_key_value_heads=4)
        return directory

    return build


def _config(ctx: Context, overrides: Dict[str, Any]) -> DictConfig:
    values = {k: v(ctx) if callable(v) else v for k, v in overrides.items()}
    path = write_config(ctx.tmp_path, max_steps=1, **values)  # output_dir in tmp_path unless overridden
    return OmegaConf.load(path)


def _parse_cli(config_path: Path, args: Tuple[str, ...], monkeypatch) -> DictConfig:
    """The config as ``tune run RECIPE --config config_path *args`` gives it to the recipe."""
    parsed = {}

    @tt_config.parse
    def main(cfg: DictConfig) -> int:
        parsed["cfg"] = cfg
        return 0

    monkeypatch.setattr(sys, "argv", ["recipe", "--config", str(config_path), *args])
    with pytest.raises(SystemExit):
        main()
    return parsed["cfg"]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_setting_fails_at_setup_naming_key_and_value(name, tmp_path, monkeypatch, clean_env, other_shape_factory):
    case = CASES[name]
    ctx = Context(tmp_path, other_shape_factory)
    if case.stage == "config":
        cfg = OmegaConf.load(TINY_CONFIG)
        for key, value in case.overrides.items():
            OmegaConf.update(cfg, key, value, force_add=True, merge=False)
        with pytest.raises(ValueError, match=case.message):
            validate_config(cfg)
    elif case.stage == "cli":
        cfg = _parse_cli(TINY_CONFIG, case.cli, monkeypatch)
        key = case.cli[0].split("=")[0]
        assert cfg[key]._component_ is None  # what torchtune's parser makes of `key=null`
        with pytest.raises(ValueError, match=case.message):
            validate_config(cfg)
    else:
        from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

        cfg = _config(ctx, case.overrides)
        recipe = GRPOFullFinetuneRecipeDistributed(cfg)
        with pytest.raises((ValueError, FileNotFoundError), match=case.message):
            recipe.setup(cfg)
        # Failed before a model existed (the shape check runs on the meta-device model, before any load).
        assert not hasattr(recipe, "model")


def test_optional_components_switched_off_on_the_command_line(tmp_path, monkeypatch):
    # validation, lr_scheduler and profiler given in the YAML, then `=null` on the command line: torchtune's
    # parser leaves {_component_: null, ...the YAML's other fields}; the recipe treats that as "off".
    path = write_config(
        tmp_path,
        validation={"_component_": "torchtune_grpo.data.arithmetic_dataset", "num_samples": 4},
        profiler={"_component_": "torchtune.training.setup_torch_profiler", "enabled": True},
    )
    cfg = _parse_cli(path, ("validation=null", "lr_scheduler=null", "profiler=None"), monkeypatch)
    assert cfg.lr_scheduler._component_ is None and cfg.lr_scheduler.num_warmup_steps == 1
    assert cfg.validation._component_ is None and cfg.profiler._component_ is None
    validate_config(cfg)
    assert cfg.validation is None and cfg.lr_scheduler is None and cfg.profiler is None


def test_every_numeric_rule_is_documented():
    from torchtune_grpo.config import NUMERIC_RULES

    docs = (Path(__file__).resolve().parents[1] / "docs" / "configs.md").read_text()
    for rule in NUMERIC_RULES:
        assert re.search(rf"`{re.escape(rule.key)}`", docs), rule.key


def test_a_device_that_is_absent_is_an_error_not_a_silent_cpu_run(tmp_path, clean_env):
    # torchtune's get_device would fall back to the CPU and the run would "succeed" (exit code 0).
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

    assert not torch.cuda.is_available()  # the CPU machines this suite runs on
    cfg = OmegaConf.load(write_config(tmp_path, device="cuda"))
    with pytest.raises(ValueError, match=r"device='cuda' but torch sees no cuda device here \(torch\.cuda\.is_available\(\) "
                       r"is False; torch .*\)\. Set device=cpu"):
        GRPOFullFinetuneRecipeDistributed(cfg)
    with pytest.raises(ValueError, match=r"device='tpu9' is not a device torch knows"):
        check_device("tpu9")
    check_device("cpu")


def test_a_component_that_rejects_its_settings_is_named(tmp_path):
    # A setting of the wrong type that no rule covers fails inside the component: the error names the key.
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": "0.01"}})
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match=r"optimizer \(torch\.optim\.AdamW\) could not be built from its settings: .*"
                       r"Settings that are strings but read as numbers: optimizer\.weight_decay='0\.01' \(remove the quotes\)"):
        instantiate_component(cfg, "optimizer", params)
