"""Training precision: which dtype the weights (and optimizer state) are kept in, and which one computes.

``dtype`` in the config names one of :data:`PRECISIONS`:

- ``fp32``: fp32 weights, fp32 compute. 16 bytes per parameter with AdamW (weight 4, gradient 4, two
  moments 8).
- ``bf16`` (mixed precision): **fp32 master weights and optimizer state**, forward and backward of the
  transformer layers in bf16, the embeddings, final norm, output projection and log-probabilities in fp32,
  gradients reduced in fp32. FSDP2's ``MixedPrecisionPolicy`` does the casting, on every process count: one
  process goes through FSDP2 too (a one-rank group), so 1 and N processes compute the same way. Also 16 bytes
  per parameter (the fp32 master copy, fp32 gradients, fp32 moments), plus a transient bf16 copy of the
  layer being computed. An AdamW step moves a weight by about ``lr``; in fp32 that is visible at any lr RL
  uses (1e-6), while a bf16 weight of magnitude ~0.02 has a spacing of ~1.2e-4 and drops such updates.
- ``bf16_pure``: bf16 weights, gradients and optimizer state (the mode ``bf16`` meant before): 8 bytes per
  parameter, but updates below half a bf16 spacing round away (most weights do not move at lr 1e-6).

A frozen model (the reference policy) is kept in the compute dtype: it never takes an update.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy

__all__ = ["PRECISIONS", "Precision", "shard_model"]


@dataclass(frozen=True)
class Precision:
    """A named training precision (see the module docstring).

    Attributes:
        name (str): the config's ``dtype``.
        param_dtype (torch.dtype): trainable weights, gradients and optimizer state.
        compute_dtype (torch.dtype): the transformer layers' forward and backward.
        bytes_per_param (int): weights + gradients + AdamW moments, per parameter.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    bytes_per_param: int

    @property
    def mixed(self) -> bool:
        """Whether weights and compute differ in dtype (then the model trains under FSDP2 mixed precision)."""
        return self.param_dtype != self.compute_dtype

    @classmethod
    def from_name(cls, name: str) -> "Precision":
        """The precision called ``name``.

        Raises:
            ValueError: naming the ``dtype`` key and the valid names.
        """
        if str(name) not in PRECISIONS:
            raise ValueError(f"dtype must be one of {sorted(PRECISIONS)}, got {name!r}")
        return PRECISIONS[str(name)]

    def describe(self) -> str:
        """One line for logs and the algorithm card."""
        if self.mixed:
            return (
                f"{self.name}: fp32 master weights and AdamW state, transformer layers computed in bf16 "
                f"(embeddings, output projection and logprobs in fp32, gradients reduced in fp32); "
                f"{self.bytes_per_param} bytes per parameter"
            )
        kind = str(self.param_dtype).replace("torch.", "")
        return f"{self.name}: weights, gradients and AdamW state in {kind}; {self.bytes_per_param} bytes per parameter"


#: The ``dtype`` names the recipes accept.
PRECISIONS: Dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, torch.float32, 16),
    "bf16": Precision("bf16", torch.float32, torch.bfloat16, 16),
    "bf16_pure": Precision("bf16_pure", torch.bfloat16, torch.bfloat16, 8),
}


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

    Raises:
        ValueError: if no module was picked.
    """
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
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
