"""torchtune-grpo: GRPO recipes and components for torchtune.

The folders follow one GRPO step (docs/architecture.md). Modules that moved keep their old import path
for one release, with a FutureWarning naming the new one (:mod:`torchtune_grpo._moved`).
"""

from torchtune_grpo import _moved

__version__ = "0.1.0"

_moved.install()
