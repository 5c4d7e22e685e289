"""Where GRPO checkpoints live on disk, and how a run finds the one to resume from.

Layout under ``output_dir``::

    step_10/                      a Hugging Face model directory (safetensors, config, tokenizer files)
        model-00001-of-00001.safetensors
        config.json, tokenizer.json, ...
        recipe_state.pt           optimizer, LR schedule, dataloader position, RNG, step
    step_20/
    ...

``recipe_state.pt`` is written last and atomically (temp file + rename), so a directory without it is
an interrupted save and is never resumed from.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

__all__ = [
    "RECIPE_STATE_FILE",
    "find_latest_checkpoint",
    "finalize_step_dir",
    "model_files",
    "save_recipe_state",
    "step_dir",
]

RECIPE_STATE_FILE = "recipe_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(output_dir: str, step: int) -> Path:
    """The checkpoint directory of ``step``: ``{output_dir}/step_{step}``."""
    return Path(output_dir) / f"step_{step}"


def finalize_step_dir(output_dir: str, written_dir: Path, step: int) -> Path:
    """Move a directory written by a torchtune checkpointer (``epoch_{n}``) to ``step_{step}``.

    torchtune's checkpointers name their output after epochs; GRPO runs are counted in steps.

    Args:
        output_dir (str): the run's output directory.
        written_dir (Path): the directory the checkpointer wrote.
        step (int): the training step the checkpoint belongs to.

    Returns:
        Path: the final directory.
    """
    target = step_dir(output_dir, step)
    if target.exists():
        shutil.rmtree(target)
    os.replace(written_dir, target)
    return target


def save_recipe_state(directory: Path, state: Dict[str, Any]) -> Path:
    """Write ``recipe_state.pt`` into ``directory`` atomically, marking the checkpoint complete."""
    path = directory / RECIPE_STATE_FILE
    tmp = directory / (RECIPE_STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def find_latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The complete ``step_N`` directory with the largest N, or None when there is none."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    best, best_step = None, -1
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / RECIPE_STATE_FILE).is_file() and int(match.group(1)) > best_step:
            best, best_step = child, int(match.group(1))
    return best


def model_files(directory: Path) -> List[str]:
    """The model weight files (safetensors, else .bin) of a checkpoint directory, sorted."""
    files = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("adapter"))
    if not files:
        files = sorted(p.name for p in directory.glob("*.bin") if not p.name.startswith("adapter"))
    if not files:
        raise FileNotFoundError(f"no model weight files (*.safetensors or *.bin) in {directory}")
    return files
