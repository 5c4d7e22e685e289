"""Checks a recipe runs at setup that need the file system or a built object, not just the config.

``torchtune_grpo/config.py`` checks the config's values; these check what they point at: an output
directory that can be written, a checkpoint to resume from, and checkpoint tensors that fit the model.
Each raises naming the key, the value and what it found, before any weights are loaded into a model.
"""

import tempfile
from pathlib import Path
from typing import Dict, Iterable, Tuple

import torch

from torchtune_grpo.checkpointing import find_latest_checkpoint, RECIPE_STATE_FILE, step_dirs

__all__ = ["check_output_dir", "check_state_dict_shapes", "require_resume_checkpoint"]



def check_output_dir(output_dir: str) -> None:
    """Create ``output_dir`` if needed and make sure a file can be written in it.

    Raises:
        ValueError: naming ``output_dir``, its value and the operating system's reason.
    """
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r} is not writable ({type(e).__name__}: {e.strerror or e}). Metrics and "
            "checkpoints go there: set output_dir to a directory you can write."
        ) from e


def require_resume_checkpoint(output_dir: str) -> Path:
    """The latest complete ``step_N`` checkpoint in ``output_dir``, for ``resume_from_checkpoint: True``.

    Raises:
        FileNotFoundError: when there is none, saying what the directory holds instead.
    """
    found = find_latest_checkpoint(output_dir)
    if found is not None:
        return found
    found = step_dirs(output_dir)
    steps = [found[n] for n in sorted(found)]
    if steps:
        what = f"{', '.join(p.name for p in steps)} without {RECIPE_STATE_FILE} (interrupted saves)"
    else:
        what = "no step_N directories"
    raise FileNotFoundError(
        f"resume_from_checkpoint=True but output_dir={output_dir!r} holds no complete checkpoint: {what}. "
        "Point output_dir at the run to resume, or set resume_from_checkpoint=False to start afresh."
    )


def check_state_dict_shapes(
    model_tensors: Iterable[Tuple[str, torch.Tensor]], state_dict: Dict[str, torch.Tensor], source: str
) -> None:
    """Fail, naming a tensor and both shapes, when a checkpoint comes from a model of another shape.

    Run it on the model still on the meta device: only shapes are read. Names in only one of the two are
    left to the strict load that follows (it lists them).

    Args:
        model_tensors (Iterable[Tuple[str, torch.Tensor]]): the model's ``(name, tensor)``, e.g.
            ``chain(model.named_parameters(), model.named_buffers())``.
        state_dict (Dict[str, torch.Tensor]): the checkpoint's tensors under the model's names.
        source (str): where the checkpoint came from (a directory), for the message.

    Raises:
        ValueError: listing the first mismatched tensors with the checkpoint's and the model's shape.
    """
    mismatched = [
        (name, tuple(state_dict[name].shape), tuple(t.shape))
        for name, t in model_tensors
        if name in state_dict and tuple(state_dict[name].shape) != tuple(t.shape)
    ]
    if mismatched:
        shown = "; ".join(f"{n}: checkpoint {c}, model {m}" for n, c, m in mismatched[:3])
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise ValueError(
            f"The checkpoint in {source} is from a model of another shape: {shown}{more}. Make `model:` "
            "describe the checkpoint's model (or point checkpointer.checkpoint_dir at one of this shape)."
        )
