"""``tune-grpo``: list and copy the configs shipped with torchtune-grpo.

    tune-grpo ls                                  # every shipped config, by recipe
    tune-grpo cp qwen2_5/1.5B_full_grpo my.yaml   # copy one to edit
"""

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import List, Optional

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
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
