"""Helpers the native engine's one-shot decode (``_native.py``) and its multi-turn sessions (``_session.py``)
share: whether a decode step may skip module hooks, and turning decoded token rows into a :class:`Rollout`."""

from typing import List

import torch
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.generation._output import Rollout

__all__ = ["can_skip_module_hooks", "to_rollout"]


def _only_fsdp_hooks(module: nn.Module) -> bool:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(type(getattr(h, "__self__", None)).__name__ == "FSDPState" for h in hooks)


def can_skip_module_hooks(model: nn.Module) -> bool:
    """Whether a decode step may call the decoder's layers directly, skipping their forward hooks.

    True for a torchtune ``TransformerDecoder`` whose parameters are all plain (unsharded) tensors and whose
    layers carry no forward hooks but FSDP2's. FSDP2's per-layer hooks only gather and free parameters;
    with every parameter already gathered for the whole rollout they do nothing but cost time, and under
    ``torch.compile`` they would split the decode step into one graph per layer.
    """
    if not isinstance(model, TransformerDecoder) or model.output_hidden_states:
        return False
    if any(type(p) not in (torch.Tensor, nn.Parameter) for p in model.parameters()):
        return False  # e.g. sharded DTensors: FSDP must gather them in its hooks
    return _only_fsdp_hooks(model) and all(_only_fsdp_hooks(layer) for layer in model.layers)


def to_rollout(
    prompt_ids: List[List[int]],
    out: torch.Tensor,
    done: torch.Tensor,
    stop: torch.Tensor,
) -> Rollout:
    """Cut each row after its first stop token. ``out`` is ``[N, steps]``, ``done [N]`` whether it stopped."""
    n, steps = out.shape
    is_stop = torch.isin(out, stop)
    # Length = index of the first stop token + 1, or every step when none came.
    first_stop = torch.where(
        is_stop.any(-1), is_stop.int().argmax(-1) + 1, torch.full_like(done, steps, dtype=torch.long)
    )
    rows = out.cpu().tolist()
    lengths = first_stop.cpu().tolist()
    response_ids = [row[:length] for row, length in zip(rows, lengths)]
    return Rollout(prompt_ids=prompt_ids, response_ids=response_ids, truncated=~done.cpu())
