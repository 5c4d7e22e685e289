"""Helpers the native engine's one-shot decode (``_native.py``) and its multi-turn sessions (``_session.py``)
share: whether a decode step may skip module hooks (on transformers' modules: run FSDP2's as traceable casts,
:func:`fsdp_hooks_as_casts`), and turning decoded token rows into a :class:`Rollout`."""

from contextlib import contextmanager
from typing import Any, Iterator, List

import torch
from torch import nn
from torchtune.modules import TransformerDecoder

from torchtune_grpo.generation._output import Rollout

__all__ = ["can_skip_module_hooks", "fsdp_hooks_as_casts", "to_rollout"]


def _is_fsdp_hook(hook: Any) -> bool:
    return type(getattr(hook, "__self__", None)).__name__ == "FSDPState"


def _only_fsdp_hooks(module: nn.Module) -> bool:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(_is_fsdp_hook(h) for h in hooks)


def _cast_inputs(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``value`` (through tuples, lists and dicts) cast to ``dtype``, the rest as it is:
    what FSDP2's mixed-precision policy does to a unit's forward inputs."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype) for k, v in value.items()}
    return value


def _cast_to_own_dtype(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    # One function object for every unit and rollout: dynamo's guards on the hook dictionaries then hold from one
    # rollout to the next, so the compiled decode step is not compiled again.
    dtype = next(module.parameters()).dtype
    return _cast_inputs(args, dtype), _cast_inputs(kwargs, dtype)


def _output_unchanged(module: nn.Module, args: tuple, output: Any) -> None:
    return None  # FSDP2's post-forward casts outputs only with an output_dtype, which this project never sets


@contextmanager
def fsdp_hooks_as_casts(model: nn.Module) -> Iterator[bool]:
    """Inside: FSDP2's forward hooks on ``model``'s modules replaced by a traceable cast of the inputs.

    FSDP2's hooks are hidden from ``torch.compile`` (each is a graph break), so a compiled decode step through
    transformers' own module would split into one graph per decoder layer, and dynamo, specialising each on its
    ``layer_idx``, stops compiling after a few layers. With every parameter gathered for the whole rollout
    (plain tensors), the hooks only cast each unit's floating-point inputs to the dtype its gathered parameters
    compute in (the mixed-precision policy; a no-op without one). Inside, each FSDP2 pre-forward hook is that cast
    and each post-forward hook returns the output unchanged, under the same dictionary keys, and both are restored
    on exit.

    Args:
        model (nn.Module): a module whose parameters FSDP2 gathered (or a plain one).

    Yields:
        bool: whether the hooks were replaced; False (left as they are) when a parameter is still sharded, there
        are no FSDP2 hooks, or a unit's parameters mix dtypes (its cast would be ambiguous).
    """
    units = [m for m in model.modules() if any(map(_is_fsdp_hook, m._forward_pre_hooks.values()))]
    plain = all(type(p) in (torch.Tensor, nn.Parameter) for p in model.parameters())
    single_dtype = all(len({p.dtype for p in m.parameters() if p.is_floating_point()}) == 1 for m in units)
    if not (units and plain and single_dtype):
        yield False
        return
    saved = []  # (hooks dictionary, key, FSDP2's hook)
    for m in units:
        for hooks, stand_in in ((m._forward_pre_hooks, _cast_to_own_dtype), (m._forward_hooks, _output_unchanged)):
            for key, hook in list(hooks.items()):
                if _is_fsdp_hook(hook):
                    saved.append((hooks, key, hook))
                    hooks[key] = stand_in  # FSDP2 registered its pre-forward hook with kwargs: the cast takes them
    try:
        yield True
    finally:
        for hooks, key, hook in saved:
            hooks[key] = hook


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
