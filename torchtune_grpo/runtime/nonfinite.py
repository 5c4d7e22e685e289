"""What a run does when its loss, gradients or weights stop being finite numbers.

A diverging run (learning rate far too high, no clipping, a reward of 1e30) produces ``nan``/``inf`` that,
left alone, flow into the weights, then into every later checkpoint; with ``keep_last_n_checkpoints`` the
finite ones are pruned and nothing usable is left. The recipe checks, every optimizer step and every step:

- the global gradient norm (before clipping, all ranks): non-finite -> the optimizer step is not taken;
- the step's global loss: non-finite -> the step is reported as such;
- the weights after the step (each rank its shards, summed with the step's metrics): non-finite -> the run
  stops, whatever the policy (they cannot be taken back);
- the weights again before a checkpoint is written: a checkpoint with non-finite weights is never written, so
  pruning can only ever remove a finite checkpoint in favour of a newer finite one.

``on_nonfinite`` (a top-level config key) says what happens on a non-finite loss or gradient:
``"stop"`` (default) raises :class:`NonFiniteError` naming the step and the quantity; ``"skip"`` drops that
optimizer step (the gradients are discarded, the learning-rate schedule still advances), logs a warning and
counts it in ``nonfinite/skipped_optimizer_steps``.
"""

from typing import Iterable

import torch

__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "advice", "check_policy", "count_nonfinite"]

#: The values of ``on_nonfinite``.
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """The loss, a gradient or a weight became NaN or infinite (see the module docstring)."""


def check_policy(value: str) -> str:
    """``on_nonfinite`` checked.

    Raises:
        ValueError: naming the key and the value when it is not one of :data:`NONFINITE_POLICIES`.
    """
    if value not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite must be one of {list(NONFINITE_POLICIES)}, got {value!r}")
    return value


@torch.no_grad()
def count_nonfinite(tensors: Iterable[torch.Tensor]) -> int:
    """How many of ``tensors`` hold a NaN or an infinity (local values: a DTensor's own shard).

    One host sync for all of them (the flags are summed on device first).
    """
    flags = []
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            flags.append(torch.isfinite(local).all().logical_not())
    if not flags:
        return 0
    return int(torch.stack([f.to(flags[0].device) for f in flags]).sum().item())


def advice(what: str) -> str:
    """The usual fixes, appended to a :class:`NonFiniteError`."""
    return (f"{what}. Usual causes: a learning rate far too high, no gradient clipping (clip_grad_norm), "
            "rewards of huge magnitude, or bf16 overflow. No checkpoint with non-finite weights is written; "
            "the checkpoints saved so far are intact (resume_from_checkpoint=True continues from the newest). "
            "on_nonfinite=skip drops such optimizer steps instead of stopping.")
