"""CPU checks of benchmarks/gpu_grpo.py (the CUDA benchmark): its arithmetic and a tiny end-to-end run.

No timing is asserted: the benchmark measures, the tests only check that what it counts is right and that
every part runs (on CPU, with the tiny model) so the script is ready when a GPU is.
"""

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from torchtune.models.qwen2 import qwen2

from tests.conftest import load_benchmark

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_grpo.py"


gg = load_benchmark("gpu_grpo", "gpu_grpo_under_test")


def _model(tied: bool):
    # 2 layers, embed 64, 4 heads of 16, 2 KV heads, vocab 100, MLP 128.
    return qwen2(vocab_size=100, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                 intermediate_dim=128, max_seq_len=64, tie_word_embeddings=tied)


def test_kv_bytes_per_token():
    # 2 layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes (fp32) = 512.
    assert gg.kv_bytes_per_token(_model(True)) == 2 * 2 * 2 * 16 * 4


def test_weight_bytes_and_flop_params_tied_vs_untied():
    tied, untied = _model(True), _model(False)
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    emb = 100 * 64
    assert n_untied == n_tied + emb  # the separate output projection
    # Tied: the embedding matrix is the output projection, read whole every step, and multiplied with.
    assert gg.weight_bytes_per_decode_step(tied, rows=3) == 4 * n_tied
    assert gg.flop_params(tied) == n_tied
    # Untied: the input embedding is a lookup of `rows` rows, and no matrix product.
    assert gg.weight_bytes_per_decode_step(untied, rows=3) == 4 * (n_untied - emb + 3 * 64)
    assert gg.flop_params(untied) == n_untied - emb


def test_decode_bound():
    # 1 GB of weights, 1 kB of KV per token, 10 rows, prompt 100 + 200 new (mean context 200) at 1 TB/s:
    # a step reads 1e9 + 10 * 200 * 1e3 = 1.002e9 bytes = 1.002 ms, so 10 / 1.002e-3 tokens/s.
    bound = gg.decode_bound_tokens_per_s(10**9, 1000, 10, 100, 200, 1e12)
    # float64 arithmetic on exact integers and 1e12 (a few roundings, 1e-16 relative): approx's default 1e-6 relative.
    assert bound == pytest.approx(10 / 1.002e-3)


def test_token_counts_and_reward():
    assert gg.count_tokens([[1, 2, 3], [4]], [[5, 6], []]) == 6
    # fractions of even ids: [2, 3, 4] -> 2/3, [1] -> 0, [] -> 0
    # 2 / 3 as one float64 (or fp32: 3e-8 relative) rounding: approx's default 1e-6 relative.
    assert gg.even_token_reward([[2, 3, 4], [1], []]) == [pytest.approx(2 / 3), 0.0, 0.0]
    prompts = gg.random_prompts(20, 3, 5, 10, avoid=[8, 9], seed=0)
    assert all(3 <= len(p) <= 5 and not {8, 9} & set(p) for p in prompts)
    assert gg.special_ids(151936) == (151643, 151645)
    assert gg.special_ids(512) == (510, 511)


def test_synthetic_components():
    tok = gg.SyntheticTokenizer(vocab_size=512)
    assert tok.decode([5, 7]) == "5 7" and tok.encode("5 7") == [5, 7]
    data = gg.synthetic_prompt_dataset(tok, num_samples=6, min_len=4, max_len=6, vocab_size=512)
    assert len(data) == 6 and all(4 <= len(d["tokens"]) <= 6 for d in data)
    state = gg.RandomCheckpointer(f"{gg.__name__}._tiny_builder", output_dir="/tmp/unused").load_checkpoint()["model"]
    model = gg._tiny_builder()
    assert model.load_state_dict(state, strict=True) is not None
    assert all(v.dtype == torch.bfloat16 for v in state.values())


@pytest.mark.slow
def test_tiny_end_to_end_on_cpu(tmp_path, clean_env, one_thread, monkeypatch):
    """Every CPU-runnable part, tiny model: decode (eager), the GRPO step, and the real recipe class.

    In process, through the script's ``main`` (what its command line runs): its process-wide settings are
    restored afterwards (dynamo's recompile limits by hand: ``monkeypatch`` cannot undo a dynamo config
    alias; the recipe's temporary directory by ``monkeypatch``).
    """
    limits = {name: getattr(torch._dynamo.config, name)
              for name in ("recompile_limit", "cache_size_limit") if hasattr(torch._dynamo.config, name)}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "r.json"
    try:
        gg.main(["--device", "cpu", "--tiny", "--models", "tiny", "--parts", "decode", "grpo", "recipe",
                 "--decode-compile", "off", "--json", str(out)])
    finally:
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    r = json.loads(out.read_text())
    assert r["errors"] == []
    assert [d["rows"] for d in r["decode"]] == [1, 8] and all(d["decode_tokens_per_s"] > 0 for d in r["decode"])
    (grpo,) = r["grpo"]
    m = grpo["median"]
    # --tiny: 4 prompts x G 4, prompts of 8..16 tokens, at most 12 new tokens each.
    assert grpo["rows"] == 16
    assert 16 * 8 + 1 <= m["tokens"] <= 16 * (16 + 12)
    assert m["response_tokens"] <= 16 * 12
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    (rec,) = r["recipe"]
    assert rec["steps"] == 2 and rec["median"]["tokens_per_second"] > 0
