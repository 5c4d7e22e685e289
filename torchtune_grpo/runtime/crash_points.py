"""A test-only hook that SIGKILLs the process at a named point of a run, to test crash safety.

    TORCHTUNE_GRPO_CRASH_AT=save:4 tune run grpo_full_finetune_distributed --config ...

kills rank 0 with SIGKILL when it reaches :func:`crash_point` ``("save", 4)``, as a power cut or an
out-of-memory kill would (no cleanup, no flushing). Under ``torchrun`` the launcher then stops the other
ranks. ``NAME:STEP:RANK`` picks another rank; ``NAME:STEP:RANK:TERM`` sends SIGTERM instead (a preemption
notice reaching that rank only: torchtune_grpo/runtime/preemption.py). Unset (always, outside tests), a call costs
one dictionary lookup. The points (``step`` is the step being trained or saved):

- ``rollout``: the step's rollouts are generated and scored, nothing trained yet;
- ``update``: the optimizer step is taken, the step's metrics not yet written;
- ``logged``: the step's metrics are written (between two saves);
- ``save``: the checkpoint's model files are written, the checkpoint not yet complete;
- ``replace``: re-saving a step that already had a checkpoint, between moving the old one aside and
  putting the new one in place.

tests/test_distributed_runs.py kills runs at these points and checks that the resumed runs end as an
uninterrupted one does.
"""

import os
import signal

__all__ = ["CRASH_ENV", "crash_point"]

CRASH_ENV = "TORCHTUNE_GRPO_CRASH_AT"


def crash_point(name: str, step: int) -> None:
    """SIGKILL (or SIGTERM) this process if ``TORCHTUNE_GRPO_CRASH_AT`` names this point, step and rank."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    point, at_step, rank, sig = (spec.split(":") + ["", "", ""])[:4]
    if point == name and int(at_step) == step and int(rank or 0) == int(os.environ.get("RANK", 0)):
        os.kill(os.getpid(), signal.SIGTERM if sig == "TERM" else signal.SIGKILL)
