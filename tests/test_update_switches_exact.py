"""The update switches that change no number (docs/gpu.md, "The update switches"): activation checkpointing
(every layer, every 2nd) and compiled layers (``aot_eager`` on CPU) give the eager, checkpoint-free model's
logprobs, entropies and gradients bit for bit, in the shared-prompt and the packed layouts; and the recipe
with every switch on: the policy's layers checkpointed as asked, each phase timed apart, the compiled layers
compiled once for every micro-batch length (dynamic shapes). The bf16 head, which changes numbers:
tests/test_update_switches.py.
"""

import pytest
import torch
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from tests.recipe_utils import read_jsonl, recipe_in_process, write_config
from tests.test_update_switches import groups_of_rows, tiny_with
from torchtune_grpo.models.compiled import compile_seconds
from torchtune_grpo.training.batch import TrainingBatch


@pytest.mark.parametrize("switch", ["selective_ac", "all_ac", "compiled"])
def test_checkpointing_and_compiling_change_no_number(switch):
    # Recomputation repeats the same operations, and aot_eager runs the traced aten graph with the same CPU
    # kernels: logprobs, entropies and every gradient equal the plain model's exactly, in both layouts.
    torch._dynamo.reset()  # compile here, whatever ran before: the compiled path must really run
    counters.clear()
    compiled_before = compile_seconds()
    for layout in (dict(share_prompt=True), dict(share_prompt=False, pack=True)):
        prompts, responses = groups_of_rows(seed=2)
        batch = TrainingBatch(prompts, responses, pad_id=0, **layout)
        results = []
        for model in (tiny_with("none"), tiny_with(switch)):
            out = batch.logprobs(model, slice(0, len(batch)), with_entropy=True)
            with torch.enable_grad():
                out.logprobs.sum().backward()  # through backward: a checkpointed layer recomputes here
            results.append((out, {k: p.grad.clone() for k, p in model.named_parameters()}))
        (a, ga), (b, gb) = results
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)
        assert len(ga) == len(gb) and all(torch.equal(ga[k.replace("_checkpoint_wrapped_module.", "")], v)
                                          for k, v in gb.items())
    assert (compile_seconds() > compiled_before) == (switch == "compiled")
    # One graph per layout, every layer's: the packed layout's dense mask is built before the layers run
    # (AttentionLayout.prepare); built in the first compiled layer, it made the second recompile (3 graphs).
    assert counters["stats"]["unique_graphs"] == (2 if switch == "compiled" else 0)


def test_recipe_times_each_phase_and_compiles_once_across_lengths(tmp_path, clean_env, one_thread):
    # Every switch on in the recipe: the policy's layers are checkpointed as asked, the phases are timed apart,
    # and the compiled layers compile in step 1 only: step 2's micro-batches have other lengths (dynamic shapes).
    torch._dynamo.reset()  # whatever compiled before in this process: step 1 compiles here
    cfg = OmegaConf.load(write_config(
        tmp_path, max_steps=2, save_every_n_steps=None, kl_coef=0.04, logprob_head="bf16", tf32=True,
        activation_checkpointing="selective", activation_checkpointing_every=2, compile_training="aot_eager"))
    with recipe_in_process(cfg) as recipe:
        assert [type(layer).__name__ for layer in recipe.model.layers] == ["TransformerSelfAttentionLayer",
                                                                           "CheckpointWrapper"]
        recipe.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    first, second = rows[0], rows[1]
    assert first["time/compile"] > 0 and second["time/compile"] == 0.0
    assert first["response_length/mean"] != second["response_length/mean"]  # other lengths, no recompile
    for r in rows:
        assert r["time/reference"] > 0 and r["time/update"] > 0 and r["time/old_logprobs"] >= 0
        # experience (reference + old logprobs + layout + advantages) and update are parts of time/train
        assert r["time/reference"] + r["time/old_logprobs"] <= r["time/experience"]
        assert r["time/experience"] + r["time/update"] <= r["time/train"]
