"""WeightPublisher (torchtune_grpo/generation/_publisher.py) with an in-test engine that keeps its own copy of
the weights: every version reaches it, and a stale or wrongly loaded copy stops the run."""

import copy

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.generation import WeightPublisher, WeightSyncCheck, WeightSyncError
from torchtune_grpo.models.logprobs import sequence_logprobs


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


class Bf16Engine(CopyEngine):
    """A correctly synced engine that computes in bf16 while the trainer computes in fp32 (issue 28: vLLM's
    ``dtype: auto`` resolved to bf16 on CPU for an fp32 run)."""

    compute_dtype = torch.bfloat16

    def prompt_logprobs(self, tokens):
        with torch.no_grad():
            return sequence_logprobs(self.model.to(torch.bfloat16), torch.tensor([tokens])).logprobs[0].float()


def test_a_dtype_mismatch_is_named_as_such_not_as_stale_weights():
    policy = make_tiny_decoder(seed=0)
    publisher = WeightPublisher(Bf16Engine(policy), WeightSyncCheck(tolerance=1e-5), probe_prompt=[3, 5, 7, 11, 13],
                                device=torch.device("cpu"), all_reduce_max=lambda x: x,
                                trainer_dtype=torch.float32)
    with pytest.raises(WeightSyncError) as error:
        publisher.publish(policy, step=0)  # every weight arrived: only the precision differs
    message = str(error.value)
    assert "The engine computes in bfloat16 and the trainer in float32" in message, message
    assert "generation.dtype" in message and "stale" not in message


def test_the_same_dtype_on_both_sides_keeps_the_stale_weights_message():
    check = WeightSyncCheck(tolerance=1e-3)
    with pytest.raises(WeightSyncError, match="stale") as error:
        check.verify(0.3, step=2, trainer_dtype=torch.float32, engine_dtype=torch.float32)
    assert "computes in" not in str(error.value)


def test_the_vllm_engine_dtype_follows_the_trainer_unless_set():
    from torchtune_grpo.generation import VLLMGenerator

    unset, fixed = VLLMGenerator(model="/nonexistent"), VLLMGenerator(model="/nonexistent", dtype="bf16")
    for engine in (unset, fixed):  # the publisher tells the engine before it starts (nothing is built here)
        WeightPublisher(engine, WeightSyncCheck(), probe_prompt=[1, 2], device=torch.device("cpu"),
                        all_reduce_max=lambda x: x, trainer_dtype=torch.float32)
    assert unset.dtype == "float32"  # was vLLM's "auto": bf16 on CPU for an fp32 checkpoint
    assert fixed.dtype == "bfloat16"  # set in the config: kept
    assert VLLMGenerator(model="/nonexistent").dtype is None and unset.compute_dtype is None  # not started
