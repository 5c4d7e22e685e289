"""LoRA/QLoRA weight sync to an engine holding its own weights (torchtune_grpo/generation/_lora_sync.py and the
publisher's LoRA path), with an in-test engine: no vLLM needed. (The real vLLM engine with adapters:
tests/test_vllm_engine.py.)

- ``merge``: the merged weights give the LoRA (and QLoRA) policy's logits exactly (fp32);
- ``adapter``: the base goes once, then only the adapter (bytes counted), every version is checked, and an
  engine that drops adapter versions (a stale adapter sync) stops the run.
"""

import copy
from pathlib import Path

import pytest
import torch
from torchtune.models.qwen2 import lora_qwen2, qwen2

from tests.tolerances import ulps
from torchtune_grpo.generation import WeightPublisher, WeightSyncCheck, WeightSyncError
from torchtune_grpo.generation._lora_sync import adapter_weights, base_weights, merged_weights
from torchtune_grpo.generation._vllm_lora import check_adapter_targets, vllm_lora_rank
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.models.lora import LoRAHyperparams, lora_hyperparams, nf4_parameters

CPU = torch.device("cpu")
# NF4 needs each adapted weight's size to be a multiple of 64 x 256: 128 x 128 and 128 x 256 are.
SHAPE = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, intermediate_dim=256,
             max_seq_len=64, tie_word_embeddings=True)
PROBE = [3, 9, 27, 81, 50, 11, 33, 7]


def _lora_policy(quantize_base: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny LoRA (or QLoRA) Qwen2 with base weights from a seeded plain model and non-zero adapters."""
    torch.manual_seed(seed)
    base = qwen2(**SHAPE)
    model = lora_qwen2(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                       lora_rank=4, lora_alpha=8, quantize_base=quantize_base, **SHAPE)
    model.load_state_dict(base.state_dict(), strict=False)  # NF4 layers quantise what they load
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.05)  # B starts at zero in training; a trained adapter is not
    return model.eval()


def _move_adapters(model: torch.nn.Module, scale: float = 0.05) -> None:
    """One "optimizer step" on the adapters alone (the base is frozen)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(scale * torch.randn_like(p))


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_merged_weights_are_the_lora_policy(quantize_base):
    policy = _lora_policy(quantize_base)
    if quantize_base:
        assert nf4_parameters(policy), "the QLoRA model must hold NF4 base weights"
    hp = lora_hyperparams(policy)
    merged = dict(merged_weights(policy, CPU, torch.float32, hp.alpha / hp.rank))
    assert not any("lora_" in k for k in merged)
    plain = qwen2(**SHAPE)
    plain.load_state_dict(merged)  # strict: every base key, nothing else
    # fp32 merge, fp32 forward: the merged model computes what the adapter model computes, to rounding. The two
    # round differently in each of 15 matmuls (2 layers x 7 adapted projections, then the output head) and in
    # the merge W + s B A itself; independent roundings add like a random walk, about sqrt(15) ~ 4 ulp of
    # the logits (|logit| up to ~130 here, where 1 ulp = 1.5e-5). Measured: 1 ulp with AVX-512, 2 with AVX2 or
    # scalar kernels. Bound: 8 ulp of the largest logit.
    expected = _logits(policy, PROBE)
    torch.testing.assert_close(_logits(plain.eval(), PROBE), expected, atol=ulps(expected, 8), rtol=0)
    # And the merge is not trivially the base: the adapters change the logits.
    base = qwen2(**SHAPE)
    base.load_state_dict(dict(base_weights(policy, CPU, torch.float32)))
    assert (_logits(base.eval(), PROBE) - _logits(policy, PROBE)).abs().max() > 1e-2


def test_nf4_base_weights_are_dequantised_as_the_forward_does():
    # torchtune's state-dict hook dequantises NF4 to bf16; the trainer's forward uses weight.to(fp32).
    policy = _lora_policy(quantize_base=True)
    name, nf4 = nf4_parameters(policy)[0]
    sent = dict(base_weights(policy, CPU, torch.float32))[name]
    assert sent.dtype == torch.float32
    assert torch.equal(sent, nf4.to(torch.float32))


class LoRACopyEngine:
    """Holds its own copy of the LoRA policy: base weights from ``load_weights``, adapters from ``load_adapter``.

    With ``stale_adapter`` the first adapter arrives and later versions are dropped (a skipped adapter sync).
    """

    holds_weights = True
    temperature = 1.0
    lora_sync = "adapter"

    def __init__(self, policy, stale_adapter: bool = False):
        self.model = copy.deepcopy(policy).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                if p.dtype.is_floating_point:
                    p.zero_()  # nothing the trainer did not send
        self.stale_adapter, self.adapters, self.base_loads, self.lora = stale_adapter, [], 0, None

    def enable_lora(self, hparams):
        self.lora = hparams

    def load_weights(self, weights):
        state = dict(weights)
        assert not any("lora_" in k for k in state), "the adapter does not travel with the base"
        self.model.load_state_dict(state, strict=False)
        self.base_loads += 1

    def load_adapter(self, adapter, hparams, *, version):
        self.adapters.append(version)
        if not (self.stale_adapter and version > 0):
            self.model.load_state_dict(adapter, strict=False)

    def prompt_logprobs(self, tokens):
        with torch.no_grad():
            return sequence_logprobs(self.model, torch.tensor([tokens])).logprobs[0]

    @property
    def vocab_size(self):
        return SHAPE["vocab_size"]


def _publisher(engine):
    return WeightPublisher(engine, WeightSyncCheck(probe="random", probe_length=16), probe_prompt=[],
                           device=CPU, all_reduce_max=lambda x: x, trainer_dtype=torch.float32)


def test_adapter_sync_sends_the_base_once_then_only_the_adapter():
    policy = _lora_policy()
    engine = LoRACopyEngine(policy)
    publisher = _publisher(engine)
    first = publisher.publish(policy, step=0)
    assert engine.lora == lora_hyperparams(policy)  # told before the first load (vLLM sizes adapter slots)
    adapter_bytes = sum(t.numel() * 4 for t in adapter_weights(policy, CPU).values())
    all_bytes = sum(t.numel() * 4 for t in policy.state_dict().values())
    assert first["generation/sync_bytes"] == all_bytes  # base (every non-adapter weight) + adapter, fp32
    _move_adapters(policy)
    second = publisher.publish(policy, step=1)
    assert second["generation/sync_bytes"] == adapter_bytes < all_bytes / 5
    assert engine.base_loads == 1 and engine.adapters == [0, 1]
    assert second["generation/sync_logprob_diff"] < 1e-5  # the engine has the moved adapter


def test_a_stale_adapter_sync_stops_the_run():
    policy = _lora_policy()
    publisher = _publisher(LoRACopyEngine(policy, stale_adapter=True))
    publisher.publish(policy, step=0)  # version 0 arrives
    _move_adapters(policy)
    with pytest.raises(WeightSyncError, match=r"after step 1: .*stale"):
        publisher.publish(policy, step=1)  # version 1 is dropped


def test_merge_sync_for_engines_without_adapters():
    policy = _lora_policy()

    class MergeEngine(LoRACopyEngine):
        lora_sync = "merge"

        def load_weights(self, weights):
            self.model.load_state_dict(dict(weights), strict=False)  # merged base weights, adapters stay zero
            self.base_loads += 1

    engine = MergeEngine(policy)
    publisher = _publisher(engine)
    _move_adapters(policy)
    metrics = publisher.publish(policy, step=1)
    assert metrics["generation/sync_logprob_diff"] < 1e-4 and engine.adapters == [] and engine.lora is None
    base_bytes = sum(t.numel() * 4 for k, t in policy.state_dict().items() if "lora_" not in k)
    assert metrics["generation/sync_bytes"] == base_bytes  # full (merged) weights, no adapter


def test_vllm_adapter_limits_are_named():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 65)] == [1, 8, 8, 16, 64, 128]
    with pytest.raises(ValueError, match="largest max_lora_rank"):
        vllm_lora_rank(1024)
    check_adapter_targets(LoRAHyperparams(8, 16.0, ["q_proj", "w1"]))
    with pytest.raises(ValueError, match=r"output projection .*lora_sync: merge"):
        check_adapter_targets(LoRAHyperparams(8, 16.0, ["q_proj", "output"]))


def test_the_algorithm_card_states_the_lora_sync():
    from torchtune_grpo.config.algorithm_card import algorithm_card, AlgorithmSpec

    policy = _lora_policy()
    adapter = _publisher(LoRACopyEngine(policy)).describe(policy)
    assert adapter.startswith("its own copy of the base weights (sent once) plus the LoRA adapter (rank 4, alpha 8)")
    assert "(lora_sync: adapter); checked after every 1 sync(s)" in adapter

    class MergeEngine(LoRACopyEngine):
        lora_sync = "merge"

    merge = _publisher(MergeEngine(policy)).describe(policy)
    assert "W + (alpha / r) B A computed in fp32 and cast to float32 once (lora_sync: merge)" in merge
    spec = AlgorithmSpec(world_size=1, batch_size=2, group_size=4, micro_batch_size=8, ppo_epochs=1,
                         max_response_length=16, advantage="A", weight_sync=merge)
    assert f"- Generation engine weights: {merge}." in algorithm_card(spec)


def test_adapter_versions_stage_peft_files_load_them_and_drop_the_previous(tmp_path):
    # A stand-in for vllm.LLM's engine: records what add_lora found on disk and which ids were removed.
    from torchtune_grpo.generation._vllm_lora import AdapterVersions

    class Engine:
        def __init__(self):
            self.added, self.removed = [], []

        def add_lora(self, request):
            files = sorted(p.name for p in Path(request.lora_path).iterdir())
            self.added.append((request.lora_name, request.lora_int_id, files))
            return True

        def remove_lora(self, lora_id):
            self.removed.append(lora_id)
            return True

    class LLM:
        llm_engine = Engine()

    policy = _lora_policy()
    hf = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 128}
    versions = AdapterVersions(hf, staging_root=str(tmp_path))
    llm = LLM()
    for version in (0, 1):
        versions.load(llm, adapter_weights(policy, CPU), lora_hyperparams(policy), version)
    assert llm.llm_engine.added == [
        ("policy-v0-1", 1, ["adapter_config.json", "adapter_model.safetensors"]),
        ("policy-v1-2", 2, ["adapter_config.json", "adapter_model.safetensors"]),
    ]
    assert llm.llm_engine.removed == [1]  # version 0 dropped once version 1 is in
    assert versions.current.lora_int_id == 2 and list(versions.staging_dir.iterdir()) == []  # read, then deleted
    versions.forget()  # vLLM's weight reload unloads adapters: serve none rather than a missing id
    assert versions.current is None
    versions.close()
    assert not versions.staging_dir.exists()
