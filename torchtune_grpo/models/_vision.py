"""Images in the prompt for a :class:`~torchtune_grpo.models.TransformersDecoder` policy of a multimodal directory.

The policy trains the language model of a Qwen3.5, Gemma 3 or Gemma 4 directory as transformers' text class. To
read images it needs what the image-text class (``AutoModelForImageTextToText``) has besides that language model:
the vision tower, the projector into the language model's embedding space, and the family's rules for where the
image features go and how image tokens attend and are positioned (Gemma 3: bidirectional attention within an
image; Qwen3.5: 3-D M-RoPE positions; Gemma 4: both its own way). :func:`attach_images` builds the image-text
class's inner model (``model.model``: ``Qwen3_5Model``, ``Gemma3Model``, ``Gemma4Model``) from the directory and
puts the policy's own language model in it (``language_model`` is the policy's base model, the same module: one
set of language weights, trained as before). A forward with images then runs that inner model's own ``forward``
(image features scattered over the image tokens, the family's masks and positions) and the policy's head: the
logits are the image-text class's, computed by its code.

The tower is held by the policy but is not one of its modules: the policy's parameters and state dict are the
language model's as without images. Frozen by default (the checkpointer then carries the towers byte for byte
from the source directory into every save). ``train="projector"`` or ``"tower"`` sets ``requires_grad`` on the
projector or the whole vision side and makes those modules the policy's too (a child :data:`TRAINED_PREFIX`,
so the optimizer state is named with the policy's): :func:`image_parameters` lists them for the optimizer and
:func:`image_state_dict` renames them in the policy's state dict to their ON-DISK names, for the checkpointer
to write in place of the source's. Those names are found once, at attach time, by matching each trained parameter's values to the one
tensor of the directory's files that holds them (the image-text class renames some on load, e.g. Gemma 3's
``vision_tower.vision_model.*`` is ``vision_tower.*`` in memory, and the names a checkpoint uses depend on where it
came from: they are read off the files, not derived). :func:`image_class_names` gives the same tensors'
names in the image-text class's own state dict (what its ``load_state_dict`` takes), :func:`trained_image_paths`
the trained modules by their path in the inner model, and :func:`image_modules_replaced` runs forwards with other
modules at those paths (the LoRA recipe's reference: a frozen copy of the source's).

Image inputs of a batch (:func:`batch_image_inputs`): the per-image tensors of the rows, concatenated in row order
(the image-text class scatters the features over the image tokens in row-major order), and the per-token ones
(``token_type_ids``, ``mm_token_type_ids``) padded to the batch's width with 0 (text).
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.models._vision_layouts import PER_TOKEN_KEYS

__all__ = ["attach_images", "batch_image_inputs", "image_class_names", "image_inputs", "image_modules_replaced",
           "image_parameters", "image_state_dict", "PER_TOKEN_KEYS", "text_after", "text_ids", "TRAIN_CHOICES",
           "trained_image_modules", "trained_image_paths", "VISION_MODULES"]

#: model_type -> (the projector's module, the whole vision side's modules) in the image-text class's inner model.
VISION_MODULES = {
    "qwen3_5": ("visual.merger", ("visual",)),
    "qwen3_5_moe": ("visual.merger", ("visual",)),
    "gemma3": ("multi_modal_projector", ("vision_tower", "multi_modal_projector")),
    "gemma4": ("embed_vision", ("vision_tower", "embed_vision")),
}
TRAIN_CHOICES = ("none", "projector", "tower")
#: The policy's child holding the trained vision modules (``train`` other than ``"none"``).
TRAINED_PREFIX = "trained_vision"


def attach_images(policy: nn.Module, model_dir: str, *, train: str = "none",
                  device: Optional[torch.device] = None) -> nn.Module:
    """Give ``policy`` the image side of ``model_dir`` (see the module docstring).

    Args:
        policy (nn.Module): a :class:`~torchtune_grpo.models.TransformersDecoder` built from ``model_dir``'s
            language model, weights loaded.
        model_dir (str): the multimodal directory.
        train (str): ``"none"`` (the tower and projector frozen), ``"projector"`` or ``"tower"`` (the projector
            included). Default is ``"none"``.
        device (Optional[torch.device]): where the tower and projector go. Default is None: the device of the
            policy's input embedding (give the training device when FSDP2 offloads the policy's shards to the CPU).

    Returns:
        nn.Module: the image-text class's inner model, whose ``language_model`` is the policy's base model.

    Raises:
        ValueError: an unknown ``train``, a directory that is not one of :data:`VISION_MODULES`' families, or a
            language model that is not the policy's class.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    if train not in TRAIN_CHOICES:
        raise ValueError(f"train must be one of {list(TRAIN_CHOICES)}, got {train!r}")
    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if model_type not in VISION_MODULES:
        raise ValueError(f"{model_dir}: images in the prompt are supported for {sorted(VISION_MODULES)}, "
                         f"not model_type {model_type!r}")
    weight = policy.tok_embeddings.weight
    # The image-text class as transformers loads it (its own names for the Hub files: Gemma 3's
    # vision_tower.vision_model.*); its language model is replaced by the policy's just below.
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=weight.dtype)
    inner = full.model
    if not isinstance(policy.base, type(inner.language_model)):  # (FSDP2 wrapping makes a subclass)
        raise ValueError(f"{model_dir}: the image-text class's language model is {type(inner.language_model).__name__}"
                         f", the policy's {type(policy.base).__name__}")
    inner.language_model = policy.base
    projector, vision = VISION_MODULES[model_type]
    for name, child in inner.named_children():
        if name != "language_model":
            # Eval mode for good: the policy's train()/eval() do not reach these modules (not its children), and
            # the old, reference and new logprobs of a row must see the same image features (no dropout).
            child.to(device if device is not None else weight.device).eval().requires_grad_(False)
    if train == "tower":
        for name in vision:
            inner.get_submodule(name).requires_grad_(True)
    elif train == "projector":
        inner.get_submodule(projector).requires_grad_(True)
    object.__setattr__(policy, "image_model", inner)  # held, not a child: the policy's state dict is unchanged
    if train != "none":
        # The trained modules become the policy's (under TRAINED_PREFIX): its parameters, so the optimizer's
        # state is named and saved with the policy's, and its state dict, from which the recipe saves them.
        trained = (projector,) if train == "projector" else vision
        policy.add_module(TRAINED_PREFIX, nn.ModuleDict(
            {name.replace(".", "__"): inner.get_submodule(name) for name in trained}))
        params = {f"{name}.{k}": p for name in trained for k, p in inner.get_submodule(name).named_parameters()}
        disk = _disk_names(model_dir, params)
        keys = {f"{TRAINED_PREFIX}.{name.replace('.', '__')}.{k}": f"{name}.{k}"
                for name in trained for k, _ in inner.get_submodule(name).named_parameters()}
        object.__setattr__(policy, "_image_disk_names", {key: disk[path] for key, path in keys.items()})
        # The same tensors under the image-text class's own (in-memory) names, e.g. model.multi_modal_projector.*
        outer = next(name for name, child in full.named_children() if child is inner)
        object.__setattr__(policy, "_image_class_names", {key: f"{outer}.{path}" for key, path in keys.items()})
        object.__setattr__(policy, "_image_trained_paths", trained)
    return inner


def _disk_names(model_dir: str, params: Mapping[str, torch.Tensor]) -> Dict[str, str]:
    """In-memory name -> the on-disk name of the one tensor in ``model_dir``'s files equal to it (same shape and
    values, the file's dtype cast to the parameter's).

    Raises:
        ValueError: a parameter that no tensor, or more than one, of the files equals (its name is then unknown).
    """
    import json
    from pathlib import Path

    from safetensors import safe_open

    if not params:
        return {}
    directory = Path(model_dir)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    shapes = {tuple(p.shape) for p in params.values()}
    found: Dict[str, List[str]] = {name: [] for name in params}
    for file_name in files:
        with safe_open(str(directory / file_name), framework="pt") as f:
            for key in f.keys():
                if "language_model" in key or tuple(f.get_slice(key).get_shape()) not in shapes:
                    continue
                tensor = f.get_tensor(key)
                for name, p in params.items():
                    if p.shape == tensor.shape and torch.equal(tensor.to(p.dtype), p.detach().cpu()):
                        found[name].append(key)
    unmatched = {name: keys for name, keys in found.items() if len(keys) != 1}
    if unmatched:
        name, keys = next(iter(unmatched.items()))
        raise ValueError(f"{model_dir}: the trained vision parameter {name!r} equals {len(keys)} tensors of the "
                         f"files ({keys[:3]}), so its on-disk name is unknown; train: none keeps the tower frozen")
    return {name: keys[0] for name, keys in found.items()}


def image_state_dict(policy: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` (the policy's state dict) with the trained vision tensors (``TRAINED_PREFIX.*``) renamed to
    their on-disk names, for the checkpointer; unchanged when the tower is frozen.

    Raises:
        KeyError: a ``TRAINED_PREFIX`` tensor whose on-disk name is not known (not from :func:`attach_images`).
    """
    names = getattr(policy, "_image_disk_names", None) or {}
    return {(names[k] if k.startswith(TRAINED_PREFIX + ".") else k): v for k, v in state.items()}


def image_class_names(policy: nn.Module) -> Dict[str, str]:
    """The policy's state-dict key of each trained vision tensor (``TRAINED_PREFIX.*``) -> its name in the state
    dict of ``AutoModelForImageTextToText`` (in memory, e.g. ``model.multi_modal_projector.*``: what
    ``load_state_dict`` on that class takes); empty when the tower is frozen."""
    return dict(getattr(policy, "_image_class_names", None) or {})


@contextmanager
def image_modules_replaced(policy: nn.Module, modules: Mapping[str, nn.Module]) -> Iterator[None]:
    """Forwards of ``policy`` inside the block run ``modules`` (path in the image-text class's inner model, e.g.
    ``visual.merger`` -> a module) in place of the policy's own vision modules at those paths.

    Raises:
        ValueError: for a policy without an image side (:func:`attach_images`).
    """
    inner = getattr(policy, "image_model", None)
    if inner is None:
        raise ValueError("image_modules_replaced: the policy has no image side (attach_images)")
    owners = {path: (inner.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2]) for path in modules}
    previous = {path: owner._modules[name] for path, (owner, name) in owners.items()}
    try:
        for path, (owner, name) in owners.items():
            owner._modules[name] = modules[path]
        yield
    finally:
        for path, (owner, name) in owners.items():
            owner._modules[name] = previous[path]


def trained_image_paths(policy: nn.Module) -> Dict[str, nn.Module]:
    """Path in the image-text class's inner model (``multi_modal_projector``, ``visual``, ...) -> the trained
    vision module there, in order; empty when the tower is frozen."""
    inner = getattr(policy, "image_model", None)
    paths = getattr(policy, "_image_trained_paths", None) or ()
    return {path: inner.get_submodule(path) for path in paths}


def trained_image_modules(policy: nn.Module) -> List[nn.Module]:
    """The trained vision modules :func:`attach_images` made the policy's (under :data:`TRAINED_PREFIX`), in
    order; empty when the tower is frozen. FSDP2 wraps them after the policy (docs/multimodal.md)."""
    trained = policy._modules.get(TRAINED_PREFIX)
    return list(trained.values()) if trained is not None else []


def image_parameters(policy: nn.Module) -> List[nn.Parameter]:
    """The image side's parameters with ``requires_grad`` (empty when frozen or without :func:`attach_images`)."""
    inner = getattr(policy, "image_model", None)
    if inner is None:
        return []
    return [p for name, child in inner.named_children() if name != "language_model"
            for p in child.parameters() if p.requires_grad]


@contextmanager
def image_inputs(policy: nn.Module, inputs: Optional[Mapping[str, torch.Tensor]]) -> Iterator[None]:
    """Forwards of ``policy`` inside the block see ``inputs`` (its rows' images), as if passed as ``images=``.

    The logprob code calls ``model(tokens)``; this is how a batch's images reach that call. None: no images.
    """
    previous = getattr(policy, "_pending_images", None)
    object.__setattr__(policy, "_pending_images", inputs)
    try:
        yield
    finally:
        object.__setattr__(policy, "_pending_images", previous)


def batch_image_inputs(per_row: Sequence[Optional[Mapping[str, torch.Tensor]]], width: int,
                       device: Optional[torch.device] = None, *, left: bool = False
                       ) -> Optional[Dict[str, torch.Tensor]]:
    """One batch's image inputs from its rows' (rows of ``width`` slots; a row may have none).

    Args:
        per_row (Sequence[Optional[Mapping[str, torch.Tensor]]]): each row's image inputs (as
            :class:`~torchtune_grpo.data.ImagePromptDataset` gives them: per-token keys ``[L_prompt]``) or None.
        width (int): the batch's row width ``L``.
        device (Optional[torch.device]): where to put them. Default is None (where they are).
        left (bool): the rows are left-padded (a rollout's prompts): per-token values end at the last slot.
            Default is False (right-padded training rows).

    Returns:
        Optional[Dict[str, torch.Tensor]]: per-image keys concatenated in row order; per-token keys ``[B, L]``
        (0 on rows without images and on padding); None when no row has images.
    """
    if all(r is None for r in per_row):
        return None
    keys = sorted({k for r in per_row if r is not None for k in r})
    out: Dict[str, torch.Tensor] = {}
    for key in keys:
        if key in PER_TOKEN_KEYS:
            first = next(r[key] for r in per_row if r is not None and key in r)
            batch = torch.zeros((len(per_row), width), dtype=first.dtype)
            for i, r in enumerate(per_row):
                if r is not None and key in r:
                    value = r[key].reshape(-1)
                    if left:
                        batch[i, width - value.numel():] = value
                    else:
                        batch[i, : value.numel()] = value
            out[key] = batch
        else:
            out[key] = torch.cat([r[key] for r in per_row if r is not None and key in r], dim=0)
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def forward_with_images(policy: nn.Module, tokens: torch.Tensor, images: Mapping[str, Any],
                        input_pos: Optional[torch.Tensor], layout: Optional[Any] = None) -> torch.Tensor:
    """The last hidden states ``[B, L, D]`` of ``tokens`` with ``images``, by the image-text class's inner model.

    With a training ``layout`` (packed or shared-prompt rows, ``input_pos`` their positions), ``images`` are laid
    out in its slots (:func:`~torchtune_grpo.models._vision_layouts.layout_image_inputs`), and the layout's masks
    (with each image attending to itself where the family does) and positions replace the ones the class builds.
    """
    inner = getattr(policy, "image_model", None)
    if inner is None:
        raise ValueError("image inputs given to a policy without an image side: call attach_images(policy, model_dir)")
    if layout is not None:
        return _layout_forward(policy, inner, tokens, images, input_pos, layout)
    if input_pos is not None:
        # Qwen3.5's M-RoPE positions are 3-D and computed from the image grid; the Gemmas' are 0..L-1 for a row.
        raise ValueError("a forward with images takes no input_pos: the family computes its positions")
    with text_ids(inner, tokens, images) as ids:
        return inner(input_ids=ids, use_cache=False, **images).last_hidden_state


def _layout_forward(policy: nn.Module, inner: nn.Module, tokens: torch.Tensor, images: Mapping[str, Any],
                    input_pos: torch.Tensor, layout: Any) -> torch.Tensor:
    """:func:`forward_with_images` on a layout's rows ``tokens [R, S]``."""
    from torchtune_grpo.models._transformers_layouts import layout_attention_mask
    from torchtune_grpo.models._vision_layouts import bidirectional_layers, image_blocks, POSITIONS_KEY, with_blocks

    pairs = layout.pairs(input_pos)
    images = dict(images)
    positions = images.pop(POSITIONS_KEY, input_pos)
    layers = bidirectional_layers(inner.config)
    allowed = None
    if any(layers):
        types = next(images[k] for k in PER_TOKEN_KEYS if k in images)
        allowed = with_blocks(pairs, image_blocks(types, pairs.segment), layers)
    masks = layout_attention_mask(policy, pairs, allowed)
    with text_ids(inner, tokens, images) as ids:
        return inner(input_ids=ids, attention_mask=masks, position_ids=positions, use_cache=False,
                     **images).last_hidden_state


@contextmanager
def text_ids(inner: nn.Module, tokens: torch.Tensor, images: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    """The ids to give the image-text class's inner model for ``tokens [B, L]``: ``tokens`` themselves, unless a row
    holds the image token outside its prompt's images (see below); the block runs that model's forward.

    An image token the policy SAMPLED (in a response, or in an earlier turn's history: the per-token types say 0
    there) is text: the engine fed it to the language model as a token. The image-text class would take it for an
    image slot (and refuse the count): it gets a plain id here, and its input embeddings are put back to the
    sampled token's for forwards inside the block.
    """
    stray = _stray_image_tokens(inner, tokens, images)
    if stray is None:
        yield tokens
        return
    sentinel = getattr(inner.config.get_text_config(), "pad_token_id", None) or 0
    handles = [module.register_forward_hook(_restore_ids(tokens, stray))
               for module in _token_embeddings(inner.language_model)]
    try:
        yield tokens.masked_fill(stray, sentinel)
    finally:
        for h in handles:
            h.remove()


def text_after(inputs: Optional[Mapping[str, torch.Tensor]], extra: int) -> Optional[Dict[str, torch.Tensor]]:
    """A prompt's image inputs for the prompt followed by ``extra`` text tokens (a multi-turn history re-sent after
    it): the per-token keys get ``extra`` zeros (text) on the right; the per-image ones are unchanged.

    Args:
        inputs (Optional[Mapping[str, torch.Tensor]]): the prompt's image inputs (per-token keys ``[L_prompt]``), or
            None (a prompt without images).
        extra (int): tokens after the prompt.

    Returns:
        Optional[Dict[str, torch.Tensor]]: per-token keys ``[L_prompt + extra]``; None for None.
    """
    if inputs is None:
        return None
    return {k: (torch.cat([v.reshape(-1), v.new_zeros(extra)]) if k in PER_TOKEN_KEYS else v)
            for k, v in inputs.items()}


def _stray_image_tokens(inner: nn.Module, tokens: torch.Tensor, images: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """``[B, L]`` True where a row holds the image token outside its prompt's images (None: nowhere)."""
    image_id = getattr(inner.config, "image_token_id", None)
    types = next((images[k] for k in PER_TOKEN_KEYS if k in images), None)
    if image_id is None or types is None:
        return None
    stray = (tokens == image_id) & (types.to(tokens.device) == 0)
    return stray if bool(stray.any()) else None


def _token_embeddings(language_model: nn.Module) -> List[nn.Module]:
    """The language model's embeddings looked up by token id (Gemma 4's per-layer embedding too)."""
    names = ("embed_tokens", "embed_tokens_per_layer")
    return [getattr(language_model, n) for n in names if isinstance(getattr(language_model, n, None), nn.Module)]


def _restore_ids(tokens: torch.Tensor, stray: torch.Tensor):
    """A forward hook: at ``stray`` positions, the embedding of ``tokens`` (the ids the forward was not given)."""
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].shape != tokens.shape:
            return output
        return torch.where(stray[..., None], module.forward(tokens), output)

    return hook
