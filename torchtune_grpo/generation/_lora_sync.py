"""What a LoRA (or QLoRA) policy sends to an engine holding its own weights: base once + adapter, or merged.

Two ways (``VLLMGenerator(lora_sync=...)``, docs/lora.md):

- ``adapter``: the frozen base weights go once, before training (:func:`base_weights`); after every
  optimizer step only the adapter goes (:func:`adapter_weights`, a few MB), loaded by the engine as a new
  adapter version next to the base.
- ``merge``: after every optimizer step the full weights go with the adapter merged in
  (:func:`merged_weights`: ``W + (alpha / r) B A`` computed in fp32 and cast to the trainer's dtype once, so
  the merge adds no rounding of its own: merging in bf16 is what made NeMo-RL's trainer and engine
  diverge). For engines or settings without adapter support.

QLoRA's NF4 base weights are dequantised the way the trainer's forward does (``weight.to(dtype)``,
torchao's ``linear_nf4``), not through torchtune's state-dict hook, which dequantises to bf16 whatever the
trainer computes in (an fp32 run would then be checked against bf16-rounded base weights).

Pure generators over the model's state dict: every rank must consume them completely, in the same order
(each DTensor is gathered with a collective).
"""

from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from torchtune.modules.peft import LoRALinear

from torchtune_grpo.models.lora import lora_hyperparams, LoRAHyperparams, nf4_parameters
from torchtune_grpo.runtime.sharding import gather_full_tensor

__all__ = [
    "LORA_SYNC_MODES",
    "adapter_weights",
    "base_weights",
    "is_adapter_key",
    "lora_model",
    "merged_weights",
]

LORA_SYNC_MODES = ("adapter", "merge")
_LORA_A, _LORA_B = ".lora_a.weight", ".lora_b.weight"
# Activation checkpointing wraps each layer; module names carry the wrapper, state-dict keys do not
# (torch's checkpoint wrapper strips it with a state-dict hook).
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def lora_model(model: nn.Module) -> Optional[LoRAHyperparams]:
    """``model``'s LoRA rank, alpha and targets, or None when it has no LoRA layers (full fine-tuning)."""
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        return None
    return lora_hyperparams(model)


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key is a LoRA A or B matrix (torchtune names)."""
    return name.endswith(_LORA_A) or name.endswith(_LORA_B)


def _nf4_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """QLoRA's NF4 base weights by state-dict key (unsharded: the LoRA recipe keeps them out of FSDP)."""
    return {name.replace(_CHECKPOINT_WRAPPER, ""): weight for name, weight in nf4_parameters(model)}



def _dense_weights(
    model: nn.Module, device: torch.device, dtype: torch.dtype
) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(torchtune name, full tensor)`` of every weight, NF4 dequantised to ``dtype`` as the forward does."""
    nf4 = _nf4_weights(model)
    for name, tensor in model.state_dict().items():
        if name in nf4:
            tensor = nf4[name].to(dtype)  # torchao's linear_nf4: F.linear(x, weight.to(x.dtype))
        yield name, gather_full_tensor(tensor, device).detach()  # fsdp_cpu_offload: gathered on the device


def base_weights(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base model's weights (every key but the adapters'), NF4 dequantised to ``dtype``.

    Args:
        model (nn.Module): the LoRA policy (FSDP2-sharded or plain).
        device (torch.device): where to gather.
        dtype (torch.dtype): the trainer's compute dtype (what NF4 weights are dequantised to).

    Yields:
        Tuple[str, torch.Tensor]: ``(torchtune name, full tensor)``, in state-dict order.
    """
    for name, tensor in _dense_weights(model, device, dtype):
        if not is_adapter_key(name):
            yield name, tensor


def adapter_weights(model: nn.Module, device: torch.device) -> Dict[str, torch.Tensor]:
    """Every LoRA A ``[r, in]`` and B ``[out, r]`` matrix, full (gathered), under torchtune names."""
    return {name: gather_full_tensor(p, device).detach() for name, p in model.state_dict().items()
            if is_adapter_key(name)}


def merged_weights(
    model: nn.Module, device: torch.device, dtype: torch.dtype, scale: float
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The policy as plain weights: each adapted ``W [out, in]`` becomes ``W + scale * B @ A``.

    The sum is computed in fp32 and cast to ``W``'s dtype (``dtype`` for NF4 weights) once. A base
    weight is held until its A and B have streamed past (the same module: a few tensors), so at most one
    layer's worth is ever buffered.

    Args:
        model (nn.Module): the LoRA policy (FSDP2-sharded or plain).
        device (torch.device): where to gather and merge.
        dtype (torch.dtype): the trainer's compute dtype (NF4 weights are dequantised to it).
        scale (float): LoRA's ``alpha / rank``.

    Yields:
        Tuple[str, torch.Tensor]: ``(torchtune name, full tensor)`` of every base weight, adapters merged.
    """
    adapted = _adapted_weight_keys(model)
    pending: Dict[str, Dict[str, torch.Tensor]] = {}  # module prefix -> {"weight"/"a"/"b": tensor}
    for name, tensor in _dense_weights(model, device, dtype):
        if name.endswith(_LORA_A):
            prefix, part = name[: -len(_LORA_A)], "a"
        elif name.endswith(_LORA_B):
            prefix, part = name[: -len(_LORA_B)], "b"
        elif name in adapted:
            prefix, part = name[: -len(".weight")], "weight"
        else:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[prefix]
            w, a, b = parts["weight"], parts["a"], parts["b"]
            merged = w.float() + scale * (b.float() @ a.float())  # [out, r] @ [r, in]
            yield prefix + ".weight", merged.to(w.dtype)
    if pending:
        raise RuntimeError(f"LoRA layers without both adapter matrices in the state dict: {sorted(pending)}")


def _adapted_weight_keys(model: nn.Module) -> set:
    """State-dict keys of the base weights that have an adapter (``<LoRA module>.weight``)."""
    return {
        name.replace(_CHECKPOINT_WRAPPER, "") + ".weight"
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
    }
