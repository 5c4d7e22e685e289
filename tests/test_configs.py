"""Every shipped config is one the recipe accepts, and `tune-grpo ls/cp` serve them.

Nothing here loads weights or data: the real configs point at files users download, so their models are
built on the meta device (no memory, well under a second each) and their components are only resolved.
"""

from pathlib import Path
from typing import Any, Iterator, List, Tuple

import copy
import functools
import inspect
import json
import math

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config, training
from torchtune.config._utils import _get_component_from_path

from torchtune_grpo.config import REQUIRED_KEYS, validate_config
from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed
from grpo_lora_finetune_distributed import GRPOLoRAFinetuneRecipeDistributed
from tests.conftest import REPO
from tests.real_hf_configs import HUB_CONFIGS, TORCHTUNE_BUILDERS
from torchtune_grpo.cli import list_configs, main
from torchtune_grpo.multiturn import MultiTurn
from torchtune_grpo.rewards import _base as reward_base, build_reward_set

# Keys of a reward entry that configure the reward set rather than the reward's constructor.
REWARD_OPTION_KEYS = set(getattr(reward_base, "OPTION_KEYS", ("name", "weight")))

CONFIG_DIR = REPO / "configs"
# `*_sft.yaml` configs are for torchtune's own SFT recipes (the demo's warm start): tests/test_evaluation.py
# checks them.
ALL_CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if not p.stem.endswith("_sft"))
# Every config for a real model (GPU): each must build from a model directory after editing only
# checkpointer.checkpoint_dir (test_real_config).
REAL_CONFIGS = [
    f"{family}/{p.stem}" for family in ("qwen2_5", "llama3_2", "qwen3") for p in sorted((CONFIG_DIR / family).glob("*.yaml"))
]


def _name(path: Path) -> str:
    return str(path.relative_to(CONFIG_DIR).with_suffix(""))


def _recipe(name: str) -> str:
    """The recipe a config is for: LoRA configs have "lora" in their name; `*_sft` are torchtune's SFT."""
    if name.endswith("_sft"):
        return "full_finetune_single_device"
    return "grpo_lora_finetune_distributed" if "lora" in name else "grpo_full_finetune_distributed"


def _recipe_class(path: Path) -> type:
    return GRPOLoRAFinetuneRecipeDistributed if "lora" in path.name else GRPOFullFinetuneRecipeDistributed


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> DictConfig:
    return OmegaConf.load(path)


def _load_path(path: Path) -> DictConfig:
    """The config at ``path``, parsed once per module (each config is read by six tests and at collection): a
    copy of its own for each caller, which may change it (a copy takes a third of a parse)."""
    return copy.deepcopy(_parsed(Path(path)))


def _load(name: str) -> DictConfig:
    return _load_path(CONFIG_DIR / f"{name}.yaml")


def _components(node: Any, where: str = "") -> Iterator[Tuple[str, str]]:
    """Yields (key path, dotpath) for every `_component_`, descending into dicts and lists."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            value = node._get_node(key)
            path = f"{where}.{key}" if where else str(key)
            if key == "_component_":
                yield where, str(node[key])
            else:
                yield from _components(value, path)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _components(node._get_node(i), f"{where}[{i}]")


def test_no_two_configs_share_an_output_dir():
    # Two runs in one output_dir are refused (torchtune_grpo/runtime/output_lock.py), and one run would otherwise
    # replace the other's checkpoints: every shipped config writes to its own directory.
    seen = {}
    for path in ALL_CONFIGS + sorted(CONFIG_DIR.rglob("*_sft.yaml")):
        out = str(_load_path(path).output_dir)
        assert out not in seen, f"{_name(path)} and {seen[out]} both write to {out}"
        seen[out] = _name(path)


def test_configs_found():
    names = [_name(p) for p in ALL_CONFIGS]
    assert "tiny/full_grpo_cpu" in names
    assert set(REAL_CONFIGS) <= set(names), sorted(set(REAL_CONFIGS) - set(names))


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_name)
def test_config_keys(path: Path):
    cfg = _load_path(path)
    keys = set(cfg.keys())
    known = _recipe_class(path).known_keys()
    assert keys <= known, f"unknown keys: {sorted(keys - known)}"
    assert REQUIRED_KEYS <= keys, f"missing keys: {sorted(REQUIRED_KEYS - keys)}"
    validate_config(cfg, _recipe_class(path).config_class)
    if "lora" in path.name:  # a LoRA builder, and the full recipe refuses the LoRA-only keys
        assert "lora" in cfg.model._component_.rsplit(".", 1)[-1]
        with pytest.raises(ValueError, match="save_adapter_weights_only"):
            validate_config(cfg)
    # Every interpolation resolves (${output_dir}, ${max_prompt_length}, ${grpo_asset:...}).
    OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_name)
def test_components_importable(path: Path):
    cfg = _load_path(path)
    components = list(_components(cfg))
    wanted = {"model", "tokenizer", "checkpointer", "dataset", "generation", "advantage", "loss",
              "optimizer", "metric_logger"}
    assert wanted <= {where for where, _ in components}
    assert sum(where.startswith("reward_functions[") for where, _ in components) == len(
        cfg.reward_functions
    )
    for where, dotpath in components:
        try:
            target = _get_component_from_path(dotpath)
        except Exception as err:  # noqa: BLE001 - report which key failed
            pytest.fail(f"{where}._component_ = {dotpath!r} does not import: {err}")
        assert callable(target), f"{where}._component_ = {dotpath!r} is not callable"


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_name)
def test_component_arguments(path: Path):
    # Only top-level keys are validated by the recipe: a misspelled argument inside a component would
    # surface minutes into a GPU run. Bind every component's arguments to its signature here.
    cfg = _load_path(path)
    for where, dotpath in _components(cfg):
        node = OmegaConf.select(cfg, where)
        kwargs = {k: v for k, v in node.items() if k != "_component_"}
        if where.startswith("reward_functions["):
            kwargs = {k: v for k, v in kwargs.items() if k not in REWARD_OPTION_KEYS}
        signature = inspect.signature(_get_component_from_path(dotpath))
        try:
            signature.bind_partial(**kwargs)
        except TypeError as err:
            pytest.fail(f"{where}: {dotpath} does not take {sorted(kwargs)}: {err}")


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_name)
def test_cheap_components_build(path: Path, tmp_path: Path):
    # The pieces that need no downloaded file, built the way the recipe builds them.
    cfg = _load_path(path)
    tt_config.instantiate(cfg.generation)
    tt_config.instantiate(cfg.advantage)
    tt_config.instantiate(
        cfg.loss, kl_coef=float(cfg.get("kl_coef", 0.0)), max_response_length=cfg.max_response_length
    )
    rewards = build_reward_set(cfg.reward_functions, fallback=float(cfg.get("reward_fallback", 0.0)))
    assert len(rewards.names) == len(cfg.reward_functions)
    optimizer = tt_config.instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    if cfg.get("lr_scheduler") is not None:
        tt_config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=10, last_epoch=-1)
    tt_config.instantiate(cfg.metric_logger, log_dir=str(tmp_path / "logs")).close()


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_name)
def test_format_reward_matches_prompt_style(path: Path):
    # "r1" prompts end with <think>; "chat" prompts do not. A FormatReward whose think_in_prompt disagrees
    # scores every well-formed completion 0, silently.
    cfg = _load_path(path)
    style = cfg.dataset.get("prompt_style", "r1")
    for spec in cfg.reward_functions:
        if spec._component_.endswith("FormatReward"):
            assert spec.get("think_in_prompt", True) == (style == "r1"), (style, spec)


def assert_real_config_conventions(cfg: DictConfig) -> Path:
    """What every config for a real model keeps (GPU, bf16, activation checkpointing, a math dataset, with images
    in the prompt or not, whose prompt limit is the config's, its own output directory, and one line to edit:
    model, tokenizer and weights all read checkpointer.checkpoint_dir); returns that directory (``/tmp/<name>``,
    as `tune download <repo> --output-dir /tmp/<name>` writes it)."""
    assert cfg.device == "cuda" and cfg.dtype == "bf16"
    assert cfg.enable_activation_checkpointing is True
    assert cfg.dataset._component_ in (
        "torchtune_grpo.data.gsm8k_dataset", "torchtune_grpo.data.math_dataset", "torchtune_grpo.data.image_dataset")
    assert cfg.dataset.max_prompt_length == cfg.max_prompt_length
    assert str(cfg.output_dir).startswith("/tmp/torchtune_grpo/")
    assert cfg.checkpointer._component_ == "torchtune_grpo.models.HFCheckpointer"
    for key in ("model", "tokenizer"):
        assert OmegaConf.to_container(cfg[key])["path"] == "${checkpointer.checkpoint_dir}", key
    directory = Path(str(cfg.checkpointer.checkpoint_dir))
    assert str(directory) == f"/tmp/{directory.name}"
    return directory


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_real_config(name: str, tmp_path: Path):
    cfg = _load(name)
    directory = assert_real_config_conventions(cfg)
    if name.startswith("qwen3/"):
        thinks = not any(tag in name for tag in ("nothink", "0.6B", "tools"))
        assert cfg.tokenizer.enable_thinking == thinks

    # The model the config builds, from the model's real config.json, on the meta device.
    local = tmp_path / directory.name
    local.mkdir()
    (local / "config.json").write_text(json.dumps(HUB_CONFIGS[directory.name]))
    cfg.checkpointer.checkpoint_dir = str(local)
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    assert next(model.parameters()).is_meta
    assert cfg.max_prompt_length + cfg.max_response_length <= model.max_seq_len
    # Parameters, not state_dict(): a QLoRA model's state_dict() dequantises its NF4 weights (as torchtune's
    # QLoRA builders do), which cannot be done on the meta device.
    ours = {k: tuple(v.shape) for k, v in model.named_parameters() if "lora" not in k}
    if directory.name in TORCHTUNE_BUILDERS:
        # torchtune has this model: the directory builder gives exactly torchtune's (names and shapes).
        with torch.device("meta"):
            reference = _get_component_from_path(TORCHTUNE_BUILDERS[directory.name])()
        assert ours == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
        assert model.max_seq_len == reference.max_seq_len
    else:
        # Qwen3: the parameters of transformers' own model of this config.json, one to one.
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**HUB_CONFIGS[directory.name]))
        hf_params = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            hf_params.pop("lm_head.weight")
        assert sum(map(math.prod, ours.values())) == sum(map(math.prod, hf_params.values()))
        assert len(ours) == len(hf_params)


# Configs of the ecosystem adapters (torchtune_grpo.envs: an OpenEnv server...) build and train in their own
# tests (tests/test_envs_*.py): building their environment starts a server.
MULTI_TURN_CONFIGS = [
    _name(p) for p in ALL_CONFIGS
    if "environment" in (cfg := _load_path(p)) and not cfg.environment._component_.startswith("torchtune_grpo.envs.")
]


def test_multi_turn_configs_found():
    assert {"tiny/multi_turn_cpu", "qwen3/1.7B_gsm8k_tools"} <= set(MULTI_TURN_CONFIGS)


@pytest.mark.parametrize("name", MULTI_TURN_CONFIGS)
def test_multi_turn_config(name: str):
    # The environment and episode limits build as the recipe builds them (MultiTurn(environment, **multi_turn)).
    cfg = _load(name)
    multi_turn = MultiTurn(tt_config.instantiate(cfg.environment), **OmegaConf.to_container(cfg.multi_turn))
    assert multi_turn.max_turns >= 2 and multi_turn.env_timeout is not None
    names = [t["function"]["name"] for t in multi_turn.tools]
    assert "calculator" in names
    if name.startswith("qwen3/"):
        assert names == ["python", "calculator"]
        assert cfg.tokenizer.enable_thinking is False and cfg.dataset.prompt_style == "chat"


def test_tiny_multi_turn_config_prompts_and_turns():
    # The shipped tiny tokenizer's ChatML template has no tools section, so the config's system prompt shows
    # the call format: that example must be a call the configured environment runs, and the prompts must fit.
    cfg = _load("tiny/multi_turn_cpu")
    OmegaConf.resolve(cfg)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    multi_turn = MultiTurn(tt_config.instantiate(cfg.environment), **OmegaConf.to_container(cfg.multi_turn))
    tokenizer.tools = multi_turn.tools  # as the recipe does before the datasets tokenize
    assert type(multi_turn.turns_for(tokenizer)).__name__ == "ChatTurns"
    reply = multi_turn.environment.step(
        multi_turn.environment.start({}), {"role": "assistant", "content": cfg.dataset.system_prompt}
    )
    assert reply.messages == [{"role": "tool", "name": "calculator", "content": "5"}] and not reply.done
    dataset = tt_config.instantiate(cfg.dataset, tokenizer)
    assert len(dataset) == cfg.dataset.num_samples  # no prompt dropped by max_prompt_length
    prompt = tokenizer.decode(dataset[0]["tokens"], skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou can use a calculator.") and "<tool_call>" in prompt


def _run_cli(argv: List[str], capsys) -> Tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_ls(capsys):
    code, out, _ = _run_cli(["ls"], capsys)
    assert code == 0
    listed = [line.split()[-1] for line in out.splitlines()[1:]]
    assert sorted(listed) == sorted(_name(p) for p in CONFIG_DIR.rglob("*.yaml"))
    assert list_configs() == sorted(listed)
    for line in out.splitlines()[1:]:
        assert line.split()[0] == _recipe(line.split()[-1])
    assert any(line.split()[0] == "grpo_lora_finetune_distributed" for line in out.splitlines()[1:])


def test_cli_cp(tmp_path: Path, capsys):
    src = CONFIG_DIR / "qwen2_5" / "1.5B_full_grpo.yaml"
    dest = tmp_path / "my.yaml"
    code, _, _ = _run_cli(["cp", "qwen2_5/1.5B_full_grpo", str(dest)], capsys)
    assert code == 0
    assert dest.read_text() == src.read_text()

    # An existing file is kept unless --force is given.
    dest.write_text("mine\n")
    code, _, err = _run_cli(["cp", "qwen2_5/1.5B_full_grpo", str(dest)], capsys)
    assert code != 0 and "--force" in err
    assert dest.read_text() == "mine\n"
    code, _, _ = _run_cli(["cp", "qwen2_5/1.5B_full_grpo", str(dest), "--force"], capsys)
    assert code == 0 and dest.read_text() == src.read_text()

    # A directory destination keeps the config's file name.
    code, _, _ = _run_cli(["cp", "llama3_2/1B_full_grpo.yaml", str(tmp_path)], capsys)
    assert code == 0 and (tmp_path / "1B_full_grpo.yaml").is_file()


def test_cli_cp_unknown_name(tmp_path: Path, capsys):
    code, _, err = _run_cli(["cp", "qwen2_5/70B_full_grpo", str(tmp_path / "x.yaml")], capsys)
    assert code != 0
    assert "qwen2_5/70B_full_grpo" in err
    for name in REAL_CONFIGS + ["tiny/full_grpo_cpu"]:
        assert name in err
    assert not (tmp_path / "x.yaml").exists()
