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
from typing import Dict

import torch

__all__ = ["PRECISIONS", "Precision"]


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
