"""The image side of a vision-language run (docs/multimodal.md): a dataset whose prompts carry images gives the
policy, and the reference, the multimodal directory's vision tower and projector.

The tower and projector are frozen unless ``train_vision`` says ``projector`` or ``tower``; then their parameters
join the optimizer as a group of their own and are saved with every step under the checkpoint's names
(:func:`~torchtune_grpo.models.image_state_dict`). When FSDP2 wraps the policy, the trained modules become FSDP2
units of their own under it (the tower's blocks one by one, then the rest): their gradients are reduced across the
processes like the language model's, and their parameters and optimizer state sharded. A frozen tower or projector
stays a whole copy on every process (no gradient: the copies stay equal).

A reference that is the policy itself in a context (the LoRA recipe's: adapters off) would see the trained modules.
:func:`attach_image_side` then keeps a frozen copy of them as loaded from the source (a whole copy on every process,
as a frozen tower is), and :func:`initial_image_side` puts it in their place for the reference's forwards. The
LoRA recipe saves the trained tensors in a file of their own, :data:`IMAGE_SIDE_FILE` (the image-text class's
names, :func:`image_side_state`), and a resumed run loads them over the source's (``trained_file``).
"""

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtune_grpo.models import (
    attach_images, image_class_names, image_modules_replaced, image_parameters, trained_image_modules,
    trained_image_paths, TransformersDecoder,
)

__all__ = ["attach_image_side", "IMAGE_SIDE_FILE", "image_side_state", "initial_image_side"]

#: The trained vision tensors of a LoRA step directory, under ``AutoModelForImageTextToText``'s names.
IMAGE_SIDE_FILE = "image_side.safetensors"

_WHAT = {"none": "frozen", "projector": "projector trained", "tower": "tower and projector trained"}
_KEPT = {"projector": "projector", "tower": "tower and projector"}


def attach_image_side(policy: nn.Module, reference: Optional[nn.Module], optimizer: Any, *, engine: Any,
                      train: str, policy_source: str, reference_source: str,
                      device: Optional[torch.device] = None,
                      shard: Optional[Callable[[Sequence[nn.Module]], int]] = None,
                      trained_file: Optional[Path] = None, workers: bool = False) -> str:
    """Attach the directory's image side to ``policy`` (and ``reference``); returns the line the run logs.

    Args:
        policy (nn.Module): the policy, a :class:`~torchtune_grpo.models.TransformersDecoder` (possibly FSDP2-wrapped).
        reference (Optional[nn.Module]): the reference model, the policy itself (a reference that is the policy in a
            context: LoRA's adapters off), or None (no KL term).
        optimizer (Any): the policy's optimizer: trained vision parameters are added to it as one group.
        engine (Any): the run's generation engine; it must take images
            (:attr:`~torchtune_grpo.generation.GenerationEngine.takes_images`).
        train (str): ``train_vision``: ``none``, ``projector`` or ``tower``.
        policy_source (str): the directory the policy's tower comes from (the step being resumed, else the source).
        reference_source (str): the directory the reference's tower comes from (the source: the initial policy).
        device (Optional[torch.device]): the training device, where the towers go. Default is None: the policy's
            input embedding's device.
        shard (Optional[Callable[[Sequence[nn.Module]], int]]): FSDP2-wraps the trained modules when FSDP2 wraps
            the policy (:meth:`~torchtune_grpo.runtime.model_setup.Placement.shard_added` on it); None: the policy
            is a plain module. Default is None.
        trained_file (Optional[Path]): trained vision tensors to load over ``policy_source``'s (a resumed LoRA run's
            :data:`IMAGE_SIDE_FILE`: the image-text class's names). Default is None.
        workers (bool): generation workers sample (``generation_workers.enabled``). Default is False.

    Returns:
        str: what the run uses, for the log.

    Raises:
        ValueError: for the torchtune backend, an engine that does not take images (in the trainer or in generation
            workers: they build the same engine), a vLLM engine in generation workers, and a trained tower or projector of an FSDP2-wrapped policy
            without ``shard``.
    """
    if not isinstance(policy, TransformersDecoder):
        raise ValueError(
            "a dataset with images needs the transformers backend (model.backend: transformers, a multimodal "
            f"Qwen3.5 / Gemma 3 / Gemma 4 directory); got {type(policy).__name__}")
    if not getattr(engine, "takes_images", False):
        why = getattr(engine, "image_refusal", None)  # the vLLM engines say what their vLLM build lacks
        raise ValueError(
            f"a dataset with images needs an engine that samples with them; generation._component_ is "
            f"{type(engine).__name__}, which does not{f' ({why})' if why else ''}: use "
            "torchtune_grpo.generation.NativeGenerator or TransformersGenerator (docs/multimodal.md)")
    if workers and getattr(engine, "holds_weights", False):
        # A worker's vLLM engine would get the weights under the policy's names (trained_vision.*): not done.
        raise ValueError(f"a dataset with images in generation workers needs an engine that samples with the "
                         f"trainer's model; {type(engine).__name__} in a worker takes no image prompts yet: use "
                         "torchtune_grpo.generation.NativeGenerator or TransformersGenerator there, or the vLLM engine "
                         "without workers (docs/multimodal.md)")
    if train != "none" and isinstance(policy, FSDPModule) and shard is None:
        # Modules added after FSDP2 wrapped the policy and left unwrapped would get no gradient reduction.
        raise ValueError(f"train_vision: {train}: the policy is FSDP2-wrapped, and nothing was given to wrap the "
                         "trained vision modules with it")
    attach_images(policy, policy_source, train=train, device=device)
    kept = ""
    if reference is policy and trained_image_paths(policy):  # before a resumed file or FSDP2 changes them
        if policy_source != reference_source:
            raise ValueError(f"the reference is the policy: its vision modules must come from the reference's "
                             f"source {reference_source}, not {policy_source}")
        copies = {path: copy.deepcopy(m).requires_grad_(False) for path, m in trained_image_paths(policy).items()}
        object.__setattr__(policy, "_initial_image_modules", copies)
        kept = f"; the reference sees a frozen copy of the source's {_KEPT[train]}"
    if trained_file is not None:
        _load_trained(policy, Path(trained_file), train)
    units = 0
    if isinstance(policy, FSDPModule) and trained_image_modules(policy):
        units = shard(trained_image_modules(policy))
    if reference is not None and reference is not policy:
        attach_images(reference, reference_source, device=device)
    trained = image_parameters(policy)
    if trained:
        optimizer.add_param_group({"params": trained})
    # A DTensor's numel is the whole tensor's (not the shard's).
    counted = f", {sum(p.numel() for p in trained):,} parameters" if trained else ""
    counted += f", sharded in {units} FSDP2 unit{'s' if units > 1 else ''}" if units else ""
    return (f"Images in the prompt: the directory's vision tower and projector ({_WHAT[train]}{counted}) feed the "
            f"policy{' and the reference' if reference is not None else ''}{kept}; training forwards carry the "
            "images in the run's training layout (shared-prompt and packed rows hold the image tokens with their "
            "prompt)")


@contextmanager
def initial_image_side(policy: nn.Module) -> Iterator[None]:
    """Forwards of ``policy`` inside the block see the source's vision modules in place of the trained ones (the
    frozen copy :func:`attach_image_side` kept for a reference that is the policy); nothing changes without one."""
    copies = getattr(policy, "_initial_image_modules", None)
    if not copies:
        yield
        return
    with image_modules_replaced(policy, copies):
        yield


def image_side_state(policy: nn.Module, state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The trained vision tensors of ``state`` (the policy's state dict) under ``AutoModelForImageTextToText``'s
    names, for :data:`IMAGE_SIDE_FILE`; empty when the tower is frozen."""
    return {name: state[key] for key, name in image_class_names(policy).items() if key in state}


def _load_trained(policy: nn.Module, path: Path, train: str) -> None:
    """Copy ``path``'s tensors (:func:`image_side_state`'s names) into the policy's trained vision parameters (not
    yet FSDP2-wrapped); one the file lacks keeps the source's value (a module trained from this start on)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    keys = {name: key for key, name in image_class_names(policy).items()}
    unknown = sorted(set(tensors) - set(keys))
    if unknown:
        raise ValueError(f"{path} holds {len(unknown)} trained vision tensor(s) that train_vision: {train} does not "
                         f"train (e.g. {unknown[0]!r}): resume with the train_vision it was saved with")
    params = dict(policy.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            param = params[keys[name]]
            if param.shape != value.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, the model's {tuple(param.shape)}")
            param.copy_(value)
