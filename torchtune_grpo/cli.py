"""``tune-grpo``: configs, held-out evaluation, plots and rejection sampling.

    tune-grpo ls                                  # every shipped config, by recipe
    tune-grpo cp qwen2_5/1.5B_full_grpo my.yaml   # copy one to edit
    tune-grpo eval --config CFG [checkpoint_dir=DIR] [key=value ...] [--json out.json]
    tune-grpo plot OUTPUT_DIR [--out curves.png]
    tune-grpo rejection-sample --config CFG output=rs.jsonl [num_samples=N max_per_prompt=M threshold=T]
    tune-grpo vllm-serve --config CFG [--host H] [--port P] [--print] [key=value ...]

``eval`` and ``rejection-sample`` read a GRPO recipe config (model, tokenizer, checkpointer, generation,
reward_functions, max_response_length, and ``validation`` for eval / ``dataset`` for rejection sampling)
and run on one process. See docs/pipeline.md. ``vllm-serve`` starts (or prints) the vLLM server a config's
``VLLMServerGenerator`` would start, for a run that lists it in ``generation.servers`` (docs/vllm.md).
"""

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torchtune_grpo.runtime.quiet  # noqa: F401 (first: before any subcommand imports torchtune)

__all__ = ["config_path", "list_configs", "main"]

RECIPES = {
    "grpo_full_finetune_distributed": "full",
    "grpo_lora_finetune_distributed": "lora",
}


def _config_root() -> Path:
    return Path(str(resources.files("torchtune_grpo._configs")))


def list_configs() -> List[str]:
    """Names of the shipped configs, like ``qwen2_5/1.5B_full_grpo`` (path without ``.yaml``)."""
    root = _config_root()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def config_path(name: str) -> Path:
    """The file of a shipped config, given its name with or without ``.yaml``.

    Raises:
        ValueError: when no shipped config has that name (the message lists them).
    """
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = _config_root() / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(
            f"No shipped config named '{name}'. Available: {', '.join(list_configs())}"
        )
    return path


def _recipe_for(name: str) -> str:
    if name.endswith("_sft"):  # the demo's warm start: torchtune's own SFT recipe
        return "full_finetune_single_device"
    kind = "lora" if "lora" in name else "full"
    return next((r for r, k in RECIPES.items() if k == kind), "grpo_full_finetune_distributed")


def _cmd_ls(_: argparse.Namespace) -> int:
    names = list_configs()
    width = max(len("RECIPE"), *(len(_recipe_for(n)) for n in names))
    print(f"{'RECIPE':<{width}}  CONFIG")
    for name in names:
        print(f"{_recipe_for(name):<{width}}  {name}")
    return 0


def _cmd_cp(args: argparse.Namespace) -> int:
    src = config_path(args.name)
    dest = Path(args.destination)
    if dest.is_dir():
        dest = dest / src.name
    if dest.suffix != ".yaml":
        dest = dest.with_suffix(".yaml")
    if dest.exists() and not args.force:
        print(f"error: {dest} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"Copied {args.name} to {dest}")
    return 0


# ------------------------------------------------------------------ config-driven commands (eval, RS)

#: ``key=value`` overrides that are options of a command rather than config keys.
EVAL_OPTIONS = {"checkpoint_dir", "json", "split"}
RS_OPTIONS = {"checkpoint_dir", "output", "num_samples", "max_per_prompt", "threshold", "reward", "max_prompts",
              "split", "batch_size"}


def _load_config(path: str, overrides: List[str], options: set) -> Tuple[Any, Any, Dict[str, str]]:
    """The config with ``key=value`` overrides applied, checked as the recipes check it, and its typed values
    (defaults applied); command options are split off and returned.

    Raises:
        ValueError: naming a bad key or value (torchtune_grpo/config/__init__.py).
    """
    from omegaconf import OmegaConf

    from torchtune_grpo.assets import register_resolvers
    from torchtune_grpo.config import LoRARecipeConfig

    register_resolvers()
    cfg = OmegaConf.load(path)
    opts: Dict[str, str] = {}
    rest = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"expected key=value, got '{item}'")
        key, value = item.split("=", 1)
        if key in options:
            opts[key] = value
        else:
            rest.append(item)
    if rest:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(rest))
    # The widest schema: configs of either recipe (full or LoRA) are evaluated.
    return cfg, LoRARecipeConfig.from_cfg(cfg), opts


def _build_policy(cfg, config, checkpoint_dir: Optional[str]):
    """Model (weights loaded through the configured checkpointer), tokenizer, engine, rewards, generator.

    ``cfg`` is the config (its components are built), ``config`` its typed values (``RecipeConfig``).
    """
    import torch
    from omegaconf import OmegaConf
    from torchtune import config as tt_config, training, utils

    from torchtune_grpo.checkpoints.checkpointer_facts import backend_override
    from torchtune_grpo.checkpoints.storage import model_files
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.rewards import build_reward_set

    device = utils.get_device(device=config.device)
    dtype = Precision.from_name(config.dtype).compute_dtype  # the recipe's frozen models' dtype
    ckpt_cfg = OmegaConf.create(OmegaConf.to_container(cfg.checkpointer, resolve=False))
    if checkpoint_dir is not None:
        ckpt_dir = Path(checkpoint_dir)
        if not ckpt_dir.is_dir():
            raise ValueError(f"checkpoint_dir {ckpt_dir} is not a directory")
        ckpt_cfg.checkpoint_dir = str(ckpt_dir)
        ckpt_cfg.checkpoint_files = model_files(ckpt_dir)
    # Only the weights are read, and nothing may be written next to the training run's outputs.
    ckpt_cfg.output_dir = tempfile.mkdtemp(prefix="tune_grpo_eval_")
    for key in ("recipe_checkpoint", "adapter_checkpoint"):
        ckpt_cfg.pop(key, None)
    ckpt_cfg.update(backend_override(cfg))  # as the recipe does: the checkpointer reads the policy's names
    if OmegaConf.is_missing(ckpt_cfg, "checkpoint_dir"):
        raise ValueError("set checkpoint_dir=DIR (the config's checkpointer.checkpoint_dir is ???)")
    checkpointer = tt_config.instantiate(ckpt_cfg)
    state = checkpointer.load_checkpoint()[training.MODEL_KEY]
    with training.set_default_dtype(dtype), device:
        model = tt_config.instantiate(cfg.model)
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    engine = tt_config.instantiate(cfg.generation)
    rewards = build_reward_set(cfg.reward_functions, fallback=config.reward_fallback)
    seed = training.set_seed(seed=config.seed)  # torch, numpy, random; null draws one, as in the recipe
    if config.seed is None:
        print(f"seed: null, drew {seed} (seed={seed} repeats this run)", file=sys.stderr)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return model, tokenizer, engine, rewards, generator


def _multi_turn(config, tokenizer):
    """The config's multi-turn episodes (``environment``, ``multi_turn``: docs/multi_turn.md), as the recipe
    evaluates them, or None for single turns."""
    from torchtune_grpo.config import build_multi_turn

    multi_turn = build_multi_turn(config)
    if multi_turn is None:
        return None
    note = multi_turn.attach(tokenizer)
    if note:
        print(note, file=sys.stderr)
    return multi_turn


def _limit(dataset, max_prompts: Optional[int]) -> List[Dict[str, Any]]:
    n = len(dataset) if max_prompts is None else min(len(dataset), int(max_prompts))
    return [dataset[i] for i in range(n)]


def _cmd_eval(args: argparse.Namespace) -> int:
    from torchtune import config as tt_config
    from tqdm import tqdm

    from torchtune_grpo.rollouts.evaluation import evaluate

    cfg, config, opts = _load_config(args.config, args.overrides, EVAL_OPTIONS)
    if config.validation is None:
        raise ValueError(f"{args.config} has no `validation` dataset to evaluate on")
    model, tokenizer, engine, rewards, generator = _build_policy(cfg, config, opts.get("checkpoint_dir"))
    multi_turn = _multi_turn(config, tokenizer)  # before the prompts are tokenized: tools go into them
    prompts = _limit(tt_config.instantiate(cfg.validation, tokenizer), config.eval_max_prompts)
    records: List[Dict[str, Any]] = []
    with tqdm(total=len(prompts), desc="eval", unit="prompt", file=sys.stderr) as bar:
        sums = evaluate(
            model, tokenizer, engine, prompts, rewards,
            max_new_tokens=config.max_response_length,
            num_samples=config.eval_num_samples,
            k=config.eval_pass_k,
            correctness=config.eval_reward,
            threshold=config.eval_threshold,
            batch_size=config.eval_batch_size,
            generator=generator,
            progress=bar.update,
            records=records,
            multi_turn=multi_turn,
        )
    metrics = sums.metrics()
    result = {
        "checkpoint_dir": opts["checkpoint_dir"] if "checkpoint_dir" in opts else str(cfg.checkpointer.checkpoint_dir),
        **{k[len("eval/"):]: v for k, v in metrics.items()},
    }
    for key, value in result.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    out = opts.get("json") or args.json
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**result, "samples": records}, indent=1))
        print(f"wrote {out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from torchtune_grpo.metrics.plotting import plot_run

    try:
        out = plot_run(args.output_dir, out=args.out, title=args.title)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _cmd_rejection_sample(args: argparse.Namespace) -> int:
    from torchtune import config as tt_config
    from tqdm import tqdm

    from torchtune_grpo.rollouts.rejection_sampling import rejection_sample, write_jsonl

    cfg, config, opts = _load_config(args.config, args.overrides, RS_OPTIONS)
    if "output" not in opts:
        raise ValueError("rejection-sample needs output=PATH.jsonl")
    split = opts.get("split", "dataset")
    if cfg.get(split, None) is None:
        raise ValueError(f"{args.config} has no `{split}` dataset to sample prompts from")
    model, tokenizer, engine, rewards, generator = _build_policy(cfg, config, opts.get("checkpoint_dir"))
    _multi_turn(config, tokenizer)  # before the prompts are tokenized: tools go into them
    prompts = _limit(tt_config.instantiate(cfg[split], tokenizer), opts.get("max_prompts"))
    max_per_prompt = opts.get("max_per_prompt")
    with tqdm(total=len(prompts), desc="rejection sampling", unit="prompt", file=sys.stderr) as bar:
        rows, stats = rejection_sample(
            model, tokenizer, engine, prompts, rewards,
            num_samples=int(opts.get("num_samples", 8)),
            max_new_tokens=config.max_response_length,
            max_per_prompt=None if max_per_prompt in (None, "null", "None") else int(max_per_prompt),
            threshold=float(opts.get("threshold", 1.0)),
            reward_name=opts.get("reward"),
            batch_size=int(opts.get("batch_size", 8)),
            generator=generator,
            progress=bar.update,
        )
    path = write_jsonl(rows, opts["output"])
    print(
        f"kept {stats.kept} completions for {stats.prompts_kept}/{stats.prompts} prompts "
        f"({stats.passed}/{stats.samples} sampled passed the threshold); wrote {path}"
    )
    return 0


def _cmd_vllm_serve(args: argparse.Namespace) -> int:
    """Run, in the foreground, the vLLM server the config's ``VLLMServerGenerator`` would start (or print it)."""
    from torchtune import config as tt_config

    from torchtune_grpo.generation import VLLMServerGenerator
    from torchtune_grpo.runtime.precision import Precision

    cfg, config, _ = _load_config(args.config, args.overrides, set())
    engine = tt_config.instantiate(cfg.generation)
    if not isinstance(engine, VLLMServerGenerator):
        raise ValueError(
            f"generation._component_ builds {type(engine).__name__}: vllm-serve starts the server of "
            "torchtune_grpo.generation.VLLMServerGenerator"
        )
    engine.follow_trainer_dtype(Precision.from_name(config.dtype).compute_dtype)  # as the recipe does
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine.launch_args(),
               "--host", args.host, "--port", str(args.port)]
    if args.print:
        print("VLLM_SERVER_DEV_MODE=1 " + shlex.join(command))
        return 0
    os.execvpe(command[0], command, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    return 0  # not reached


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``tune-grpo`` console script."""
    parser = argparse.ArgumentParser(prog="tune-grpo", description="torchtune-grpo utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list shipped configs")
    ls.set_defaults(func=_cmd_ls)
    cp = sub.add_parser("cp", help="copy a shipped config to edit it")
    cp.add_argument("name", help="config name, e.g. tiny/full_grpo_cpu")
    cp.add_argument("destination", help="file or directory to copy to")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=_cmd_cp)

    ev = sub.add_parser(
        "eval", help="held-out evaluation of a checkpoint: greedy accuracy, mean reward, pass@k",
        description="Evaluate a checkpoint on the config's `validation` dataset (one process). Overrides: "
        "checkpoint_dir=DIR (any HF checkpoint directory, e.g. an SFT epoch_N or a GRPO step_N), "
        "json=PATH, and any config key=value.",
    )
    ev.add_argument("--config", required=True, help="a GRPO recipe config with a `validation` dataset")
    ev.add_argument("--json", default=None, help="also write the metrics and greedy samples to this file")
    ev.add_argument("overrides", nargs="*", help="key=value (checkpoint_dir=..., eval_num_samples=8, ...)")
    ev.set_defaults(func=_cmd_eval)

    pl = sub.add_parser("plot", help="plot a run's reward, held-out accuracy, KL and response length")
    pl.add_argument("output_dir", help="a GRPO run's output_dir (with metrics.jsonl)")
    pl.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/training_curves.png)")
    pl.add_argument("--title", default=None, help="figure title")
    pl.set_defaults(func=_cmd_plot)

    rs = sub.add_parser(
        "rejection-sample", help="sample N completions per prompt, keep the correct ones as an SFT jsonl",
        description="Overrides: output=PATH.jsonl (required), checkpoint_dir=DIR, num_samples=N (8), "
        "max_per_prompt=M (all), threshold=T (1.0), reward=NAME (default: the weighted total), "
        "max_prompts=K, split=dataset|validation, and any config key=value.",
    )
    rs.add_argument("--config", required=True, help="a GRPO recipe config (its `dataset` gives the prompts)")
    rs.add_argument("overrides", nargs="*", help="key=value")
    rs.set_defaults(func=_cmd_rejection_sample)

    vs = sub.add_parser(
        "vllm-serve", help="run the vLLM server a config's VLLMServerGenerator would start (for generation.servers)",
        description="The server's flags come from the config's `generation` (model, dtype, weight transfer, ...); "
        "list it in generation.servers as HOST:PORT. Overrides: any config key=value.",
    )
    vs.add_argument("--config", required=True, help="a GRPO recipe config whose generation is VLLMServerGenerator")
    vs.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    vs.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    vs.add_argument("--print", action="store_true", help="print the command instead of running it")
    vs.add_argument("overrides", nargs="*", help="key=value")
    vs.set_defaults(func=_cmd_vllm_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
