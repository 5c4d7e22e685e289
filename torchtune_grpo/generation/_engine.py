"""The contract between the recipes and a generation engine: what a recipe may ask of one.

Every engine samples (``generate``) at a ``temperature`` and is closed at the end of a run (``close``).
An engine that ``holds_weights`` (vLLM) keeps its own copy of the policy: the recipe sends it the weights
after every optimizer step (``load_weights``) and checks that it samples from them by scoring a probe
sequence (``prompt_logprobs``, token ids below ``vocab_size``). An engine without its own weights samples
with the trainer's model, which the recipe passes to ``generate``.

Engines subclass :class:`GenerationEngine` (the protocol, with the defaults: no weights of its own, nothing
to close); :func:`check_engine` says, naming the member, when an object does not keep the contract.
"""

from typing import Iterable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._rollout import Rollout

__all__ = ["GenerationEngine", "check_engine"]


class GenerationEngine(Protocol):
    """What the recipes, evaluation and rejection sampling may ask of a generation engine.

    Attributes:
        temperature (float): the sampling temperature (0: greedy); training logprobs are computed at it.
        holds_weights (bool): the engine samples from its own copy of the weights, synced by the recipe
            with :meth:`load_weights` after every optimizer step. Default is False.
    """

    temperature: float
    holds_weights: bool = False

    def generate(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
    ) -> Rollout:
        """``group_size`` completions of each prompt; row ``i`` of the result answers prompt ``i // G``."""
        ...

    def close(self) -> None:
        """Release what the engine holds (called once, at the end of a run). Default: nothing."""

    def check_available(self) -> None:
        """Raise, saying what to install, when the engine cannot run here (called when a recipe starts,
        before any model is built; engines import heavy dependencies lazily). Default: nothing."""

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's ``(torchtune name, full tensor)`` weights; only when ``holds_weights``."""
        raise NotImplementedError(f"{type(self).__name__} samples with the trainer's model: no weights to load")

    def prompt_logprobs(self, tokens: List[int]) -> torch.Tensor:
        """``[len(tokens) - 1]`` logprobs of ``tokens[1:]`` under the engine's weights (the sync check)."""
        raise NotImplementedError(f"{type(self).__name__} samples with the trainer's model")

    @property
    def vocab_size(self) -> int:
        """Rows of the engine's embedding table (probe token ids are drawn below it)."""
        raise NotImplementedError(f"{type(self).__name__} samples with the trainer's model")


_ALWAYS = ("generate", "temperature", "close")
_WITH_WEIGHTS = ("load_weights", "prompt_logprobs", "vocab_size")


def check_engine(engine: object) -> GenerationEngine:
    """``engine`` itself when it keeps the :class:`GenerationEngine` contract.

    Raises:
        TypeError: naming the engine's class and the members it lacks (subclass :class:`GenerationEngine`
            for the defaults).
        ImportError: from the engine's ``check_available`` (e.g. vLLM not installed).
    """
    cls = type(engine)
    missing = [m for m in (*_ALWAYS, "holds_weights") if not hasattr(cls, m) and not hasattr(engine, m)]
    if not missing and engine.holds_weights:
        # vocab_size may be a property that reads files: look at the class only.
        missing = [m for m in _WITH_WEIGHTS if not hasattr(cls, m)]
    if missing:
        raise TypeError(
            f"generation engine {cls.__name__} lacks {', '.join(missing)}: subclass "
            "torchtune_grpo.generation.GenerationEngine and implement them (docs/architecture.md)."
        )
    if hasattr(engine, "check_available"):  # optional for engines that do not subclass the protocol
        engine.check_available()
    return engine
