"""A run's checkpoints: when one is due, how it is written, what training state it holds, how a run resumes.

:class:`CheckpointManager` owns ``output_dir``'s ``step_N`` directories: the save interval, staging ->
publishing -> pruning (torchtune_grpo/checkpoints/storage.py), a failed write reported and cleaned up, finishing
what killed saves left, and finding the checkpoint to resume from (torchtune_grpo/checkpoints/resume.py). What goes into
a checkpoint's model files is the recipe's (``write_model_files``: the full recipe writes a Hugging Face
directory, the LoRA recipe adds its adapter); the rest of the training state, the same for every recipe, is
:func:`capture_training_state` / :func:`restore_training_state`: optimizer, LR schedule, data loader
position, every rank's RNG streams, step, epoch, seed and the run's config.

Disk work happens on one process (the caller's rank 0); the collectives that gather model, optimizer and RNG
states are the caller's (passed in), so this module holds no process group.
"""

import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torchtune import training

from torchtune_grpo.checkpoints.storage import (
    begin_step_dir,
    prune_step_dirs,
    publish_step_dir,
    recover_interrupted_saves,
    restart_lr_schedule,
    save_failure,
)
from torchtune_grpo.metrics.run_logs import rewind_jsonl
from torchtune_grpo.checkpoints.resume import load_resume_point, ResumePoint

__all__ = [
    "CheckpointManager", "SavedCheckpoint", "capture_training_state", "data_position_for", "restore_training_state",
    "restored_rollouts",
]

# The logs a resumed run cuts back to its checkpoint's step, so that each step appears once.
_RUN_LOGS = ("metrics.jsonl", "completions.jsonl")


class SavedCheckpoint(NamedTuple):
    """What :meth:`CheckpointManager.write` did.

    Attributes:
        directory (Path): the new ``step_N``.
        seconds (float): time spent writing it.
        removed (List[Path]): older checkpoints pruned (``keep_last_n_checkpoints``).
    """

    directory: Path
    seconds: float
    removed: List[Path]


class CheckpointManager:
    """The checkpoints of one run in ``output_dir`` (see the module docstring).

    Args:
        output_dir (str): the run's output directory.
        write_model_files (Callable[[Dict[str, Any], Path, int], None]): writes a checkpoint's model files as
            the directory given (``(model_state, staging_dir, step)``; it may create the directory or move one
            into place).
        save_every_n_steps (Optional[int]): the save period; None saves only the final step. Default is None.
        keep_last_n (Optional[int]): complete checkpoints kept; None keeps all. Default is None.
        on_broken (str): ``"use_previous"`` or ``"error"`` for an unreadable newest checkpoint on resume.
            Default is ``"use_previous"``.
        discard_partial (Callable[[int], None]): removes what ``write_model_files`` may leave outside the
            staging directory when a write of step ``N`` fails. Default does nothing.
    """

    def __init__(
        self,
        output_dir: str,
        write_model_files: Callable[[Dict[str, Any], Path, int], None],
        *,
        save_every_n_steps: Optional[int] = None,
        keep_last_n: Optional[int] = None,
        on_broken: str = "use_previous",
        discard_partial: Callable[[int], None] = lambda step: None,
    ) -> None:
        self.output_dir = str(output_dir)
        self.write_model_files = write_model_files
        self.save_every_n_steps = None if save_every_n_steps is None else int(save_every_n_steps)
        self.keep_last_n = keep_last_n
        self.on_broken = on_broken
        self.discard_partial = discard_partial

    def is_due(self, step: int, total_steps: int) -> bool:
        """Whether a periodic save is due after ``step`` (the final step is saved by the caller, once)."""
        every = self.save_every_n_steps
        return bool(every) and step < total_steps and step % every == 0

    def recover(self) -> List[str]:
        """Finish or remove what killed or failed saves left (one process, before anything is written)."""
        return recover_interrupted_saves(self.output_dir)

    def resume_point(self, cut_logs: bool) -> "tuple[ResumePoint, List[str]]":
        """The checkpoint to resume from, and what was done (one line each).

        Args:
            cut_logs (bool): cut ``metrics.jsonl``/``completions.jsonl`` back to its step (one process only).

        Raises:
            FileNotFoundError, RuntimeError: see :func:`~torchtune_grpo.checkpoints.resume.load_resume_point`.
        """
        point = load_resume_point(self.output_dir, self.on_broken)
        done = []
        if cut_logs:
            for name in _RUN_LOGS:
                if removed := rewind_jsonl(Path(self.output_dir) / name, point.step):
                    done.append(f"Resuming at step {point.step}: removed {removed} later record(s) from {name}")
        return point, done

    def write(self, step: int, model_state: Dict[str, Any], training_state: Dict[str, Any]) -> SavedCheckpoint:
        """Write ``step_{step}`` (staging, then renamed), then prune; one process.

        Raises:
            OSError: a failed write (a full disk: "No space left on device ..."), after removing the partial
                checkpoint; the complete ones are untouched.
        """
        t0 = time.perf_counter()
        staging = begin_step_dir(self.output_dir, step)
        try:
            self.write_model_files(model_state, staging, step)
            target = publish_step_dir(self.output_dir, staging, step, training_state)
        except Exception as e:  # a full disk, mostly: say so, and free what the partial save took
            error = save_failure(e, self.output_dir, staging, step)
            shutil.rmtree(staging, ignore_errors=True)
            self.discard_partial(step)
            raise error from e
        removed = prune_step_dirs(self.output_dir, step, self.keep_last_n)
        return SavedCheckpoint(target, time.perf_counter() - t0, removed)


def capture_training_state(
    *,
    step: int,
    epoch: int,
    seed: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Optional[Any],
    dataloader: Any,
    generator: torch.Generator,
    device: torch.device,
    is_rank_zero: bool,
    gather_objects: Callable[[Any], List[Any]],
    config: Optional[Dict[str, Any]] = None,
    rollouts: Optional[Any] = None,
) -> Dict[str, Any]:
    """Everything but the model weights that a resumed run needs to continue exactly (every rank calls it).

    Args:
        step (int), epoch (int), seed (int): where the run is.
        model (torch.nn.Module): the (FSDP2-sharded) policy, for the optimizer state's names.
        optimizer (torch.optim.Optimizer): its optimizer (gathered to rank 0).
        lr_scheduler (Optional[Any]): the scheduler, or None.
        dataloader (Any): a ``StatefulDataLoader`` (its position).
        generator (torch.Generator): this rank's sampling generator.
        device (torch.device): the training device.
        is_rank_zero (bool): whether this is rank 0 (it receives the full optimizer state).
        gather_objects (Callable[[Any], List[Any]]): every rank's object, in rank order (a collective).
        config (Optional[Dict[str, Any]]): the run's resolved config (a resume lists what changed).
        rollouts (Optional[Any]): this rank's rollouts in flight (a generation worker's ``state_dict``; every
            rank passes one or none). Default is None.

    Returns:
        Dict[str, Any]: ``recipe_state.pt``'s content (complete on rank 0).
    """
    # RNG states differ per rank: gather them all so every rank resumes its own stream.
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "generator": generator.get_state(),
        "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
    }
    all_rng = gather_objects(rng)
    return {
        "step": step,
        "epoch": epoch,
        "seed": seed,
        "world_size": len(all_rng),
        "optimizer": training.get_full_optimizer_state_dict(model, optimizer, is_rank_zero, device=device),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "dataloader": dataloader.state_dict(),
        "rng": all_rng,
        "config": config,
        "rollouts": gather_objects(rollouts) if rollouts is not None else None,
    }


def data_position_for(loader_state: Dict[str, Any], saved_world_size: int, world_size: int,
                      batch_size: int) -> Tuple[Dict[str, Any], str]:
    """A prompt loader's position saved on ``saved_world_size`` processes, for a run on ``world_size``.

    Every process's ``DistributedSampler`` takes every ``world_size``-th prompt of the same epoch order, so after
    ``k`` samples on each of ``P`` processes the epoch's first ``k * P`` prompts are used, whatever ``P`` is. The
    saved position (a ``StatefulDataLoader``'s ``state_dict``: ``samples_yielded`` of this process's share, and the
    batches yielded) counts one process's share; restored as it is on another number of processes it would skip
    prompts (more processes) or use them again (fewer). The converted position continues at the first global batch
    boundary of the new run at or before the used prefix, so no prompt is skipped; the few between that boundary
    and the prefix's end are used again.

    Args:
        loader_state (Dict[str, Any]): the saved ``StatefulDataLoader.state_dict()`` (one process's; every process
            saves the same position).
        saved_world_size (int): processes of the run that saved it.
        world_size (int): processes of this run.
        batch_size (int): prompts per process per step in this run.

    Returns:
        Tuple[Dict[str, Any], str]: the position to load, and a sentence saying where the epoch continues.

    Raises:
        ValueError: when ``loader_state`` is not a single-process ``StatefulDataLoader``'s position.
    """
    sampler = loader_state.get("_sampler_iter_state")
    try:
        used = 0 if sampler is None else int(sampler["samples_yielded"]) * saved_world_size  # the epoch's first
    except (KeyError, TypeError) as e:
        raise ValueError(f"the checkpoint's data position ({sorted(loader_state)}) is not a StatefulDataLoader's "
                         "with one loading process; it cannot be moved to another number of processes") from e
    if used == 0:  # saved before the epoch's first batch
        return loader_state, "this epoch starts from its first prompt"
    batches = used // (batch_size * world_size)
    state = {**loader_state, "_sampler_iter_state": {**sampler, "samples_yielded": batches * batch_size},
             "_sampler_iter_yielded": batches, "_num_yielded": batches}
    again = used - batches * batch_size * world_size
    return state, (f"this epoch's first {used} prompts were used on {saved_world_size} process(es); it continues on "
                   f"{world_size} from prompt {used - again}" + (f" ({again} used again)" if again else ""))


def restore_training_state(
    state: Dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Optional[Any],
    dataloader: Any,
    generator: torch.Generator,
    device: torch.device,
    rank: int,
    world_size: int,
) -> Optional[str]:
    """Load :func:`capture_training_state`'s output into a freshly built run (every rank).

    The learning rate is set to what the *current* schedule gives at the restored step
    (:func:`~torchtune_grpo.checkpoints.storage.restart_lr_schedule`: the run may have been lengthened). On another
    number of processes the data position is converted (:func:`data_position_for`) and the RNG streams restart.

    Returns:
        Optional[str]: None when the world size is the checkpoint's (everything restored), else what restarted and
        where the data continues, for the log.
    """
    training.load_from_full_optimizer_state_dict(model, optimizer, state["optimizer"], device)
    if lr_scheduler is not None and state["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        restart_lr_schedule(lr_scheduler)
    if state["world_size"] != world_size:
        position, where = data_position_for(state["dataloader"], state["world_size"], world_size,
                                            dataloader.batch_size)
        dataloader.load_state_dict(position)
        return f"World size changed since the checkpoint: RNG streams restart; {where}."
    dataloader.load_state_dict(state["dataloader"])
    rng = state["rng"][rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    generator.set_state(rng["generator"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return None


def restored_rollouts(state: Dict[str, Any], rank: int, world_size: int) -> Optional[Any]:
    """This rank's rollouts in flight from :func:`capture_training_state`'s output: None when there were none
    (synchronous rollouts) or the world size changed (the workers then sample those batches again)."""
    rollouts = state.get("rollouts")
    if rollouts is None or state["world_size"] != world_size:
        return None
    return rollouts[rank]
