"""FSDP2 for the recipes: sharding a model with the run's precision, and gathering it for a rollout.

:func:`shard_model` is torchtune's ``training.shard_model`` with a mixed-precision policy (the casts of
``dtype: bf16``, torchtune_grpo/runtime/precision.py). :func:`unsharded` gathers every FSDP2 module's parameters once
for a whole rollout: decoding calls the model once per token, and resharding after each call would gather
the weights again every token.
"""

from contextlib import contextmanager
from typing import Callable, FrozenSet, Iterator, List, Optional

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard, MixedPrecisionPolicy

from torchtune_grpo.runtime.precision import Precision

__all__ = ["shard_model", "unsharded"]


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
