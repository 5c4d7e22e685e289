"""Routing replay in the recipe: a gpt-oss policy (transformers' module) sampled by a bf16 transformers engine,
``moe.routing_replay: rollout``, through a generation worker (routes pickled with the rollouts) and through a
checkpoint (the rollouts in flight, routes included, saved and restored): resume equals the uninterrupted run,
and the router metrics and the algorithm card say what ran."""

import math
import shutil

import pytest
import torch

from tests.hf_families import make_family_dir
from tests.hf_models import hf_components
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # Router gain 1 (an unscaled random router): bf16 rounding flips some of its choices, as in real models.
    return make_family_dir("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "model", router_gain=1.0)


def _config(run_dir, src, **overrides):
    engine = {"_component_": "torchtune_grpo.generation.TransformersGenerator", "model": str(src), "dtype": "bfloat16"}
    return write_config(
        run_dir, **hf_components(src), generation=engine, lr_scheduler=None, **{"optimizer.lr": 1e-3},
        moe={"routing_replay": "rollout", "load_balance_coef": 0.01, "z_loss_coef": 0.001},
        generation_workers={"enabled": True, "max_staleness": 1}, **overrides,
    )


def _rows(run_dir):
    return [r for r in read_jsonl(run_dir / "out" / "metrics.jsonl") if "loss" in r]


def test_replay_through_a_worker_and_a_checkpoint_equals_the_uninterrupted_run(moe_dir, tmp_path, clean_env,
                                                                             one_thread):
    config = _config(tmp_path, moe_dir, max_steps=2, save_every_n_steps=1)
    run_in_process(config)
    out = tmp_path / "out"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    uninterrupted = weights(out / "step_2")
    shutil.rmtree(out / "step_2")  # resume from step 1's checkpoint, the worker's batch in flight restored
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()[:1]))
    run_in_process(_config(tmp_path, moe_dir, max_steps=2, save_every_n_steps=1, resume_from_checkpoint=True))
    # Exact: the in-flight batch (its routes included: replay refuses rollouts without them) came back unchanged.
    resumed = weights(out / "step_2")
    assert uninterrupted.keys() == resumed.keys() and all(torch.equal(uninterrupted[k], resumed[k]) for k in resumed)
    assert rows[1]["loss"] == _rows(tmp_path)[-1]["loss"]
    for r in rows:
        # The trainer's own top-k vs the bf16 engine's: mostly equal, not always (what replay overrides).
        assert 0.5 < r["moe/router_agreement"] <= 1.0
        assert r["moe/expert_load_max_over_mean"] >= 1.0
        assert r["moe/load_balance_loss"] > 0 and r["moe/z_loss"] > 0
        assert math.isfinite(r["generation/logprob_mismatch"])
    # The worker's behaviour logprobs force the same routes as the trainer: with the same weights (the first
    # batch, version 0) they differ from the trainer's pi_old only by the rounding of another forward grouping:
    # a few fp32 ulps of logprobs of magnitude < 8 (8 ulps = 8 * 1.2e-7 * 8 < 1e-5; a routing flip moves a token
    # by ~1e-2). One step off they differ by the update.
    assert rows[0]["generation/logprob_mismatch"] < 1e-5 < rows[1]["generation/logprob_mismatch"]
    assert any(r["moe/router_agreement"] < 1.0 for r in rows)
    card = (out / "algorithm_card.md").read_text()
    assert "routing replay rollout" in card and "0.01 * LB + 0.001 * Z" in card
