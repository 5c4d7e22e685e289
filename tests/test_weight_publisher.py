"""WeightPublisher (torchtune_grpo/generation/_publisher.py) with an in-test engine that keeps its own copy of
the weights: every version reaches it, and a stale or wrongly loaded copy stops the run."""

import copy

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.generation import WeightPublisher, WeightSyncCheck, WeightSyncError
from torchtune_grpo.logprobs import sequence_logprobs


class CopyEngine:
    """Holds its own model; ``load_weights`` copies the streamed tensors in (or ignores them: ``stale``)."""

    holds_weights = True
    temperature = 1.0

    def __init__(self, model, stale: bool = False):
        self.model, self.stale, self.loaded = copy.deepcopy(model).eval(), stale, []

    def load_weights(self, weights):
        for name, tensor in weights:  # consumed completely, as a generator with collectives must be
            self.loaded.append(name)
            if not self.stale:
                self.model.state_dict()[name].copy_(tensor)

    def prompt_logprobs(self, tokens):
        with torch.no_grad():
            return sequence_logprobs(self.model, torch.tensor([tokens])).logprobs[0]

    @property
    def vocab_size(self):
        return self.model.tok_embeddings.num_embeddings


def _publisher(engine, **check):
    return WeightPublisher(engine, WeightSyncCheck(**check), probe_prompt=[3, 5, 7, 11], device=torch.device("cpu"),
                           all_reduce_max=lambda x: x)


def test_every_version_reaches_the_engine_and_is_checked():
    policy = make_tiny_decoder(seed=0)
    engine = CopyEngine(policy)
    publisher = _publisher(engine, every_n_syncs=2)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)  # an optimizer step
    first = publisher.publish(policy, step=1)
    assert first["generation/sync_logprob_diff"] < 1e-4 and "time/weight_sync" in first
    assert set(engine.loaded) == set(policy.state_dict())
    second = publisher.publish(policy, step=2)
    assert "generation/sync_logprob_diff" not in second  # every_n_syncs=2: the 2nd version is not probed
    assert publisher.versions_published == 2


def test_a_stale_engine_stops_the_run():
    policy = make_tiny_decoder(seed=0)
    publisher = _publisher(CopyEngine(policy, stale=True))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    with pytest.raises(WeightSyncError):
        publisher.publish(policy, step=7)
