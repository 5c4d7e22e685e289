"""The image side of a vision-language run (docs/multimodal.md): a dataset whose prompts carry images gives the
policy, and the reference, the multimodal directory's vision tower and projector.

The tower and projector are frozen unless ``train_vision`` says ``projector`` or ``tower``; then their parameters
join the optimizer as a group of their own and are saved with every step under the checkpoint's names
(:func:`~torchtune_grpo.models.image_state_dict`). When FSDP2 wraps the policy, the trained modules become FSDP2
units of their own under it (the tower's blocks one by one, then the rest): their gradients are reduced across the
processes like the language model's, and their parameters and optimizer state sharded. A frozen tower or projector
stays a whole copy on every process (no gradient: the copies stay equal).
"""

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtune_grpo.models import attach_images, image_parameters, trained_image_modules, TransformersDecoder

__all__ = ["attach_image_side"]

_WHAT = {"none": "frozen", "projector": "projector trained", "tower": "tower and projector trained"}


def attach_image_side(policy: nn.Module, reference: Optional[nn.Module], optimizer: Any, *, engine: Any,
                      train: str, policy_source: str, reference_source: str,
                      device: Optional[torch.device] = None,
                      shard: Optional[Callable[[Sequence[nn.Module]], int]] = None, workers: bool = False) -> str:
    """Attach the directory's image side to ``policy`` (and ``reference``); returns the line the run logs.

    Args:
        policy (nn.Module): the policy, a :class:`~torchtune_grpo.models.TransformersDecoder` (possibly FSDP2-wrapped).
        reference (Optional[nn.Module]): the reference model, or None (no KL term, or the policy itself).
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
            f"policy{' and the reference' if reference is not None else ''}; training forwards carry the images "
            "in the run's training layout (shared-prompt and packed rows hold the image tokens with their prompt)")
