"""torchtune-grpo: GRPO recipes and components for torchtune.

The folders follow one GRPO step (docs/architecture.md). Modules that moved keep their old import path
for one release, with a FutureWarning naming the new one (:mod:`torchtune_grpo._moved`).
"""

from torchtune_grpo import _moved

# Before anything of the package imports torchtune (and so torchao): drops two known import-time lines that
# say nothing to a user (torchtune_grpo/runtime/quiet.py). Every process that imports the package gets it, the
# generation workers included.
from torchtune_grpo.runtime import quiet as _quiet  # noqa: F401

__version__ = "0.1.0"

_moved.install()
