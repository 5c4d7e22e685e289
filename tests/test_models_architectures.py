"""GRPO on every supported architecture's model directory, through the recipe class in process:

- two steps on one process with the native engine; the step directory loads in transformers with our
  model's logits (Qwen3 also runs through `tune run` in test_models_recipe.py);
- two steps on two processes (FSDP2) for every architecture in ONE two-process launch, each equal to the same
  global batch on one process; in the same launch, two transformers-backend families (one and two processes, and
  micro-batches from a token budget) and every mixture-of-experts family (FSDP2 shards each decoder layer, its
  fused expert parameters along the expert dimension, as one unit), and attention LoRA on Qwen3-MoE; and image
  prompts on tiny Gemma 3, Qwen3.5 and Gemma 4 image directories, the tower frozen, then trained (Gemma 3's
  projector, with a resume on two processes; Qwen3.5's tower) (tests/test_vision_recipe.py).
"""

import math
from pathlib import Path

import pytest
import torch

from tests.hf_families import make_family_dir
from tests.hf_moe import MOE_FAMILY_NAMES, ROUTER_GAIN
from tests.hf_models import ARCHITECTURES, hf_components, make_model_dir
from tests._spawn_runs import launch, Run
from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.tolerances import ulps
from tests.test_models_recipe import TWO_STEPS, check_trained_directory
from tests.test_vision_recipe import check_image_split, image_split_runs
from tests.test_vision_lora import check_lora_image_split, lora_image_split_runs


def _config(tmp_path: Path, arch: str) -> Path:
    src = make_model_dir(tmp_path / arch, arch)
    return src, write_config(tmp_path, **hf_components(src), **TWO_STEPS)


def _run_in_process(path: Path, lora: bool = False) -> None:
    run_in_process(path, lora=lora)


@pytest.mark.parametrize("arch", sorted(a for a in ARCHITECTURES if a != "qwen3"))
def test_two_grpo_steps_in_process(arch, tmp_path, clean_env, one_thread):
    src, path = _config(tmp_path, arch)
    _run_in_process(path)
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    check_trained_directory(src, tmp_path / "out" / "step_2", tmp_path)


# ------------------------------------------------------------------------------- 1 vs 2 processes

# Runs on one process (batch_size 4) and on two (batch_size 2 each) see the same global batch: shuffle is off,
# so rank r of W takes prompts r, r + W, ..., and the scripted engine (tests/_engines.py) gives a prompt the
# same completions on any rank (each rank's sampler has its own RNG stream, so the native engine's rollouts
# would differ). SGD without clipping or schedule: the update is the raw global gradient (AdamW's first step,
# lr * g / |g|, would amplify rounding in near-zero gradients). micro_batch_size 8: two micro-batches on one
# process, one on each of two. 8 prompts: the two steps' worth.
def _split_config(run_dir: Path, src: Path, batch_size: int, **overrides) -> Path:
    run_dir.mkdir(parents=True)
    settings = dict(
        max_steps=2, save_every_n_steps=2, shuffle=False, batch_size=batch_size, micro_batch_size=8,
        generation={"_component_": "tests._engines.ScriptedGenerator"}, lr_scheduler=None, clip_grad_norm=None,
        optimizer={"_component_": "torch.optim.SGD", "lr": 0.05}, **{"dataset.num_samples": 8},
    )
    return write_config(run_dir, **{**hf_components(src), **settings, **overrides})


LORA_CONFIG = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"
# Families trained as transformers' own module: Gemma 3 (sliding + global layers, scaled embeddings, tied), Qwen3.5
# (Gated DeltaNet linear attention + gated full attention, untied).
TRANSFORMERS_FAMILIES = ("gemma3_text", "qwen3_5_text")
# Selective checkpointing recomputes the same operations, so it keeps the bound below. The bf16 logprob head is left
# out: it rounds each token's hidden state to bf16, and a hidden state that differs by fp32 rounding between
# groupings can land on a neighbouring bf16 value (seen: 3e-5 on Gemma 3's embeddings after SGD's step), a bf16-ulp
# effect this fp32 bound is not derived for (its micro-batch invariance: tests/test_update_switches.py).
SWITCHES = dict(activation_checkpointing="selective", activation_checkpointing_every=2)
SWITCH_RUNS = {"switches_qwen3": "qwen3", "switches_gemma3": "gemma3_text"}
# Routing replay on the 2-layer, 4-expert, top-2 MoE fixtures, with scripted routes (tests/_engines.py) and both
# router losses at coefficients large enough to move the routers visibly in two SGD steps.
REPLAY = dict(generation={"_component_": "tests._engines.ScriptedGenerator", "routes": [2, 4, 2]},
              moe={"routing_replay": "rollout", "load_balance_coef": 0.5, "z_loss_coef": 0.1})
QLORA_SHAPES = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=4, head_dim=32)  # NF4 blocks


@pytest.mark.slow
def test_every_architecture_two_processes_equal_one_process(tmp_path, one_thread):
    # Replaces one `tune run --nproc_per_node 2` per architecture (Llama 3.2 ~65 s, Qwen3 ~40 s on a loaded
    # machine): one launch of two processes for all architectures, plus QLoRA on Qwen3 (lora_hf_model).
    archs = sorted(ARCHITECTURES)
    runs = []
    for arch in archs:
        src = make_model_dir(tmp_path / arch / "model", arch)
        one, two = (_split_config(tmp_path / arch / name, src, size) for name, size in (("one", 4), ("two", 2)))
        runs.append(Run(two_processes=str(two), one_process=str(one)))
    # QLoRA, two processes only: each rank initialises its shard of the adapters' A matrices from its own RNG
    # stream (seed + rank; DTensor's synchronised RNG is CUDA-only), so the run cannot equal a one-process one.
    qlora_src = make_model_dir(tmp_path / "qlora" / "model", "qwen3", **QLORA_SHAPES)
    qlora = _split_config(tmp_path / "qlora" / "two", qlora_src, 2, model={
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "lora_rank": 4, "lora_alpha": 8, "quantize_base": True,
    }, base=LORA_CONFIG)
    runs.append(Run(two_processes=str(qlora), lora=True))
    # transformers' own modules (model.backend: auto on these families): FSDP2 per decoder layer on two processes
    # equals one process, and so does a two-process run whose micro-batches come from a token budget. Gemma 3 trains
    # in the default shared-prompt layout (explicit masks: one row per group of 4 on one process, of 2 on each of
    # two); so does Qwen3.5, its Gated DeltaNet layers taking each row's sequences apart (tests/test_transformers_layouts.py).
    # A budget of 80 tokens (padding included) makes 3 or 4 micro-batches of 1 to 3 sequences a step on each rank
    # (seen), other groupings than one process's 2 x 8. (40 put every sequence in a micro-batch of its own: 8 forwards
    # a step on each rank, the same claim at ~2-3x the time of these runs.)
    for family in TRANSFORMERS_FAMILIES:
        # Plain random weights: the runs compare the model with itself summed in another grouping; peaked attention
        # (the equality tests' fixtures) would amplify rounding near softmax transitions past the bound below.
        src = make_family_dir(family, tmp_path / family / "model", peaked=False)
        one, two = (_split_config(tmp_path / family / name, src, size) for name, size in (("one", 4), ("two", 2)))
        runs.append(Run(two_processes=str(two), one_process=str(one)))
        budget = _split_config(tmp_path / family / "budget", src, 2, max_tokens_per_micro_batch=80)
        runs.append(Run(two_processes=str(budget)))
    # Mixture-of-experts families (transformers' modules): random attention as above, but decisive routers (top-k
    # logit gaps >= 1e-3, far above the regrouping's rounding), so both groupings route every token alike. Qwen3-MoE
    # also with micro-batches from a token budget. SGD lr 0.005: these fixtures' gradients are ~10x the dense ones'
    # (at lr 0.05 Qwen3.5-MoE's conv1d weights moved 0.5 in two steps, as much as their own size), while the bound
    # below is derived for updates of ~0.05 (lr 0.005 moves them by 0.03).
    moe_sgd = {"optimizer": {"_component_": "torch.optim.SGD", "lr": 0.005}}
    for family in MOE_FAMILY_NAMES:
        src = make_family_dir(family, tmp_path / family / "model", peaked=False, router_gain=ROUTER_GAIN)
        one, two = (_split_config(tmp_path / family / name, src, size, **moe_sgd)
                    for name, size in (("one", 4), ("two", 2)))
        runs.append(Run(two_processes=str(two), one_process=str(one)))
        if family == "qwen3_moe":
            budget = _split_config(tmp_path / family / "budget", src, 2, max_tokens_per_micro_batch=80, **moe_sgd)
            runs.append(Run(two_processes=str(budget)))
            # Routing replay with both router losses on: scripted engine routes forced in every forward, the
            # load-balance fractions summed over the ranks, both losses token means over the global count.
            replay = (_split_config(tmp_path / "replay_qwen3_moe" / name, src, size, **moe_sgd, **REPLAY)
                      for name, size in (("one", 4), ("two", 2)))
            one, two = replay
            runs.append(Run(two_processes=str(two), one_process=str(one)))
    # An update switch (docs/gpu.md), selective activation checkpointing, on one process and on two, on a torchtune
    # model and on a transformers one.
    for name, arch in SWITCH_RUNS.items():
        src = (make_family_dir(arch, tmp_path / name / "model", peaked=False) if arch in TRANSFORMERS_FAMILIES
               else make_model_dir(tmp_path / name / "model", arch))
        one, two = (_split_config(tmp_path / name / run, src, size, **SWITCHES) for run, size in (("one", 4), ("two", 2)))
        runs.append(Run(two_processes=str(two), one_process=str(one)))
    # LoRA on transformers' own module, two processes (adapters sharded with their decoder layer).
    lora_src = make_family_dir("gemma3_text", tmp_path / "lora_gemma3" / "model", peaked=False)
    lora = _split_config(tmp_path / "lora_gemma3" / "two", lora_src, 2, model={
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "lora_rank": 4, "lora_alpha": 8,
    }, base=LORA_CONFIG)
    runs.append(Run(two_processes=str(lora), lora=True))
    # Attention LoRA on a mixture of experts, two processes: each FSDP2 unit holds trainable adapters next to the
    # frozen fused experts and router; with routing replay and both router losses (the reference is the policy with
    # its adapters off: the routes are forced there too).
    moe_lora_src = make_family_dir("qwen3_moe", tmp_path / "lora_qwen3_moe" / "model", peaked=False)
    moe_lora = _split_config(tmp_path / "lora_qwen3_moe" / "two", moe_lora_src, 2, model={
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "lora_rank": 4, "lora_alpha": 8,
    }, base=LORA_CONFIG, **REPLAY)
    runs.append(Run(two_processes=str(moe_lora), lora=True))
    # Image prompts (tests/test_vision_recipe.py): tiny Gemma 3, Qwen3.5 (M-RoPE) and Gemma 4 (per-layer inputs, its
    # layer_scalar buffers) image directories, one process and two, the tower frozen; then train_vision (Gemma 3's
    # projector, Qwen3.5's tower: FSDP2 units of their own), and Gemma 3's resumed on two processes.
    runs.extend(image_split_runs(tmp_path / "images"))
    # The LoRA recipe with Qwen3.5's tower trained (tests/test_vision_lora.py), on image_split_runs' files.
    runs.extend(lora_image_split_runs(tmp_path / "images"))
    # One launch (tests/_spawn_runs.py): the spawned processes are judged by their exit codes (0 only after the last
    # run; a rank that failed raises here with its traceback and stops the other).
    launch(runs)

    for arch in archs:
        src, one, two = (tmp_path / arch / name for name in ("model", "one", "two"))
        start, expected, got = weights(src), weights(one / "out" / "step_2"), weights(two / "out" / "step_2")
        assert got.keys() == expected.keys() == start.keys(), arch
        moved = max((expected[k] - start[k]).abs().max().item() for k in start)
        assert moved > 1e-3, f"{arch}: two steps barely moved the weights ({moved})"
        # One process and two compute each step's gradient as the same sum of per-token terms in another grouping
        # (micro-batches of 4 or 2 rows, the ranks' gloo all-reduce): ~sqrt(n) ulp of each sum (tests/tolerances.py),
        # ~1e-7 relative at these random models' scale; SGD (lr 0.05, no clipping) moves the weights by lr x that, ~1e-8
        # per step, plus one rounding of each weight (ulp 7.5e-9 at 0.1), over 2 steps. Bound: 1e-5 on the weights (>
        # 100x that); 1e-5 absolute on the logged loss and kl (the same regrouped fp32 sums, ~1e-6 at O(1)); rewards and
        # lengths are exact.
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{arch}, {key}: {m}")
        # The logged global metrics agree too (sums over micro-batches and ranks).
        rows = [read_jsonl(run / "out" / "metrics.jsonl") for run in (one, two)]
        assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [1, 2], arch
        for m1, m2 in zip(*rows):
            for key in ("loss", "kl", "reward/mean", "response_length/mean"):
                assert m2[key] == pytest.approx(m1[key], abs=1e-5), (arch, m1["step"], key)
        # What rank 0 saved from the two-process run is a Hugging Face model with our model's logits.
        check_trained_directory(src, two / "out" / "step_2", tmp_path / arch)

    for family in (*TRANSFORMERS_FAMILIES, *MOE_FAMILY_NAMES):
        src, one = tmp_path / family / "model", tmp_path / family / "one"
        expected, start = weights(one / "out" / "step_2"), weights(src)
        assert max((expected[k] - start[k]).abs().max().item() for k in start) > 1e-3, family
        if family in MOE_FAMILY_NAMES:  # the experts trained, on each rank's shard of them
            assert max((expected[k] - start[k]).abs().max().item() for k in start if "experts" in k) > 1e-4, family
        for run in ("two", "budget") if (tmp_path / family / "budget").is_dir() else ("two",):
            got = weights(tmp_path / family / run / "out" / "step_2")
            assert got.keys() == expected.keys(), (family, run)
            # As for the torchtune architectures above (the same sums regrouped by micro-batch and rank). Bound 1e-5.
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{family} {run} {key}: {m}")
            rows = [read_jsonl(r / "out" / "metrics.jsonl") for r in (one, tmp_path / family / run)]
            for m1, m2 in zip(*rows):
                for key in ("loss", "kl", "reward/mean"):
                    # As above, but these models' step-2 KL reaches ~4 (the first SGD step moves them far): each
                    # token's k3 = e^d - d - 1 carries d's few-ulp rounding (logits regrouped by micro-batch shape)
                    # times e^d (d up to ~3), ~20x: 64 ulp of the value, or 1e-5 at O(1). In the shared-prompt
                    # layout (Gemma 3 and the MoE families here) the regrouping also changes each row's width
                    # (P + G x C over the micro-batch's groups) and the attention's key set, so d's rounding is a
                    # few ulp of the logits (|z| <= 32: ulp 3.8e-6), not of d: per token |e^d - 1| (<= 19) x 2
                    # (reference and policy) x 4 ulp = 5.8e-4 at worst; the KL is the mean over the step's
                    # response tokens (16 sequences x ~12 = ~190 here), whose errors of random sign average down by
                    # ~sqrt(190) = 14: 4e-5; bound 1e-4.
                    bound = max(1e-5, ulps(torch.tensor(m1[key]), 64), 1e-4 if key == "kl" else 0.0)
                    assert m2[key] == pytest.approx(m1[key], abs=bound), (family, run, m1["step"], key)

    # Replay: one process equals two (the bound and its derivation as for the MoE families above), the router
    # metrics too, and the forced routes and router losses changed the training (the same run without them differs).
    replay = tmp_path / "replay_qwen3_moe"
    expected, got = weights(replay / "one" / "out" / "step_2"), weights(replay / "two" / "out" / "step_2")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=lambda m: f"replay {key}: {m}")
    plain = weights(tmp_path / "qwen3_moe" / "one" / "out" / "step_2")
    assert max((expected[k] - plain[k]).abs().max().item() for k in plain if ".gate." in k) > 1e-4
    rows = [[r for r in read_jsonl(replay / run / "out" / "metrics.jsonl") if "loss" in r] for run in ("one", "two")]
    assert [r["step"] for r in rows[1]] == [1, 2]
    for m1, m2 in zip(*rows):
        # The scripted routes are not the routers' own: agreement well below 1, and the same count on both.
        assert m1["moe/router_agreement"] < 0.9 and m2["moe/router_agreement"] == pytest.approx(
            m1["moe/router_agreement"], abs=1e-6)  # a ratio of exact integer counts; 1e-6 covers the division
        for key in ("loss", "moe/load_balance_loss", "moe/z_loss"):
            bound = max(1e-5, ulps(torch.tensor(m1[key]), 64))  # as for the MoE families' metrics above
            assert m2[key] == pytest.approx(m1[key], abs=bound), (m1["step"], key)

    for name in SWITCH_RUNS:
        expected, start = weights(tmp_path / name / "one" / "out" / "step_2"), weights(tmp_path / name / "model")
        got = weights(tmp_path / name / "two" / "out" / "step_2")
        assert max((expected[k] - start[k]).abs().max().item() for k in start) > 1e-3, name
        # As above (checkpointing recomputes the same operations in the same order). Bound 1e-5 on the weights.
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{name} {key}: {m}")

    lora_step = tmp_path / "lora_gemma3" / "two" / "out" / "step_2"
    adapter = torch.load(lora_step / "adapter_model.pt", weights_only=True)
    assert adapter and all(k.startswith("model.layers.") for k in adapter)  # transformers' names
    assert all(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_b.weight"))
    merged, base = weights(lora_step / "merged"), weights(tmp_path / "lora_gemma3" / "model")
    assert merged.keys() == base.keys() and any(not torch.equal(merged[k], base[k]) for k in base)

    moe_step = tmp_path / "lora_qwen3_moe" / "two" / "out" / "step_2"
    adapter = torch.load(moe_step / "adapter_model.pt", weights_only=True)
    assert adapter and all(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_b.weight"))
    merged, base = weights(moe_step / "merged"), weights(tmp_path / "lora_qwen3_moe" / "model")
    assert merged.keys() == base.keys()  # the per-expert on-disk names
    assert all(torch.equal(merged[k], base[k]) for k in base if "experts" in k or ".gate." in k)  # frozen
    assert any(not torch.equal(merged[k], base[k]) for k in base if "self_attn" in k)
    lora_rows = [r for r in read_jsonl(moe_step.parent / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lora_rows] == [1, 2]
    assert all(r["moe/router_agreement"] < 0.9 and r["moe/load_balance_loss"] > 0 for r in lora_rows)  # replayed

    check_image_split(tmp_path / "images")
    check_lora_image_split(tmp_path / "images")

    step = tmp_path / "qlora" / "two" / "out" / "step_2"
    assert [r["step"] for r in read_jsonl(step.parent / "metrics.jsonl")] == [1, 2]
    adapter = torch.load(step / "adapter_model.pt", weights_only=True)
    assert all(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_b.weight"))  # B started at 0
    check_trained_directory(qlora_src, step / "merged", tmp_path / "qlora")
