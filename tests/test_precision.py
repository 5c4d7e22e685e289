"""Training precision (torchtune_grpo/runtime/precision.py): `dtype: bf16` keeps fp32 master weights and computes in bf16,
`dtype: bf16_pure` keeps bf16 weights. In-process recipe runs on the tiny model (one process, where bf16 mixed
precision goes through FSDP2 as on N processes; CPU has bf16 matmuls).
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipe_utils import read_jsonl, recipe_in_process, write_config
from torchtune_grpo.runtime.precision import PRECISIONS, Precision


def _weights(model):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
        for k, v in model.state_dict().items()
    }


def _run(tmp_path: Path, dtype: str, steps: int, **overrides):
    """Train ``steps`` steps; returns (weights before, weights after, metrics, the policy's weight dtypes)."""
    tmp_path.mkdir(parents=True)
    cfg = OmegaConf.load(write_config(tmp_path, max_steps=steps, save_every_n_steps=None, dtype=dtype, **overrides))
    with recipe_in_process(cfg) as recipe:
        dtypes = {p.dtype for p in recipe.model.parameters()}
        before = _weights(recipe.model)
        recipe.train()
        after = _weights(recipe.model)
    return before, after, read_jsonl(tmp_path / "out" / "metrics.jsonl"), dtypes


def test_precision_names_and_memory():
    assert Precision.from_name("bf16").mixed and not Precision.from_name("bf16_pure").mixed
    assert Precision.from_name("bf16").param_dtype == torch.float32
    assert Precision.from_name("bf16").compute_dtype == torch.bfloat16
    # AdamW: weight + gradient + 2 moments = 4 + 4 + 8 bytes in fp32, half of it in bf16
    assert {n: p.bytes_per_param for n, p in PRECISIONS.items()} == {"fp32": 16, "bf16": 16, "bf16_pure": 8}
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'bf16_pure', 'fp32'\], got 'fp16'"):
        Precision.from_name("fp16")


@pytest.mark.slow
def test_lr_1e6_moves_every_weight_only_with_fp32_master_weights(tmp_path, clean_env, one_thread):
    # One AdamW step at lr 1e-6 moves each weight with a gradient by about 1e-6. The tiny model's weights
    # are ~0.02, where bf16's spacing is 2^-6 * 2^-7 ~ 1.2e-4 (fp32's: ~1.9e-9): bf16 weights round the
    # update away, fp32 master weights keep it.
    settings = {"optimizer.lr": 1e-6, "lr_scheduler": None}
    before, after, _, dtypes = _run(tmp_path / "mixed", "bf16", 1, **settings)
    assert dtypes == {torch.float32}  # master weights
    card = (tmp_path / "mixed" / "out" / "algorithm_card.md").read_text()
    assert "- Precision: bf16: fp32 master weights and AdamW state, transformer layers computed in bf16" in card
    changed = {k: (after[k] != before[k]).float().mean().item() for k in before}
    assert min(changed.values()) > 0.95, sorted(changed.items(), key=lambda kv: kv[1])[:3]
    before, after, _, dtypes = _run(tmp_path / "pure", "bf16_pure", 1, **settings)
    assert dtypes == {torch.bfloat16}
    changed = torch.tensor([(after[k] != before[k]).float().mean().item() for k in before])
    assert changed.mean() < 0.1, changed  # about 2% move: those within half a spacing of a rounding point


@pytest.mark.slow
def test_bf16_compute_tracks_fp32(tmp_path, clean_env, one_thread):
    # The same scripted rollouts (tests/_engines.py: completions are a function of the prompt), so the
    # runs differ only in precision. Over 3 AdamW steps (lr 1e-3) the bf16-compute run's loss and KL stay
    # within a few percent of the fp32 run's, and its weights move like fp32's.
    settings = {
        "generation": {"_component_": "tests._engines.ScriptedGenerator"},
        "reward_functions": [{"_component_": "tests._rewards.EvenTokenReward"}],
        "kl_coef": 0.05,
    }
    b32, a32, m32, _ = _run(tmp_path / "fp32", "fp32", 3, **settings)
    b16, a16, m16, _ = _run(tmp_path / "bf16", "bf16", 3, **settings)
    for x, y in zip(m32, m16):
        assert abs(y["policy_loss"] - x["policy_loss"]) <= 0.05 * abs(x["policy_loss"]) + 1e-3, (x["step"], x, y)
        # bf16 against fp32 (as in tests/test_gpu.py's twin): a precision difference, not an order one. bf16 keeps 8
        # significant bits (unit roundoff 2^-9 = 2e-3 per operation), ~1e-2 absolute on logprobs of a few units after
        # the layers; the loss and entropy are means over the step's tokens, where those errors of random sign
        # average down; the KL is a small difference of policy and reference log-ratios after 3 steps, so the same
        # absolute bf16 error is a larger share of it. Bounds: policy loss 5% (+1e-3 near 0), entropy 2%, KL 10%; the
        # CPU's bf16 path is oneDNN's (AVX-512 BF16, or emulated: ONEDNN_MAX_CPU_ISA with ATEN_CPU_CAPABILITY).
        assert y["entropy"] == pytest.approx(x["entropy"], rel=0.02)
    assert m32[-1]["kl"] > 0 and m16[-1]["kl"] == pytest.approx(m32[-1]["kl"], rel=0.1)
    cos = {}
    for k in b32:
        step32, step16 = a32[k] - b32[k], a16[k] - b16[k]
        cos[k] = torch.nn.functional.cosine_similarity(step32.flatten(), step16.flatten(), dim=0).item()
    # k_proj's bias shifts every score of a query by the same amount, which softmax ignores: its gradient
    # is numerical noise in any precision, so its direction is not compared.
    worst = min((v, k) for k, v in cos.items() if not k.endswith("k_proj.bias"))
    assert worst[0] > 0.9, worst
