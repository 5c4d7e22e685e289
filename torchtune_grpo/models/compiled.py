"""The training forward compiled per decoder layer (``compile_training``), used only where it is asked for.

:func:`compile_decoder_layers` compiles each transformer layer's ``forward`` with ``torch.compile`` and
``dynamic=True`` (one graph for every micro-batch length and row count instead of one per shape). The
compiled forward is only used inside :func:`compiled_layers`, which the training layout enters around its
forwards (the update's, the reference's and ``pi_old``'s, ``training/batch.py``); generation keeps the eager
layers (the native engine compiles its own decode step). FSDP2's per-layer hooks and activation
checkpointing's wrappers stay outside the compiled region: they wrap the layer module, whose ``forward`` is
what is compiled. :func:`compile_seconds` is torch's running total of compile time, so a step can report the
time it spent compiling apart from the time it spent computing.
"""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Set

import torch
from torch import nn

__all__ = ["compile_decoder_layers", "compile_seconds", "compiled_layers"]

_STATE = "_grpo_compiled_forward"
#: Recompilations of the layer forward allowed (``torch._dynamo.config.recompile_limit`` raised to at least this).
RECOMPILE_LIMIT = 64


class _LayerForward:
    """A layer's ``forward``: the compiled one while :func:`compiled_layers` is active, else the eager one."""

    def __init__(self, eager: Callable[..., Any], backend: str) -> None:
        self.eager = eager
        self.compiled = torch.compile(eager, backend=backend, dynamic=True)
        self.active = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if self.active else self.eager)(*args, **kwargs)


def _layers(model: nn.Module, classes: Optional[Set[type]] = None) -> Iterator[nn.Module]:
    # The decoder layers (the modules FSDP2 and activation checkpointing wrap): torchtune's by default.
    if classes is None:
        from torchtune.modules import TransformerSelfAttentionLayer

        classes = {TransformerSelfAttentionLayer}
    kinds = tuple(classes)
    return (m for m in model.modules() if isinstance(m, kinds))


def compile_decoder_layers(model: nn.Module, backend: str = "inductor", classes: Optional[Set[type]] = None) -> int:
    """Compile each decoder layer's forward of ``model`` (used inside :func:`compiled_layers` only).

    Args:
        model (nn.Module): a decoder (plain, FSDP2-wrapped or with checkpointed layers).
        backend (str): the ``torch.compile`` backend (``inductor`` on a GPU; ``aot_eager`` checks the traced
            graphs on a CPU without generating kernels). Default is ``"inductor"``.
        classes (Optional[Set[type]]): the decoder layers' classes. Default is torchtune's
            ``TransformerSelfAttentionLayer``.

    Returns:
        int: the layers compiled.

    Raises:
        ValueError: when ``backend`` is not a ``torch.compile`` backend, or ``model`` has no decoder layer
            (names the key, the value and the choices or the model's class).
    """
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"compile_training = {backend!r} is not a torch.compile backend here; known: {known}")
    # Every layer shares one compiled code object (the layer class's forward), recompiled per variant: train /
    # eval, with / without gradients, shared-prompt or packed masks or none, each model built in the process.
    # Past dynamo's default limit of 8 it would silently run eager: allow more.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
    # With dynamic=True the layers' float attributes (norm eps, dropout p) are first traced as symbolic floats,
    # then found to be fixed, which restarts each compile from scratch: specialise them from the start (the
    # three graphs of a tiny layer compile in 13.5 s instead of 21.3 s on CPU; the traced graph is the same).
    if hasattr(torch._dynamo.config, "specialize_float"):
        torch._dynamo.config.specialize_float = True
    count = 0
    for layer in _layers(model, classes):
        if not isinstance(getattr(layer, _STATE, None), _LayerForward):
            wrapper = _LayerForward(layer.forward, backend)
            setattr(layer, _STATE, wrapper)
            layer.forward = wrapper  # the instance attribute nn.Module.__call__ finds
        count += 1
    if count == 0:
        raise ValueError(
            f"compile_training: {type(model).__name__} has no decoder layer to compile (classes: {classes})"
        )
    return count


@contextmanager
def compiled_layers(model: nn.Module) -> Iterator[bool]:
    """Use the compiled layer forwards of ``model`` inside the block (a no-op for a model without them).

    Yields:
        bool: whether ``model`` has compiled layers (then build a layout's shared parts before the forward:
        :meth:`~torchtune_grpo.models.attention.AttentionLayout.prepare`).
    """
    wrappers = [w for m in model.modules() if isinstance(w := getattr(m, _STATE, None), _LayerForward)]
    previous = [w.active for w in wrappers]
    for w in wrappers:
        w.active = True
    try:
        yield bool(wrappers)
    finally:
        for w, was in zip(wrappers, previous):
            w.active = was


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process so far (dynamo's own total; 0.0 where this torch
    does not keep one)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
    except Exception:  # noqa: BLE001 - a private total: report nothing rather than fail a step
        return 0.0
