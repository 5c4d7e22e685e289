"""The pure pieces of benchmarks/grpo_vs_trl.py (the benchmark itself is too slow for CI; TRL is not imported).

Both trainers must start from the same weights and see the same prompt tokens: the workload builder writes
one Hugging Face checkpoint that torchtune's checkpointer (our recipe) and ``transformers`` (TRL) both
load, and the prompts as text that the Hugging Face tokenizer turns back into exactly our token ids.
"""

import copy
import json

import pytest
import torch

from tests.conftest import load_benchmark

bench = load_benchmark("grpo_vs_trl")


def _small(name):
    spec = copy.deepcopy(bench.WORKLOADS[name])
    if name == "llama100m":  # same family and conversions, shrunk for a fast test
        spec["model"].update(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, intermediate_dim=128, vocab_size=700)
    return spec


@pytest.mark.parametrize("name", ["tiny", "llama100m"])
def test_workload_gives_both_trainers_the_same_weights_and_prompts(name, tmp_path):
    from torchtune.training import FullModelHFCheckpointer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = _small(name)
    wdir = bench.build_workload(name, tmp_path / name, spec)
    # Ours: the recipe's loading path (torchtune's HF checkpointer -> torchtune model).
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(wdir),
        checkpoint_files=["model.safetensors"],
        model_type=bench.checkpointer_model_type(spec),
        output_dir=str(tmp_path / "out"),
    )
    ours = bench.build_tune_model(spec)
    ours.load_state_dict(checkpointer.load_checkpoint()["model"])
    # TRL's: transformers from the same directory.
    theirs = AutoModelForCausalLM.from_pretrained(str(wdir), dtype=torch.float32)
    tokens = torch.randint(0, 500, (2, 40))
    with torch.no_grad():
        # transformers against torchtune on the same weights (as tests/test_models.py): other op orders in every matmul,
        # norm and attention and each library's RoPE tables (40 positions: angles <= 40 rad, 1 ulp 3.8e-6), a few ulp of
        # the logits plus <~ 1e-5 relative from the rope angles. Bound: 1e-4 + 1e-4 relative.
        torch.testing.assert_close(ours.eval()(tokens), theirs.eval()(tokens).logits, rtol=1e-4, atol=1e-4)

    tokenizer = AutoTokenizer.from_pretrained(str(wdir))
    rows = bench.read_prompts(wdir)
    assert len(rows) == bench.NUM_PROMPTS
    for row in rows[:8]:
        assert tokenizer(row["prompt"])["input_ids"] == row["tokens"]
    generation = json.loads((wdir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == bench.STOP_TOKENS


def test_recipe_config_is_valid_for_the_recipe(tmp_path):
    from omegaconf import OmegaConf

    from torchtune_grpo.config import validate_config

    cfg = bench.recipe_config(tmp_path, tmp_path / "out", bench.WORKLOADS["tiny"], steps=3)
    validate_config(OmegaConf.create(cfg))
    assert cfg["kl_coef"] == 0.0 and cfg["micro_batch_size"] == 32 and cfg["shuffle"] is False


def test_summary_excludes_the_warmup_step_and_takes_medians():
    run = {
        "start": 0.0, "ends": [10.0, 11.0, 13.0, 14.0], "cpu_ends": [5.0, 6.0, 7.0, 8.0],
        "tokens": [100.0, 100.0, 100.0, 100.0], "completion_tokens": [40.0] * 4,
        "peak_rss": 2**30, "rss_train_peak": 2**29, "rss_train_start": 2**28, "wall": 20.0,
    }
    summary = bench.summarize([run])
    assert summary["steps_measured"] == 3
    assert summary["step_time_median_s"] == 1.0  # intervals 1, 2, 1; the 10 s first step is excluded
    assert summary["tokens_per_s"] == 100.0
    assert summary["peak_rss_gib"] == 1.0


def test_longtail_benchmark_runs_and_reports(monkeypatch, capsys):
    # benchmarks/longtail.py on a tiny workload: every table printed, padding fractions in range, and the
    # compacting decode samples the same tokens as the plain loop.
    longtail = load_benchmark("longtail")
    argv = ["longtail.py", "--groups", "2", "--group-size", "4", "--max-len", "48", "--rows", "4", "--repeats", "1"]
    monkeypatch.setattr("sys.argv", argv)
    threads = torch.get_num_threads()
    try:
        longtail.main()
    finally:
        torch.set_num_threads(threads)  # main() sets its own
    out = capsys.readouterr().out
    assert "| packed rows | <= " in out and "| shared prompts | <= " in out
    assert "same tokens: True" in out and "| compact_decode |" in out
    paddings = [float(line.split("|")[5].strip().rstrip("%")) for line in out.splitlines() if line.endswith("|")
                and "%" in line]
    assert len(paddings) == 5 and all(0 <= p < 100 for p in paddings)


def test_decode_steps_benchmark_compares_what_it_says():
    # benchmarks/hf_decode_steps.py, 60 steps: its baseline really decodes on transformers' window layers, and
    # neither saving changes a logit (the benchmark reports both; the seconds are its business).
    steps = load_benchmark("hf_decode_steps")
    window = steps.measure("window", steps=60, rounds=1)
    assert window["first_cache_layer"] == {"without": "DynamicSlidingWindowLayer", "with": "GrowingWindowLayer"}
    masks = steps.measure("masks", steps=60, rounds=1)
    assert window["logits_equal"] == masks["logits_equal"] == [True]
    assert all(s > 0 for r in (window, masks) for side in r["seconds"].values() for s in side)
