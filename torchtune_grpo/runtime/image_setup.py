"""The image side of a vision-language run (docs/multimodal.md): a dataset whose prompts carry images gives the
policy, and the reference, the multimodal directory's vision tower and projector.

The tower and projector are frozen unless ``train_vision`` says ``projector`` or ``tower``; then their parameters
join the optimizer as a group of their own and are saved with every step under the checkpoint's names
(:func:`~torchtune_grpo.models.image_state_dict`).
"""

from typing import Any, Optional

from torch import nn

from torchtune_grpo.models import attach_images, image_parameters, TransformersDecoder

__all__ = ["attach_image_side"]

_WHAT = {"none": "frozen", "projector": "projector trained", "tower": "tower and projector trained"}


def attach_image_side(policy: nn.Module, reference: Optional[nn.Module], optimizer: Any, *, engine: Any,
                      train: str, world_size: int, policy_source: str, reference_source: str) -> str:
    """Attach the directory's image side to ``policy`` (and ``reference``); returns the line the run logs.

    Args:
        policy (nn.Module): the policy, a :class:`~torchtune_grpo.models.TransformersDecoder` (possibly FSDP2-wrapped).
        reference (Optional[nn.Module]): the reference model, or None (no KL term, or the policy itself).
        optimizer (Any): the policy's optimizer: trained vision parameters are added to it as one group.
        engine (Any): the run's generation engine; it must take images
            (:attr:`~torchtune_grpo.generation.GenerationEngine.takes_images`).
        train (str): ``train_vision``: ``none``, ``projector`` or ``tower``.
        world_size (int): processes in the run.
        policy_source (str): the directory the policy's tower comes from (the step being resumed, else the source).
        reference_source (str): the directory the reference's tower comes from (the source: the initial policy).

    Returns:
        str: what the run uses, for the log.

    Raises:
        ValueError: for the torchtune backend, an engine that does not take images (in the trainer or in generation
            workers: they build the same engine), and a trained tower or projector on more than one process.
    """
    if not isinstance(policy, TransformersDecoder):
        raise ValueError(
            "a dataset with images needs the transformers backend (model.backend: transformers, a multimodal "
            f"Qwen3.5 / Gemma 3 / Gemma 4 directory); got {type(policy).__name__}")
    if not getattr(engine, "takes_images", False):
        raise ValueError(
            f"a dataset with images needs an engine that samples with them; generation._component_ is "
            f"{type(engine).__name__}, which does not (vLLM refuses multimodal directories): use "
            "torchtune_grpo.generation.NativeGenerator or TransformersGenerator (docs/multimodal.md)")
    if train != "none" and world_size > 1:
        # The trained vision modules are added after FSDP2 wrapped the policy: their gradients would not be
        # averaged across processes, and the replicas would drift apart.
        raise ValueError(f"train_vision: {train} runs on one process for now (world size {world_size}); "
                         "train_vision: none trains the language model on any number")
    attach_images(policy, policy_source, train=train)
    if reference is not None and reference is not policy:
        attach_images(reference, reference_source)
    trained = image_parameters(policy)
    if trained:
        optimizer.add_param_group({"params": trained})
    counted = f", {sum(p.numel() for p in trained):,} parameters" if trained else ""
    return (f"Images in the prompt: the directory's vision tower and projector ({_WHAT[train]}{counted}) feed the "
            f"policy{' and the reference' if reference is not None else ''}; training forwards run one row per "
            "sequence (no shared prompts or packing with images)")
