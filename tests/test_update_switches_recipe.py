"""The update's switches in the recipe (docs/gpu.md, "The update switches"): every one on at once, the
policy's layers checkpointed as asked, each phase of the step timed apart, and the compiled layers compiled
once for every micro-batch length (dynamic shapes). What each switch computes: tests/test_update_switches.py.
"""

import torch
from omegaconf import OmegaConf

from tests.recipe_utils import read_jsonl, recipe_in_process, write_config


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
