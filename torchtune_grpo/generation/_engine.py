"""The contract between the recipes and a generation engine: what a recipe may ask of one.

Every engine samples (``generate``) at a ``temperature`` and is closed at the end of a run (``close``).
An engine that ``holds_weights`` (vLLM) keeps its own copy of the policy: the recipe sends it the weights
after every optimizer step (``load_weights``) and checks that it samples from them by scoring a probe
sequence (``prompt_logprobs``, token ids below ``vocab_size``). An engine without its own weights samples
with the trainer's model, which the recipe passes to ``generate``.

Multi-turn rollouts may ask an engine for a ``session`` (optional): an object that keeps each row's state,
such as its KV cache, from one turn to the next, so that a turn prefills only what was appended since the
last one. The native engine has one (:class:`~torchtune_grpo.generation.NativeGenerator`); the default is
None, and callers then re-send every history to ``generate`` (vLLM reuses it through prefix caching).

Engines subclass :class:`GenerationEngine` (the protocol, with the defaults: no weights of its own, nothing
to close, no sessions); :func:`check_engine` says, naming the member, when an object does not keep the
contract.
"""

from typing import Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._output import Rollout

__all__ = ["GenerationEngine", "GenerationSession", "check_engine"]


class GenerationSession(Protocol):
    """Turns of ``N = num_prompts x group_size`` rows that keep their state between calls (multi-turn).

    Opened by :meth:`GenerationEngine.session`; closed with ``close`` (or used as a context manager).
    """

    def generate(
        self,
        rows: Sequence[int],
        responses: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
    ) -> Rollout:
        """The next turn of ``rows`` (indices in ``[0, N)``), whose tokens after the prompt are now
        ``responses``; the first call samples every row from its prompt (all rows, empty responses). A
        later response extends what the session returned for its row (that turn, then appended tokens).
        One result row per entry of ``rows``, in order."""
        ...

    def close(self) -> None:
        """Release what the session holds."""


class GenerationEngine(Protocol):
    """What the recipes, evaluation and rejection sampling may ask of a generation engine.

    Attributes:
        temperature (float): the sampling temperature (0: greedy); training logprobs are computed at it.
        holds_weights (bool): the engine samples from its own copy of the weights, synced by the recipe
            with :meth:`load_weights` after every optimizer step. Default is False.
        takes_images (bool): ``generate`` also takes ``images=``, each prompt's image inputs (as
            :class:`~torchtune_grpo.data.ImagePromptDataset` gives them, or None), and samples with them; a run
            whose prompts carry images needs such an engine (docs/multimodal.md). Default is False.
    """

    temperature: float
    holds_weights: bool = False
    takes_images: bool = False

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

    def session(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    ) -> Optional[GenerationSession]:
        """Optional: a multi-turn session over ``group_size`` rows per prompt, each with a budget of
        ``max_new_tokens`` after its prompt over all turns (``images``: each prompt's image inputs, passed only
        when a prompt has some, to an engine that :attr:`takes_images`). Default: None (no sessions; callers
        re-send each row's history to :meth:`generate`)."""
        return None

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
