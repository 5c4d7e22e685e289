"""Where GRPO checkpoints live on disk, how they are written so that none is ever lost, and how a run finds
the one to resume from.

Layout under ``output_dir``::

    step_10/                      a Hugging Face model directory (safetensors, config, tokenizer files)
        model-00001-of-00001.safetensors
        config.json, tokenizer.json, ...
        recipe_state.pt           optimizer, LR schedule, dataloader position, RNG, step
    step_20/
    ...

A save never touches a complete checkpoint until its replacement is complete:

1. everything is written into a hidden staging directory ``.step_N.staging`` (:func:`begin_step_dir`);
2. ``recipe_state.pt`` is written into it last, atomically (temp file + rename): from then on the staging
   directory is a complete checkpoint;
3. :func:`publish_step_dir` renames it to ``step_N``. Only when ``step_N`` already exists (a run that
   re-saves a step, e.g. resumed after it finished) the old one is first renamed to ``.step_N.old`` and
   deleted after the new one is in place;
4. :func:`prune_step_dirs` (``keep_last_n_checkpoints``) removes older complete checkpoints, after.

A save that fails (a full disk, a vanished mount) removes its staging directory at once and raises
:func:`save_failure`'s error, which says "no space left on device" with the path when that is the cause
(PyTorch's writer reports a full disk as ``basic_ios::clear: iostream error`` or ``unexpected pos``).

A kill at any point leaves a complete ``step_N`` or a complete ``.step_N.staging``;
:func:`recover_interrupted_saves` (run before resuming) publishes the latter and removes leftovers. A
directory without ``recipe_state.pt`` is an interrupted save and is never resumed from.
"""

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from torchtune_grpo.runtime.crash_points import crash_point

__all__ = [
    "RECIPE_STATE_FILE",
    "begin_step_dir",
    "checkpoint_retention",
    "complete_step_dirs",
    "find_latest_checkpoint",
    "model_files",
    "prune_step_dirs",
    "publish_step_dir",
    "recover_interrupted_saves",
    "restart_lr_schedule",
    "save_failure",
    "step_dir",
    "step_dirs",
]

RECIPE_STATE_FILE = "recipe_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_DIR = re.compile(r"^\.step_(\d+)\.staging$")
_OLD_DIR = re.compile(r"^\.step_(\d+)\.old$")


def step_dir(output_dir: str, step: int) -> Path:
    """The checkpoint directory of ``step``: ``{output_dir}/step_{step}``."""
    return Path(output_dir) / f"step_{step}"


def _staging_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / f".step_{step}.staging"


def _is_complete(directory: Path) -> bool:
    return (directory / RECIPE_STATE_FILE).is_file()


def checkpoint_retention(value: Any) -> Optional[int]:
    """``keep_last_n_checkpoints`` checked: None (keep all) or an int >= 1.

    Raises:
        ValueError: naming the key and the value otherwise.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"keep_last_n_checkpoints must be an integer >= 1 or null (keep all), got {value!r}"
        )
    return value


def begin_step_dir(output_dir: str, step: int) -> Path:
    """The staging directory to write step ``step``'s checkpoint into (not created; any leftover removed).

    A leftover staging directory of the same step is from a save that was killed (and, when the run
    resumed, :func:`recover_interrupted_saves` has already published it if it was complete).
    """
    staging = _staging_dir(output_dir, step)
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish_step_dir(output_dir: str, staging: Path, step: int, recipe_state: Dict[str, Any]) -> Path:
    """Mark ``staging`` complete (``recipe_state.pt``, atomically) and rename it to ``step_{step}``.

    An existing ``step_{step}`` is moved aside (``.step_{step}.old``) only once ``staging`` is complete,
    and deleted after the rename.

    Args:
        output_dir (str): the run's output directory.
        staging (Path): the directory from :func:`begin_step_dir`, holding the model files.
        step (int): the training step the checkpoint belongs to.
        recipe_state (Dict[str, Any]): what ``recipe_state.pt`` holds.

    Returns:
        Path: the final directory.
    """
    crash_point("save", step)  # model files written, the checkpoint not yet complete
    tmp = staging / (RECIPE_STATE_FILE + ".tmp")
    torch.save(recipe_state, tmp)
    os.replace(tmp, staging / RECIPE_STATE_FILE)
    target = step_dir(output_dir, step)
    old = Path(output_dir) / f".step_{step}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        crash_point("replace", step)  # no step_N for a moment: the complete staging directory stands in
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def recover_interrupted_saves(output_dir: str) -> List[str]:
    """Finish or clean up what killed saves left in ``output_dir``; returns what was done, one line each.

    A complete ``.step_N.staging`` without ``step_N`` (killed while replacing ``step_N``) is published;
    incomplete staging directories and ``.step_N.old`` leftovers are removed. Run it on one process, while
    no save is under way.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    done = []
    for child in sorted(root.iterdir()):
        staging = _STAGING_DIR.match(child.name)
        if not staging:
            continue
        target = step_dir(output_dir, int(staging.group(1)))
        if _is_complete(child) and not target.exists():
            os.replace(child, target)
            done.append(f"published the complete interrupted save {child.name} as {target.name}")
        else:
            shutil.rmtree(child, ignore_errors=True)
            done.append(f"removed the incomplete interrupted save {child.name}")
    # A .step_N.old is only ever made while a newer complete checkpoint exists (step_N's replacement, now
    # published above, or a later step when pruning): never the last copy.
    for child in sorted(root.iterdir()):
        if _OLD_DIR.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
            done.append(f"removed {child.name} (replaced or pruned)")
    return done


def step_dirs(output_dir: str) -> Dict[int, Path]:
    """Every ``step_N`` directory, complete or not, by N."""
    root = Path(output_dir)
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return found


def complete_step_dirs(output_dir: str) -> Dict[int, Path]:
    """Every complete ``step_N`` directory, by N."""
    return {n: d for n, d in step_dirs(output_dir).items() if _is_complete(d)}


def find_latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The complete ``step_N`` directory with the largest N, or None when there is none."""
    found = complete_step_dirs(output_dir)
    return found[max(found)] if found else None


def prune_step_dirs(output_dir: str, step: int, keep_last_n: Optional[int]) -> List[Path]:
    """Remove complete checkpoints older than ``step`` beyond the ``keep_last_n`` newest (with ``step``'s).

    Called after step ``step``'s checkpoint is complete. Checkpoints of later steps (left by another run in
    the same directory) are not touched. None keeps everything.

    Returns:
        List[Path]: the removed directories.
    """
    if keep_last_n is None:
        return []
    older = sorted(s for s in complete_step_dirs(output_dir) if s < step)
    removed = []
    for s in older[: max(len(older) - (keep_last_n - 1), 0)]:
        # Renamed first, so a kill mid-delete never leaves a step_N that looks complete but is not.
        aside = Path(output_dir) / f".step_{s}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(step_dir(output_dir, s), aside)
        shutil.rmtree(aside)
        removed.append(step_dir(output_dir, s))
    return removed


def model_files(directory: Path) -> List[str]:
    """The model weight files (safetensors, else .bin) of a checkpoint directory, sorted."""
    files = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("adapter"))
    if not files:
        files = sorted(p.name for p in directory.glob("*.bin") if not p.name.startswith("adapter"))
    if not files:
        raise FileNotFoundError(f"no model weight files (*.safetensors or *.bin) in {directory}")
    return files


def restart_lr_schedule(scheduler: Any) -> None:
    """Set each parameter group's learning rate to what the *current* schedule gives at the restored step.

    A resumed optimizer carries the learning rate the checkpoint's schedule set for its next step. When the
    run's length changed since (``max_steps`` raised to train on), the schedule, rebuilt for the new length,
    gives another value there: at the end of a cosine schedule the restored rate is 0, and without this the
    first resumed step would not move the weights. Schedules built on ``LambdaLR`` (all of torchtune's) are
    recomputed from their closed form ``base_lr x lambda(step)``; others are left as restored.

    Args:
        scheduler (Any): the run's learning-rate scheduler, after ``load_state_dict``.
    """
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    step = scheduler.last_epoch
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)


# Below this much free space a failed write is taken to be a full disk: PyTorch's and safetensors' writers
# do not pass the operating system's ENOSPC on (they raise RuntimeError with their own messages).
_NEARLY_FULL_BYTES = 64 * 2**20


def save_failure(error: BaseException, output_dir: str, staging: Path, step: int) -> Exception:
    """The error to raise when writing step ``step``'s checkpoint into ``staging`` failed with ``error``.

    Call it before removing ``staging`` (its partial files still take the space that tells a full disk).
    A full disk (``ENOSPC`` anywhere in the exception chain, or less than 64 MiB left on the file system)
    gives an ``OSError(ENOSPC)`` naming the path and the free space; anything else an ``OSError`` naming the
    path and the original error. Either says which complete checkpoints are intact.
    """
    intact = ", ".join(p.name for _, p in sorted(complete_step_dirs(output_dir).items())) or "none yet"
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError:
        free = None
    full = _mentions_enospc(error) or (free is not None and free < _NEARLY_FULL_BYTES)
    where = f"writing the checkpoint of step {step} to {staging}"
    tail = (f"The partial checkpoint was removed; the complete checkpoints ({intact}) are intact and "
            "resume_from_checkpoint=True continues from the newest.")
    if full:
        shown = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
        return OSError(errno.ENOSPC, f"No space left on device while {where} ({type(error).__name__}: "
                       f"{error}; {shown} free). Free space there or point output_dir elsewhere. {tail}")
    return OSError(getattr(error, "errno", None) or errno.EIO, f"Failed {where}: {type(error).__name__}: {error}. {tail}")


def _mentions_enospc(error: BaseException) -> bool:
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False
