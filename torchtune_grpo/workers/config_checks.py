"""What generation workers support, checked from the config at setup (before any process group or worker starts).

The trainer's side of a worker is :mod:`~torchtune_grpo.workers.client`; this module only reads the typed config
and the configured engine.
"""

from typing import Any

from torchtune_grpo.config.schema import LoRARecipeConfig

__all__ = ["check_generation_workers"]


def check_generation_workers(config: Any, engine: Any) -> None:
    """Refuse, naming the key, what generation workers do not support yet (before any process group).

    Args:
        config (Any): the typed config (``generation_workers``; the LoRA recipe's :class:`LoRARecipeConfig`).
        engine (Any): the configured generation engine.

    Raises:
        ValueError: for LoRA with an engine that holds its own weights (vLLM), with workers on; for
            ``in_flight_updates`` without workers, with an engine that cannot take weights while it generates,
            or with multi-turn episodes.
    """
    workers = config.generation_workers
    if workers.in_flight_updates:
        if not workers.enabled:
            raise ValueError("generation_workers.in_flight_updates needs generation_workers.enabled: true (the "
                             "updates land in a worker's engine while it generates)")
        if not getattr(engine, "supports_in_flight_updates", False):
            raise ValueError(
                f"generation_workers.in_flight_updates needs an engine that takes weights while it generates "
                f"(torchtune_grpo.generation.VLLMServerGenerator); {type(engine).__name__} does not"
            )
        if config.environment is not None:
            raise ValueError("generation_workers.in_flight_updates is single-turn only: with an environment "
                             "(multi-turn episodes) the tokens' weight versions are not tracked through the turns")
    if not workers.enabled:
        return
    if engine.holds_weights and isinstance(config, LoRARecipeConfig):
        raise ValueError(
            f"generation_workers.enabled with {type(engine).__name__} in the LoRA recipe is not supported yet "
            "(the worker would need the adapter sync): use torchtune_grpo.generation.NativeGenerator in the "
            "workers, or turn generation_workers off to use LoRA with vLLM in the trainer's process"
        )
