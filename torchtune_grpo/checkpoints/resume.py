"""Resuming: which checkpoint a run continues from, what changed since, and a record of every start.

:func:`load_resume_point` reads the newest ``step_N`` whose ``recipe_state.pt`` loads. A newest checkpoint
that cannot be read (a truncated or deleted ``recipe_state.pt``) is named in the log and
the previous one is used (``on_broken_checkpoint: use_previous``, the default), or the run stops naming it
(``on_broken_checkpoint: error``). Nothing is deleted: the broken directory stays for inspection and is
replaced when the resumed run saves that step again.

Each start writes its resolved config to ``{output_dir}/configs/`` (:func:`save_start_config`), so the
settings of every stretch of a resumed run are kept, and the checkpoint carries the config it was trained
with, so a resume lists the keys that changed (:func:`config_changes`).
"""

import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import torch
import yaml

from torchtune_grpo.checkpoints.storage import RECIPE_STATE_FILE, step_dirs

__all__ = [
    "BROKEN_CHECKPOINT_POLICIES", "ResumePoint", "config_changes", "earlier_run_note", "load_resume_point",
    "save_start_config",
]

#: The values of ``on_broken_checkpoint``.
BROKEN_CHECKPOINT_POLICIES = ("use_previous", "error")

# Keys that differ between the first start and a resume by design.
_EXPECTED_TO_CHANGE = {"resume_from_checkpoint"}


class ResumePoint(NamedTuple):
    """The checkpoint a run resumes from.

    Attributes:
        directory (Path): the ``step_N`` directory.
        state (Dict[str, Any]): its ``recipe_state.pt``.
        notes (List[str]): one line per newer checkpoint that was passed over, saying why.
    """

    directory: Path
    state: Dict[str, Any]
    notes: List[str]

    @property
    def step(self) -> int:
        return int(self.directory.name.split("_")[-1])


def load_resume_point(output_dir: str, on_broken: str = "use_previous") -> ResumePoint:
    """The newest readable checkpoint of ``output_dir`` and its recipe state.

    Args:
        output_dir (str): the run's output directory.
        on_broken (str): ``"use_previous"`` passes over unreadable checkpoints (each named in ``notes``);
            ``"error"`` raises on the newest one if it is unreadable. Default is ``"use_previous"``.

    Raises:
        ValueError: ``on_broken`` is not one of :data:`BROKEN_CHECKPOINT_POLICIES`.
        RuntimeError: ``on_broken="error"`` and the newest checkpoint cannot be read (naming it and why).
        FileNotFoundError: no readable checkpoint, saying what the directory holds.
    """
    if on_broken not in BROKEN_CHECKPOINT_POLICIES:
        raise ValueError(f"on_broken_checkpoint must be one of {list(BROKEN_CHECKPOINT_POLICIES)}, got {on_broken!r}")
    found = step_dirs(output_dir)
    problems: List[str] = []
    for n in sorted(found, reverse=True):
        directory = found[n]
        state_file = directory / RECIPE_STATE_FILE
        if not state_file.is_file():
            problem = f"{directory} has no {RECIPE_STATE_FILE} (deleted, or not written by this recipe)"
        else:
            try:
                state = torch.load(state_file, map_location="cpu", weights_only=False)
                notes = [f"{p}: not resumable, resuming from {directory.name} instead" for p in problems]
                return ResumePoint(directory, state, notes)
            except Exception as e:  # a truncated or corrupt file raises whatever its reader raises
                problem = f"{state_file} cannot be read ({type(e).__name__}: {_first_line(e)})"
        if on_broken == "error":
            raise RuntimeError(
                f"Cannot resume from the newest checkpoint: {problem}. Move {directory.name} out of "
                f"{output_dir} to resume from the one before, or set on_broken_checkpoint=use_previous."
            )
        problems.append(problem)
    what = "; ".join(problems) if problems else "no step_N directories"
    raise FileNotFoundError(
        f"resume_from_checkpoint=True but output_dir={output_dir!r} holds no readable checkpoint: {what}. "
        "Point output_dir at the run to resume, or set resume_from_checkpoint=False to start afresh."
    )


def earlier_run_note(output_dir: str) -> Optional[str]:
    """What a fresh start (``resume_from_checkpoint: False``) should be told about an earlier run in
    ``output_dir``: its checkpoints and logs, which the new run replaces and appends to. None when empty."""
    steps = sorted(step_dirs(output_dir))
    metrics = Path(output_dir) / "metrics.jsonl"
    if not steps and not (metrics.is_file() and metrics.stat().st_size):
        return None
    held = ", ".join(f"step_{n}" for n in steps) or "no checkpoints"
    return (f"output_dir={output_dir!r} holds an earlier run ({held}; metrics.jsonl). This fresh start "
            "(resume_from_checkpoint=False) appends to its metrics.jsonl/completions.jsonl and replaces its "
            "checkpoints of the same steps; set resume_from_checkpoint=True to continue it instead, or use "
            "another output_dir.")


def config_changes(saved: Optional[Dict[str, Any]], current: Dict[str, Any]) -> List[str]:
    """``key: old -> new`` for every setting (dotted keys) that differs between two resolved configs.

    ``resume_from_checkpoint`` is left out (it changes by design). An empty list when ``saved`` is None
    (a checkpoint written before configs were recorded).
    """
    if saved is None:
        return []
    old, new = _flatten(saved), _flatten(current)
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in _EXPECTED_TO_CHANGE or old.get(key, _ABSENT) == new.get(key, _ABSENT):
            continue
        changes.append(f"{key}: {_show(old.get(key, _ABSENT))} -> {_show(new.get(key, _ABSENT))}")
    return changes


def save_start_config(output_dir: str, config: Dict[str, Any], resumed_step: Optional[int]) -> Path:
    """Write this start's resolved config to ``{output_dir}/configs/<UTC time>_<start|resume_step_N>.yaml``."""
    directory = Path(output_dir) / "configs"
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    kind = "start" if resumed_step is None else f"resume_step_{resumed_step}"
    path = directory / f"{stamp}_{kind}.yaml"
    k = 1
    while path.exists():  # two starts within a second
        path = directory / f"{stamp}_{kind}_{k}.yaml"
        k += 1
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


_ABSENT = object()


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": [1, 2]}}`` -> ``{"a.b.0": 1, "a.b.1": 2}`` (an empty dict or list stays a leaf)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix.rstrip("."): tree}
    out: Dict[str, Any] = {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}{key}."))
    return out or {prefix.rstrip("."): tree}


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else "no message"
