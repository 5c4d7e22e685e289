"""Checks a recipe runs at setup that need the file system or a built object, not just the config.

``torchtune_grpo/config/__init__.py`` checks the config's values; these check what they point at: an output
directory that can be written, a device that exists, and checkpoint tensors that fit the model.
Each raises naming the key, the value and what it found, before any weights are loaded into a model.
"""

import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from torchtune_grpo.config.schema import LoRARecipeConfig
from torchtune_grpo.rollouts.evaluation import correctness_name
from torchtune_grpo.training.batch import shared_prompt_unsupported, shared_row_length

__all__ = ["check_device", "check_output_dir", "check_state_dict_shapes", "training_layout"]



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


def check_device(device: str) -> None:
    """Fail when ``device`` names an accelerator this machine does not have.

    torchtune's ``get_device`` falls back to the CPU without a word; a run asked to train on a GPU must not
    quietly train on the CPU instead.

    Raises:
        ValueError: naming ``device``, its value and what torch sees.
    """
    try:
        kind = torch.device(str(device)).type
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a device torch knows ({e}); use cpu, cuda, cuda:N, ...") from e
    if kind == "cpu":
        return
    backend = getattr(torch, kind, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        build = f", built with CUDA {torch.version.cuda}" if torch.version.cuda else ", a build without CUDA"
        raise ValueError(
            f"device={device!r} but torch sees no {kind} device here (torch.{kind}.is_available() is False; "
            f"torch {torch.__version__}{build if kind == 'cuda' else ''}). Set device=cpu to train on the CPU, "
            "or install a torch build for this accelerator."
        )
    index = torch.device(str(device)).index
    count = getattr(backend, "device_count", lambda: None)()
    if index is not None and count is not None and index >= count:
        raise ValueError(f"device={device!r} but only {count} {kind} device(s) are visible.")


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


def training_layout(
    model: nn.Module,
    *,
    share_prompt: bool,
    explicit: bool,
    max_prompt_length: Optional[int],
    max_response_length: int,
    group_size: int,
    micro_batch_size: int,
    pack: bool = False,
) -> Tuple[bool, Optional[str]]:
    """Whether training forwards share each prompt across its group's rows, and what to tell the user.

    With ``share_prompt`` on and a model that cannot share prompts, the default falls back to one row per
    sequence (same results), said in the returned note; asked for explicitly in the config, it is an error.
    When a shared row can exceed the model's ``max_seq_len``, the note says such micro-batches are computed
    one row per sequence.

    Args:
        model (nn.Module): the policy.
        share_prompt (bool): ``share_prompt_in_training``.
        explicit (bool): whether the config wrote ``share_prompt_in_training`` (rather than the default).
        max_prompt_length (Optional[int]): the longest prompt, or None (unknown).
        max_response_length (int): the response budget.
        group_size (int): completions per prompt.
        micro_batch_size (int): rows per forward.
        pack (bool): ``pack_sequences_in_training`` (packed rows are for one row per sequence: with prompts
            shared, the note says it is not used). Default is False.

    Returns:
        Tuple[bool, Optional[str]]: the layout to use, and a note to log (None: nothing to say).

    Raises:
        ValueError: ``share_prompt_in_training: true`` written in the config, with a model that cannot.
    """
    shared, note = _shared_layout(
        model, share_prompt, explicit, max_prompt_length, max_response_length, group_size, micro_batch_size
    )
    if pack and shared:
        note = (note + " " if note else "") + (
            "pack_sequences_in_training: not used, prompts are shared (share_prompt_in_training); packed rows "
            "are for one row per sequence."
        )
    return shared, note


def _shared_layout(
    model: nn.Module, share_prompt: bool, explicit: bool, max_prompt_length: Optional[int],
    max_response_length: int, group_size: int, micro_batch_size: int,
) -> Tuple[bool, Optional[str]]:
    if not share_prompt:
        return False, None
    reason = shared_prompt_unsupported(model)
    if reason is not None:
        if explicit:
            raise ValueError(f"share_prompt_in_training: true, but {reason}. Set share_prompt_in_training: false.")
        return False, (
            f"Training layout: one row per sequence, because {reason} (share_prompt_in_training is on by "
            "default; the results are the same, the prompt is computed once per sequence)."
        )
    max_seq_len = getattr(model, "max_seq_len", None)
    per_row = min(group_size, micro_batch_size)
    longest = None if max_prompt_length is None else shared_row_length(max_prompt_length, max_response_length, per_row)
    if max_seq_len is None or (longest is not None and longest <= max_seq_len):
        return True, None
    shown = "unknown (no max_prompt_length)" if longest is None else longest
    return True, (
        f"Training layout: a micro-batch whose shared-prompt row (prompt + {per_row} completions; longest "
        f"{shown}) exceeds the model's max_seq_len {max_seq_len} is computed one row per sequence (same "
        "results, no prompt sharing for it)."
    )


def check_evaluation_keys(
    cfg: Any, has_validation: bool, reward_names: Sequence[str], eval_reward: Optional[str]
) -> Optional[str]:
    """Fail on an ``eval_reward`` that names no reward (before any model is built); without ``validation``,
    say which ``eval_*`` keys go unused.

    Args:
        cfg (Any): the run's config (its keys).
        has_validation (bool): whether ``validation`` is set.
        reward_names (Sequence[str]): the reward components' names.
        eval_reward (Optional[str]): the ``eval_reward`` key.

    Returns:
        Optional[str]: a note for the log, or None.

    Raises:
        ValueError: if ``eval_reward`` names no reward component.
    """
    if has_validation:
        correctness_name(list(reward_names), eval_reward)
        return None
    unused = sorted(k for k in cfg if k.startswith("eval_") and cfg[k] is not None)
    return f"No held-out evaluation (validation is not set): {unused} are not used." if unused else None


def check_generation_workers(config: Any, engine: Any) -> None:
    """Refuse, naming the key, what generation workers do not support yet (before any process group).

    Args:
        config (Any): the typed config (``generation_workers``; the LoRA recipe's :class:`LoRARecipeConfig`).
        engine (Any): the configured generation engine.

    Raises:
        ValueError: for LoRA with an engine that holds its own weights (vLLM), with workers on; for
            ``in_flight_updates`` without workers, with an engine that cannot take weights while it generates,
            or with multi-turn episodes.
    """
    workers = config.generation_workers
    if workers.in_flight_updates:
        if not workers.enabled:
            raise ValueError("generation_workers.in_flight_updates needs generation_workers.enabled: true (the "
                             "updates land in a worker's engine while it generates)")
        if not getattr(engine, "supports_in_flight_updates", False):
            raise ValueError(
                f"generation_workers.in_flight_updates needs an engine that takes weights while it generates "
                f"(torchtune_grpo.generation.VLLMServerGenerator); {type(engine).__name__} does not"
            )
        if config.environment is not None:
            raise ValueError("generation_workers.in_flight_updates is single-turn only: with an environment "
                             "(multi-turn episodes) the tokens' weight versions are not tracked through the turns")
    if not workers.enabled:
        return
    if engine.holds_weights and isinstance(config, LoRARecipeConfig):
        raise ValueError(
            f"generation_workers.enabled with {type(engine).__name__} in the LoRA recipe is not supported yet "
            "(the worker would need the adapter sync): use torchtune_grpo.generation.NativeGenerator in the "
            "workers, or turn generation_workers off to use LoRA with vLLM in the trainer's process"
        )
