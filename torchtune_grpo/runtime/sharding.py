"""FSDP2 for the recipes: sharding a model with the run's precision, and gathering it for a rollout.

:func:`shard_model` is torchtune's ``training.shard_model`` with a mixed-precision policy (the casts of
``dtype: bf16``, torchtune_grpo/runtime/precision.py). :func:`unsharded` gathers every FSDP2 module's parameters once
for a whole rollout: decoding calls the model once per token, and resharding after each call would gather
the weights again every token. :func:`shard_added_modules` wraps modules that joined a sharded model afterwards
(a trained vision tower or projector, docs/multimodal.md). :func:`gather_full_state_dict` gathers the sharded weights
for a checkpoint.
"""

from contextlib import contextmanager
from typing import AbstractSet, Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from torchtune_grpo.runtime.precision import Precision

__all__ = ["gather_full_state_dict", "gather_full_tensor", "shard_added_modules", "shard_model", "unsharded"]


def _fp32_final_norm(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    # The final norm returns its input's dtype (bf16 from the last layer): hand the output projection fp32.
    return output.float()


def shard_model(
    model: nn.Module,
    shard_conditions: List[Callable[[str, nn.Module], bool]],
    *,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    precision: Optional[Precision] = None,
    ignored_params: FrozenSet[nn.Parameter] = frozenset(),
) -> None:
    """FSDP2 on the modules ``shard_conditions`` pick (innermost first), then the root.

    torchtune's ``training.shard_model`` with a mixed-precision policy: with a mixed ``precision`` the
    picked modules (the transformer layers) compute in its ``compute_dtype`` and the root (embeddings, final
    norm, output projection) in fp32; gradients are reduced in fp32 and kept in the fp32 master weights.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (``norm`` is its final norm).
        shard_conditions (List[Callable[[str, nn.Module], bool]]): as torchtune's.
        cpu_offload (bool): offload parameters, gradients and optimizer state to CPU.
        reshard_after_forward (bool): free the unsharded parameters after each forward. Default is True.
        precision (Optional[Precision]): None or an unmixed precision: no casting. Default is None.
        ignored_params (FrozenSet[nn.Parameter]): parameters FSDP2 leaves alone, held whole on every rank
            (QLoRA's NF4 weights: torch's FSDP2 single-process path ignores NF4's all-gather extension, and
            sharding NF4 needs every weight's block count to divide by the world size). Default is none.

    Raises:
        ValueError: if no module was picked.
    """
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if ignored_params:
        kwargs["ignored_params"] = set(ignored_params)
    layer_kwargs, root_kwargs = dict(kwargs), dict(kwargs)
    if precision is not None and precision.mixed:
        layer_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=precision.compute_dtype, reduce_dtype=torch.float32
        )
        root_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.norm.register_forward_hook(_fp32_final_norm)
    sharded = 0
    for name, module in reversed(list(model.named_modules())):
        if any(condition(name, module) for condition in shard_conditions):
            fully_shard(module, **layer_kwargs)
            sharded += 1
    if sharded == 0:
        raise ValueError("No module was sharded: check the shard conditions.")
    fully_shard(model, **root_kwargs)


def shard_added_modules(
    root: nn.Module, modules: Sequence[nn.Module], *, cpu_offload: bool, reshard_after_forward: bool = True,
) -> int:
    """FSDP2 on ``modules``, children that joined ``root`` after :func:`shard_model` wrapped it: each element of
    every ``nn.ModuleList`` inside them (a tower's blocks), then each module (what is left: embeddings, norms, a
    projector), on the root's device mesh.

    Each becomes an FSDP2 unit of its own under the root: its parameters are sharded (and so is their optimizer
    state), its gradients reduce-scattered across the processes, and the root's state dict holds them under
    their names, gathered by ``full_tensor``. No mixed precision: they compute in their parameters' dtype, as
    the same modules unwrapped on one process and the frozen rest of the image side do. Call it before the
    root's first forward (FSDP2 decides then which states are nested under the root).

    Args:
        root (nn.Module): the FSDP2-wrapped model, ``modules`` among its submodules.
        modules (Sequence[nn.Module]): the modules to wrap, on the training device.
        cpu_offload (bool): offload their parameters, gradients and optimizer state to the CPU, as the root's.
        reshard_after_forward (bool): free their unsharded parameters after each forward. Default is True.

    Returns:
        int: the number of FSDP2 units made.

    Raises:
        ValueError: if ``root`` is not FSDP2-wrapped.
    """
    if not isinstance(root, FSDPModule):
        raise ValueError(f"shard_added_modules: the root {type(root).__name__} is not FSDP2-wrapped")
    mesh = next(p.device_mesh for p in root.parameters() if isinstance(p, DTensor))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    units = 0
    for module in modules:
        for child in reversed(list(module.modules())):
            if isinstance(child, nn.ModuleList):
                for block in child:
                    fully_shard(block, **kwargs)
                    units += 1
        fully_shard(module, **kwargs)
        units += 1
    return units


@contextmanager
def unsharded(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Keep ``model``'s FSDP2 parameters gathered inside the block (a no-op for a plain model).

    Args:
        model (nn.Module): the (possibly FSDP2-sharded) model.
        reshard_after_forward (bool): the setting to restore on exit (``fsdp_reshard_after_forward``).
    """
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)
            m.reshard()


def gather_full_state_dict(model: nn.Module, is_rank_zero: bool, device: Optional[torch.device] = None,
                           keys: Optional[AbstractSet[str]] = None) -> Dict[str, Any]:
    """The full state dict of an FSDP2-sharded ``model`` on rank 0's CPU (other ranks: empty), one tensor at a time
    (:func:`gather_full_tensor`), as torchtune's ``training.gather_cpu_state_dict``, except the collective; a model
    with NF4 (QLoRA) shards goes through torchtune's function.

    Args:
        model (nn.Module): the sharded model (or an unsharded one: its tensors are copied to the CPU).
        is_rank_zero (bool): whether this process keeps the result.
        device (Optional[torch.device]): where a CPU-offloaded shard goes for the collective. Default is None.
        keys (Optional[AbstractSet[str]]): the state-dict keys to gather, the same on every rank (a LoRA checkpoint
            of the adapters only does not gather the base weights). Default is None (all).

    Returns:
        Dict[str, Any]: name -> full CPU tensor on rank 0 (of ``keys`` only, when given); empty elsewhere.
    """
    from torchao.dtypes.nf4tensor import NF4Tensor  # here: torchao is imported by torchtune anyway

    state = model.state_dict()
    if any(isinstance(v, DTensor) and isinstance(v.to_local(), NF4Tensor) for v in state.values()):
        from torchtune import training

        full = training.gather_cpu_state_dict(model, is_rank_zero, device=device)
        return full if keys is None else {name: value for name, value in full.items() if name in keys}
    out: Dict[str, Any] = {}
    for name, value in state.items():
        if keys is not None and name not in keys:
            continue
        if isinstance(value, DTensor):
            value = gather_full_tensor(value, device)
        if isinstance(value, NF4Tensor):  # an unsharded NF4 weight (a state-dict hook usually dequantizes it first)
            value = value.to(value.dtype)  # as torchtune's gather: the original dtype's values
        if is_rank_zero:
            out[name] = value.cpu()
    return out


def gather_full_tensor(value: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """``value`` whole on every rank: an FSDP2 shard (DTensor) gathered, any other tensor as it is; on ``device``
    where given (a CPU-offloaded shard is moved there for the collective). The checkpoint's gather and the weight
    syncs to an inference engine all go through here.

    DTensor's ``full_tensor`` all-gathers with functional collectives. On gloo, ranks have died of SIGSEGV/SIGABRT
    inside it at a checkpoint (rarely, under load; cause not found), while FSDP2's own unsharding, a plain
    all-gather every step, never has. So a tensor sharded on dim 0 over a 1-D mesh (FSDP2's layout: ``torch.chunk``
    pieces ``[ceil(rows / world), ...]``, the last ones shorter or empty) is gathered that plain way: each rank's
    piece padded to the chunk size, one ``all_gather_into_tensor`` into ``[world * chunk, ...]``, the padding cut.
    Other layouts and tensor subclasses use ``full_tensor``. A collective for a DTensor: every rank calls it for the
    same tensors, in the same order.

    Args:
        value (torch.Tensor): a state-dict tensor, ``[rows, ...]`` whole or as this rank's shard.
        device (Optional[torch.device]): where the result lives. Default is None (where ``value`` is).

    Returns:
        torch.Tensor: ``[rows, ...]``, the whole tensor.
    """
    if device is not None and value.device != device:
        value = value.to(device)  # fsdp_cpu_offload: a DTensor's piece moves, and is gathered there
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    if (value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or value.dim() == 0
            or type(local) is not torch.Tensor):  # a tensor subclass (NF4, float8) gathers its own way
        return value.full_tensor()
    world = value.device_mesh.size()
    rows = value.shape[0]
    chunk = -(-rows // world)  # torch.chunk's piece size: ranks hold rows [r * chunk, (r + 1) * chunk)
    padded = local.new_zeros((chunk, *value.shape[1:]))
    padded[: local.size(0)] = local
    full = local.new_empty((world * chunk, *value.shape[1:]))
    dist.all_gather_into_tensor(full, padded, group=value.device_mesh.get_group())
    return full[:rows]
