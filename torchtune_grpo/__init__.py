"""torchtune-grpo: GRPO recipes and components for torchtune."""

__version__ = "0.1.0"
