"""Building the recipes' models: meta-device init, FSDP2 (or the plain module), weights loaded and checked.

:class:`Placement` holds what decides where and how a model lives (device, process count, precision, the
FSDP2 options of the config); :func:`build_model` builds the full-fine-tuning policy and reference with it,
:func:`build_lora_model` (torchtune_grpo/runtime/lora_setup.py) the LoRA/QLoRA policy. Both follow torchtune's
distributed recipes: instantiate on the meta device, shard, allocate, fill the RoPE caches, load the full
state dict (each rank keeps its shards).
"""

from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any, Dict, FrozenSet, Iterable, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torchtune import config, modules, training, utils

from torchtune_grpo.models.compiled import compile_decoder_layers
from torchtune_grpo.models.logprobs import set_head_precision
from torchtune_grpo.runtime.compute import (
    apply_activation_checkpointing, checkpointed_layers, device_memory_bytes, resolve_activation_checkpointing,
    training_memory_estimate,
)
from torchtune_grpo.runtime.precision import Precision
from torchtune_grpo.runtime.sharding import shard_added_modules, shard_model

__all__ = [
    "build_model", "check_device", "check_max_seq_len", "check_state_dict_shapes", "init_rope",
    "load_full_state_dict", "Placement",
]

log = utils.get_logger("INFO")


@dataclass(frozen=True)
class Placement:
    """Where a run's models live and how they are wrapped.

    Args:
        device (torch.device): the rank's device.
        world_size (int): the number of processes.
        precision (Precision): the run's precision (torchtune_grpo/runtime/precision.py).
        cpu_offload (bool): ``fsdp_cpu_offload``: parameters, gradients and optimizer state on the CPU.
        single_process_fsdp (bool): ``fsdp_single_process``: FSDP2 even on one process.
        reshard_after_forward (bool): ``fsdp_reshard_after_forward``.
        activation_checkpointing (str): ``off``, ``on``, ``selective`` or ``auto`` (trained models only;
            torchtune_grpo/runtime/compute.py). Default is ``"off"``.
        checkpoint_every (int): with ``selective``, every n-th layer. Default is 2.
        micro_batch_tokens (Optional[int]): tokens of the largest micro-batch (``auto``'s memory estimate).
            Default is None.
        chunk_size (int): the logprob head's chunk (``auto``'s estimate). Default is 512.
        logprob_head (str): the fused logprob head's products, ``fp32`` or ``bf16``. Default is ``"fp32"``.
        compile_backend (Optional[str]): ``compile_training``: the decoder layers' training forwards compiled
            with this ``torch.compile`` backend; None: eager. Default is None.
        reference (bool): a frozen reference model is built too (``auto``'s estimate). Default is False.
    """

    device: torch.device
    world_size: int
    precision: Precision
    cpu_offload: bool = False
    single_process_fsdp: bool = False
    reshard_after_forward: bool = True
    activation_checkpointing: str = "off"
    checkpoint_every: int = 2
    micro_batch_tokens: Optional[int] = None
    chunk_size: int = 512
    logprob_head: str = "fp32"
    compile_backend: Optional[str] = None
    reference: bool = False

    @classmethod
    def from_config(cls, config: Any, device: torch.device, world_size: int, precision: Precision) -> "Placement":
        """The placement a :class:`~torchtune_grpo.config.schema.RecipeConfig` asks for
        (``activation_checkpointing``, when set, wins over ``enable_activation_checkpointing``)."""
        mode = config.activation_checkpointing
        if mode is None:
            mode = "on" if config.enable_activation_checkpointing else "off"
        tokens = config.max_tokens_per_micro_batch
        if tokens is None and config.max_prompt_length is not None:
            tokens = config.micro_batch_size * (config.max_prompt_length + config.max_response_length)
        return cls(
            device=device, world_size=world_size, precision=precision, cpu_offload=config.fsdp_cpu_offload,
            single_process_fsdp=config.fsdp_single_process, reshard_after_forward=config.fsdp_reshard_after_forward,
            activation_checkpointing=mode, checkpoint_every=config.activation_checkpointing_every,
            micro_batch_tokens=tokens, chunk_size=config.logprob_chunk_size, logprob_head=config.logprob_head,
            compile_backend=config.compile_training, reference=config.kl_coef > 0,
        )

    def checkpointed_layers(self, model: nn.Module) -> Set[int]:
        """The decoder layers of ``model`` (a meta-device model is enough) to checkpoint: ``auto`` decided by
        :func:`~torchtune_grpo.runtime.compute.training_memory_estimate` (``on`` when the micro-batch size is
        unknown), the decision logged."""
        mode = self.activation_checkpointing
        if mode == "auto":
            estimate = None
            if self.micro_batch_tokens is not None:
                estimate = training_memory_estimate(
                    model, tokens=self.micro_batch_tokens, bytes_per_param=self.precision.bytes_per_param,
                    compute_bytes=torch.finfo(self.precision.compute_dtype).bits // 8,
                    world_size=self.world_size, chunk_size=self.chunk_size, reference=self.reference,
                )
            total = device_memory_bytes(self.device)
            mode = resolve_activation_checkpointing(mode, estimate, total)
            need = f"{estimate.total(False) / 2**30:.1f} GiB estimated without it" if estimate else "size unknown"
            utils.log_rank_zero(log, f"activation_checkpointing: auto -> {mode} ({need}; device {total / 2**30:.1f} GiB)")
        return checkpointed_layers(len(model.layers), mode, self.checkpoint_every)

    def sharded(self, mixed: bool) -> bool:
        """Whether a model is FSDP2-wrapped. One process trains the plain module unless FSDP2 is asked for
        (it has nothing to shard there and only copies weights and gradients); mixed precision is FSDP2's
        ``MixedPrecisionPolicy``, so it wraps on one process too (the same casts as on N)."""
        return self.world_size > 1 or self.cpu_offload or self.single_process_fsdp or mixed

    def shard(self, model: nn.Module, *, mixed: bool = False, ignored_params: FrozenSet[nn.Parameter] = frozenset()) -> None:
        """FSDP2 per transformer layer, then the root; ``ignored_params`` (QLoRA's NF4 weights) left out."""
        shard_model(
            model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
            cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward,
            precision=self.precision if mixed else None,
            ignored_params=ignored_params,
        )

    def shard_added(self, model: nn.Module, modules: Sequence[nn.Module]) -> int:
        """FSDP2 on ``modules`` that joined the sharded ``model`` afterwards (a trained vision tower or projector:
        :func:`~torchtune_grpo.runtime.sharding.shard_added_modules`); returns the units made."""
        return shard_added_modules(model, modules, cpu_offload=self.cpu_offload,
                                   reshard_after_forward=self.reshard_after_forward)

    def one_process_note(self, mixed: bool) -> Optional[str]:
        """What a one-process run trains (the plain module or FSDP2, and why); None on several processes."""
        if self.world_size > 1:
            return None
        if not self.sharded(mixed):
            return "One process: training the plain model (fsdp_single_process: false)"
        why = "fsdp_cpu_offload: true" if self.cpu_offload else "fsdp_single_process: true"
        why = f"dtype: {self.precision.name}, mixed precision" if mixed else why
        return f"One process: training the FSDP2-wrapped model ({why})"


def check_max_seq_len(model: nn.Module, max_len: int) -> None:
    """Fail when the prompt + response budget ``max_len`` exceeds the model's ``max_seq_len`` (RoPE cache)."""
    if getattr(model, "max_seq_len", None) is not None and max_len > model.max_seq_len:
        raise ValueError(
            f"max_prompt_length + max_response_length = {max_len} exceeds the model's max_seq_len = {model.max_seq_len}"
        )


def init_rope(model: nn.Module, device: torch.device) -> None:
    """Fill the buffers that meta-device init left empty: torchtune's RoPE caches (in the weights' dtype), or
    the non-persistent buffers a transformers policy computed at construction (RoPE frequencies, embedding
    scales: :meth:`~torchtune_grpo.models.TransformersDecoder.restore_buffers`)."""
    if hasattr(model, "restore_buffers"):
        model.restore_buffers(device)
        return
    with training.set_default_dtype(next(model.parameters()).dtype), device:
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()


def load_full_state_dict(
    model: nn.Module, state_dict: Dict[str, torch.Tensor], device: torch.device, *, strict: bool = False,
    cpu_offload: bool = False,
) -> Any:
    """Load full weights into an FSDP2-sharded model (each rank keeps its shards of the parameters), keeping the
    model's persistent buffers buffers.

    torchtune's ``load_from_full_model_state_dict`` assigns every entry of the state dict as an ``nn.Parameter``,
    which turns a persistent buffer (Gemma 4's per-layer ``layer_scalar``, a constant of the checkpoint) into a
    trainable parameter outside FSDP2: the optimizer then updated it, on each process from that process's own
    gradient, never averaged. Such entries are put back as plain buffers on ``device`` (also with
    ``cpu_offload``: the forward reads them on the device, and only parameters are offloaded).

    Args:
        model (nn.Module): the sharded model, still on the meta device.
        state_dict (Dict[str, torch.Tensor]): full tensors under the model's state-dict names.
        device (torch.device): the rank's device.
        strict (bool): fail on missing or unexpected names (torchtune's check). Default is False.
        cpu_offload (bool): the parameters' shards go to the CPU (FSDP2's CPU offload). Default is False.

    Returns:
        Any: torchtune's ``missing_keys`` / ``unexpected_keys`` result.
    """
    persistent = [(m, leaf) for m in model.modules() for leaf in m._buffers
                  if leaf not in m._non_persistent_buffers_set]
    loaded = training.load_from_full_model_state_dict(model, state_dict, device, strict=strict, cpu_offload=cpu_offload)
    for module, leaf in persistent:
        if leaf in module._parameters:  # loaded as a parameter above
            module._buffers[leaf] = module._parameters.pop(leaf).detach().to(device)
    return loaded


def decoder_layer_classes(model: nn.Module) -> set:
    """The classes of ``model``'s decoder layers, which activation checkpointing wraps one by one."""
    return set(getattr(model, "layer_classes", None) or {modules.TransformerSelfAttentionLayer})


def build_model(
    model_cfg: Any, state_dict: Dict[str, Any], placement: Placement, *, trainable: bool, source: str, max_len: int,
    frozen_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """The model of ``model_cfg`` with ``state_dict`` loaded: the trained policy or a frozen reference.

    Args:
        model_cfg (Any): the config's ``model`` node (a torchtune model builder).
        state_dict (Dict[str, Any]): full weights in torchtune names (each rank keeps its shards).
        placement (Placement): device, processes, precision, FSDP2 options.
        trainable (bool): the policy (the precision's param dtype: fp32 master weights with bf16; activation
            checkpointing when asked) or a frozen reference (the compute dtype, eval mode, no gradients).
        source (str): where ``state_dict`` came from, for error messages.
        max_len (int): ``max_prompt_length + max_response_length``, checked against the model's ``max_seq_len``.
        frozen_dtype (Optional[torch.dtype]): a frozen model's dtype (a bf16 reference of an fp32 run). Default
            is None: the compute dtype.

    Returns:
        nn.Module: the model on ``placement.device``.

    Raises:
        ValueError: on a budget past ``max_seq_len`` or a state dict that does not fit the model (names and
            shapes, naming ``source``).
    """
    mixed = trainable and placement.precision.mixed
    param_dtype = placement.precision.param_dtype if trainable else (frozen_dtype or placement.precision.compute_dtype)
    with training.set_default_dtype(param_dtype), torch.device("meta"):
        model = config.instantiate(model_cfg)
    check_max_seq_len(model, max_len)
    check_state_dict_shapes(chain(model.named_parameters(), model.named_buffers()), state_dict, source)
    if trainable:
        apply_activation_checkpointing(model, placement.checkpointed_layers(model), decoder_layer_classes(model))
    set_head_precision(model, placement.logprob_head)
    if placement.compile_backend is not None:  # used by the training layout's forwards only (models/compiled.py)
        compile_decoder_layers(model, placement.compile_backend, decoder_layer_classes(model))
    shard = placement.sharded(mixed)
    if trainable and (note := placement.one_process_note(mixed)):
        utils.log_rank_zero(log, note)
    if shard:
        placement.shard(model, mixed=mixed)
    else:
        model.to_empty(device=placement.device)
    init_rope(model, placement.device)
    if shard:
        load_full_state_dict(model, state_dict, placement.device, strict=True, cpu_offload=placement.cpu_offload)
    else:
        model.load_state_dict(state_dict, strict=True)
    training.validate_no_params_on_meta_device(model)
    if trainable and (note := getattr(model, "backend_note", None)):
        utils.log_rank_zero(log, f"Model: {note}")
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model


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
