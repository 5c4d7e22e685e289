"""Test engines that, like vLLM, sample from their own copy of the weights (``holds_weights``) but run the native
engine's code: the recipe's weight sync and its check exercised without starting vLLM.

- :class:`CopyGenerator` syncs correctly: a run with it samples what a run with the native engine would.
- :class:`StaleCopyGenerator` drops every sync after the first: the failure the sync check exists to catch.
"""

from typing import Any, Dict, Iterable, List, Tuple

import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.models.logprobs import sequence_logprobs


class CopyGenerator(NativeGenerator):
    """The native engine sampling from a copy of the policy that the recipe syncs (``load_weights``).

    The copy is built from the run's ``model`` config (random until the first sync) and scored as the sync
    check asks.

    Args:
        model (Dict[str, Any]): the run's model component (``${model}``).
        **kwargs: :class:`~torchtune_grpo.generation.NativeGenerator`'s.
    """

    holds_weights = True

    def __init__(self, model: Dict[str, Any], **kwargs):
        super().__init__(**kwargs)
        self._copy = tt_config.instantiate(OmegaConf.create(model)).eval().requires_grad_(False)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        state = dict(weights)
        self._copy.load_state_dict(state)
        return len(state)

    def prompt_logprobs(self, tokens: List[int]) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logprobs(self._copy, torch.tensor([tokens])).logprobs[0]  # [len(tokens) - 1]

    @property
    def vocab_size(self) -> int:
        return self._copy.tok_embeddings.num_embeddings

    def generate(self, model, prompts, **kwargs):
        return super().generate(self._copy, prompts, **kwargs)


class StaleCopyGenerator(CopyGenerator):
    """A :class:`CopyGenerator` whose sync is broken: the weights reach it once, before training, and never
    again. Later calls consume the weights (every rank must: they are gathered collectively from the FSDP
    shards) and drop them, as a sync into the wrong object, or one that was skipped, would."""

    def __init__(self, model: Dict[str, Any], **kwargs):
        super().__init__(model, **kwargs)
        self._synced_once = False

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        state = dict(weights)
        if not self._synced_once:
            self._copy.load_state_dict(state)
            self._synced_once = True
        return len(state)
