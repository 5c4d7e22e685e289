"""How the trained model computes: activation checkpointing (off, on, selective, auto) and TF32.

Each is a trade of speed for memory or precision, set in the config and measured on a GPU by the GPU check's
ablation stage (docs/gpu.md):

- ``activation_checkpointing``: ``on`` keeps only each decoder layer's input and recomputes the layer in
  backward (a second forward of every layer: about a third more work, the least memory); ``off`` keeps every
  activation (no recomputation, the most memory); ``selective`` checkpoints every
  ``activation_checkpointing_every``-th layer (in between); ``auto`` is ``off`` when
  :func:`training_memory_estimate` fits the device's memory, else ``on``. The same numbers either way:
  recomputation repeats the same operations.
- ``tf32``: fp32 matrix products on CUDA in TF32 (10-bit mantissa inputs, fp32 accumulation): the products
  that stay fp32 (the ``fp32`` logprob head, fp32 runs) at the tensor-core rate; no effect on the CPU. It is
  set for the whole process (torch's flag), so the generation engine's fp32 products use it too.
"""

import os
from typing import NamedTuple, Optional, Set

import torch
from torch import nn

__all__ = [
    "ACTIVATION_CHECKPOINTING", "MemoryEstimate", "apply_activation_checkpointing", "checkpointed_layers",
    "resolve_activation_checkpointing", "set_tf32", "training_memory_estimate",
]

#: The ``activation_checkpointing`` modes.
ACTIVATION_CHECKPOINTING = ("off", "on", "selective", "auto")
# Share of the device's memory the auto mode plans to fill: the rest is the allocator's fragmentation, the
# generation engine's caches and what the estimate leaves out.
AUTO_MEMORY_FRACTION = 0.8


def checkpointed_layers(num_layers: int, mode: str, every: int = 2) -> Set[int]:
    """Indices of the decoder layers to checkpoint under ``mode`` (``auto`` resolved first).

    Args:
        num_layers (int): decoder layers of the model.
        mode (str): ``off``, ``on`` or ``selective``.
        every (int): with ``selective``, every ``every``-th layer (layers ``every - 1, 2 every - 1, ...``;
            1 is every layer). Default is 2.

    Returns:
        Set[int]: layer indices.

    Raises:
        ValueError: naming the key for an unknown mode or ``every < 1``.
    """
    if mode == "off":
        return set()
    if mode == "on":
        return set(range(num_layers))
    if mode == "selective":
        if every < 1:
            raise ValueError(f"activation_checkpointing_every must be >= 1, got {every}")
        return {i for i in range(num_layers) if (i + 1) % every == 0}
    raise ValueError(f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING[:3]} here, got {mode!r}")


def apply_activation_checkpointing(model: nn.Module, layers: Set[int], classes: Optional[Set[type]] = None) -> None:
    """Wrap the decoder layers of ``model.layers`` whose index is in ``layers`` for recomputation in backward.

    Args:
        model (nn.Module): a decoder with ``layers`` (torchtune's, or a transformers policy's).
        layers (Set[int]): indices into ``model.layers`` (:func:`checkpointed_layers`).
        classes (Optional[Set[type]]): the decoder layers' classes. Default is torchtune's
            ``TransformerSelfAttentionLayer``.
    """
    if not layers:
        return
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    kinds = tuple(classes or {TransformerSelfAttentionLayer})
    chosen = {id(layer) for i, layer in enumerate(model.layers) if i in layers}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        return recurse or (isinstance(module, kinds) and id(module) in chosen)

    training.set_activation_checkpointing(model, auto_wrap_policy=policy)


class MemoryEstimate(NamedTuple):
    """What :func:`training_memory_estimate` adds up, in bytes.

    Attributes:
        states (int): weights, gradients and optimizer state of this rank (the precision's bytes per
            parameter over the processes) plus the reference model in the compute dtype.
        activations (int): a micro-batch's saved activations with no checkpointing.
        checkpointed (int): the same with every layer checkpointed (layer inputs + one layer's activations).
        head (int): the chunked logprob head's two ``[chunk, V]`` fp32 buffers.
    """

    states: int
    activations: int
    checkpointed: int
    head: int

    def total(self, checkpointing: bool) -> int:
        return self.states + self.head + (self.checkpointed if checkpointing else self.activations)


def training_memory_estimate(
    model: nn.Module, *, tokens: int, bytes_per_param: int, compute_bytes: int, world_size: int,
    chunk_size: int, reference: bool,
) -> MemoryEstimate:
    """An estimate of the training peak of a torchtune decoder (shapes read on the meta device).

    Saved activations per token and layer, in the compute dtype: the two norms' inputs and outputs (4 D),
    the query, key and value before and after RoPE (2 (D_q + 2 D_kv)), the attention output and the output
    projection's (D_q + D), and the MLP's gate, up, activation and product (4 I). Attention scores are not
    counted (SDPA's fused kernels keep none); neither are temporaries of one operation.

    Args:
        model (nn.Module): the decoder (meta or real).
        tokens (int): tokens of the largest micro-batch (padding included).
        bytes_per_param (int): the precision's weights + gradients + optimizer bytes per parameter.
        compute_bytes (int): bytes of the compute dtype.
        world_size (int): processes sharing the states (FSDP2).
        chunk_size (int): the logprob head's chunk.
        reference (bool): a frozen reference model is held too.

    Returns:
        MemoryEstimate: the parts, in bytes.
    """
    params = sum(p.numel() for p in model.parameters())
    states = params * bytes_per_param // world_size + (params * compute_bytes // world_size if reference else 0)
    dim = model.tok_embeddings.embedding_dim
    per_token = sum(_saved_per_token(layer, dim) for layer in model.layers)
    layers = max(len(model.layers), 1)
    vocab = model.tok_embeddings.num_embeddings
    return MemoryEstimate(
        states=states,
        activations=tokens * per_token * compute_bytes,
        checkpointed=tokens * (layers * dim + per_token // layers) * compute_bytes,
        head=2 * min(chunk_size, tokens) * vocab * 4,
    )


def _saved_per_token(layer: nn.Module, dim: int) -> int:
    """Values one token saves in ``layer`` for backward (the sum in :func:`training_memory_estimate`)."""
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    if attn is not None and hasattr(attn, "num_kv_heads") and hasattr(mlp, "w1"):  # torchtune's layer
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return 4 * dim + 2 * (q + 2 * kv) + q + dim + 4 * mlp.w1.out_features
    # Another family's layer (a transformers policy): a dense layer holds about 3 D^2 attention and 3 D I MLP
    # weights; with a query of width D and keys/values of D/2, the sum above is 10 D + 4 I.
    hidden = max(sum(p.numel() for p in layer.parameters()) // dim - 3 * dim, 0) // 3
    return 10 * dim + 4 * hidden


def device_memory_bytes(device: torch.device) -> int:
    """The device's total memory (a GPU's; the machine's RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_activation_checkpointing(
    mode: str, estimate: Optional[MemoryEstimate], device_bytes: int
) -> str:
    """``mode`` with ``auto`` decided: ``off`` when the estimate without checkpointing fits
    :data:`AUTO_MEMORY_FRACTION` of ``device_bytes``, else ``on``."""
    if mode != "auto":
        return mode
    if estimate is None:
        return "on"
    return "off" if estimate.total(checkpointing=False) <= AUTO_MEMORY_FRACTION * device_bytes else "on"


def set_tf32(enabled: bool) -> None:
    """With ``enabled``, fp32 matrix products on CUDA in TF32 (``tf32``); else torch's defaults stay as they are.
    The CPU's products are unchanged either way."""
    if not enabled:
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9's interface; the old flag warns there
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
