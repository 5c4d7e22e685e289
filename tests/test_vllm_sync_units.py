"""The pure pieces around the vLLM engine (no vLLM needed): weight names, the sync check, TIS.

Expected values are worked out by hand in the comments.
"""

import math

import pytest
import torch
from torchtune.models.convert_weights import hf_to_tune
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune

from torchtune_grpo.generation import TuneToHFNames, VLLMGenerator, WeightSyncCheck, WeightSyncError
from torchtune_grpo.assets import asset_path
from torchtune_grpo.loss import GRPOLoss
from torchtune_grpo.models import tune_to_hf_param
from torchtune_grpo.loss.rollout_correction import logprob_mismatch_sum, tis_weights
from torchtune_grpo.training.batch import response_values

from tests.recipe_utils import run_script_expecting
from tests.tolerances import ulps

LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16}
QWEN2 = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16}


def _hf_llama_state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head_dim = 16 // 4
    return {
        "model.embed_tokens.weight": torch.randn(10, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4 * head_dim, 16, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2 * head_dim, 16, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(2 * head_dim, 16, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(32, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def test_llama_names_and_rope_order_round_trip_through_torchtune():
    # torchtune permutes q/k rows when reading HF Llama weights; going back must undo it exactly, one
    # parameter at a time (the recipe streams them).
    hf = _hf_llama_state()
    tune = hf_to_tune(hf, num_heads=4, num_kv_heads=2, dim=16)
    to_hf = TuneToHFNames(LLAMA)
    back = dict(to_hf(name, t) for name, t in tune.items())
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    # ... and the permutation is not the identity (a missing one would be caught here).
    q = "layers.0.attn.q_proj.weight"
    assert not torch.equal(tune[q], hf["model.layers.0.self_attn.q_proj.weight"])


def test_qwen2_names_only():
    hf = {
        "model.layers.1.self_attn.q_proj.bias": torch.arange(4.0),
        "model.layers.1.mlp.down_proj.weight": torch.ones(2, 3),
        "model.norm.weight": torch.ones(3),
    }
    tune = qwen2_hf_to_tune(hf, num_heads=4, num_kv_heads=2, dim=16)
    back = dict(TuneToHFNames(QWEN2)(k, v) for k, v in tune.items())
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_unsupported_model_type_is_named_for_torchtune_names_and_hf_names_pass_through():
    names = TuneToHFNames({**QWEN2, "model_type": "gemma2"})
    with pytest.raises(ValueError, match="model_type 'gemma2'"):
        names("layers.0.attn.q_proj.weight", torch.zeros(2, 2))
    # A transformers policy's parameters already carry Hugging Face's names.
    w = torch.randn(4, 4)
    assert names("model.layers.0.self_attn.q_proj.weight", w) == ("model.layers.0.self_attn.q_proj.weight", w)
    assert names("lm_head.weight", w)[0] == "lm_head.weight"


def test_vllm_component_builds_without_vllm_and_validates():
    # Built by every config test: no engine starts and vLLM is not imported until first use.
    engine = VLLMGenerator(model=asset_path("tiny_qwen2"), temperature=0.7, dtype="fp32")
    assert engine.holds_weights and engine.temperature == 0.7 and engine.dtype == "float32"
    assert engine.vocab_size == 512 and engine._llm is None
    with pytest.raises(ValueError, match="top_p"):
        VLLMGenerator(model=asset_path("tiny_qwen2"), top_p=0.0)
    # A config pointing at a model not downloaded yet still builds; the first use names the problem.
    missing = VLLMGenerator(model="/nonexistent/model/dir")
    with pytest.raises(FileNotFoundError, match="config.json"):
        missing.vocab_size


def test_weight_sync_check_schedule_probe_and_verdict():
    check = WeightSyncCheck(every_n_syncs=2, tolerance=0.01, probe_length=8, seed=3)
    assert [check.due(i) for i in range(5)] == [True, False, True, False, True]  # 0 = before training
    assert not WeightSyncCheck(every_n_syncs=0).due(0)
    # Default probe: the prompt's first probe_length tokens; random ids without a usable prompt.
    assert check.probe(vocab_size=50, prompt=list(range(100, 120))) == list(range(100, 108))
    probe = check.probe(vocab_size=50, prompt=[7])
    assert probe == check.probe(vocab_size=50) and len(probe) == 8 and all(0 <= t < 50 for t in probe)
    random_probe = WeightSyncCheck(probe="random", probe_length=8, seed=3)
    assert random_probe.probe(vocab_size=50, prompt=list(range(100, 120))) == probe
    # |[-1, -2, -3] - [-1.001, -2.02, -3]| = [0.001, 0.02, 0] -> max 0.02
    diff = check.measure(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.001, -2.02, -3.0]))
    # measure subtracts in float64, but the inputs are fp32: -2.02 is rounded once, by up to half an ulp at 2
    # (1.2e-7; here 1.9e-8), which the difference keeps: 6e-6 of 0.02 at worst, above approx's default 1e-6
    # relative (which held only because this rounding happens to be small). No kernel enters. Bound: 1 ulp at 2.
    assert diff == pytest.approx(0.02, abs=ulps(torch.tensor(2.02), 1))
    check.verify(0.01, step=4)  # at the tolerance: passes
    with pytest.raises(WeightSyncError, match=r"after step 4: .* by up to 0\.02 \(tolerance 0\.01\)"):
        check.verify(diff, step=4)
    nan = check.measure(torch.tensor([0.0, float("nan")]), torch.zeros(2))
    assert math.isnan(nan)
    with pytest.raises(WeightSyncError, match=r"not finite \(NaN or inf\) on at least one rank"):
        check.verify(nan, step=0)
    assert check.reducible(nan) == math.inf and check.reducible(0.02) == 0.02
    with pytest.raises(WeightSyncError, match="not finite"):
        check.verify(math.inf, step=0)
    with pytest.raises(ValueError, match="probe_length"):
        WeightSyncCheck(probe_length=1)


_NAN_ON_ONE_RANK = """
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

from torchtune_grpo.generation import WeightSyncCheck, WeightSyncError

def rank_main(rank, out_dir):
    # A file store: no port to pick, so none another test's process can take in between.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank, world_size=2)
    check = WeightSyncCheck(tolerance=0.1)
    # Rank 0's engine is 0.01 off the trainer; rank 1's engine produced a NaN.
    engine = torch.tensor([-1.01, -2.0]) if rank == 0 else torch.tensor([-1.0, float("nan")])
    diff = check.measure(torch.tensor([-1.0, -2.0]), engine)
    raw = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(raw, op=dist.ReduceOp.MAX)  # what the recipe did before: the NaN can vanish
    # WeightPublisher.publish's reduction: reducible() before MAX, verify() after.
    t = torch.tensor([check.reducible(diff)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    try:
        check.verify(t.item(), step=3)
        verdict = "passed"
    except WeightSyncError as e:
        verdict = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"raw": raw.item(), "reduced": t.item(), "verdict": verdict}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)

if __name__ == "__main__":
    out_dir = sys.argv[0] + ".d"
    os.makedirs(out_dir, exist_ok=True)
    # The ranks fork from this process (torch and the package imported once, not again in two fresh interpreters:
    # ~3 s on 2 cores); it has started no thread pool and no process group, and each rank joins its own group.
    mp.start_processes(rank_main, args=(out_dir,), nprocs=2, start_method="fork")
    results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    # gloo's MAX over [0.01 (rank 0), nan (rank 1)] gives 0.01 (measured): a plain MAX would pass the check.
    assert all(abs(r["raw"] - 0.01) < 1e-6 for r in results), results
    for r in results:  # with reducible(): +inf on every rank, and every rank fails the check
        assert r["reduced"] == float("inf"), results
        assert "not finite (NaN or inf) on at least one rank" in r["verdict"], results
    print("NAN_FAILS_ON_BOTH_RANKS")
"""


@pytest.mark.slow
def test_nan_on_one_of_two_gloo_ranks_fails_the_sync_check_on_both(tmp_path):
    # 2 gloo processes; each writes its outcome to a file and the parent checks both (judged by the
    # parent's success marker, not exit codes: see run_script_expecting).
    run_script_expecting(_NAN_ON_ONE_RANK, "NAN_FAILS_ON_BOTH_RANKS", tmp_path)


def test_tis_weights_by_hand():
    old = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    sampler = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.4)]])
    mask = torch.tensor([[True, True, False]])
    # ratios pi_old / mu: 0.5/0.5 = 1, 0.9/0.3 = 3 -> capped at 2, masked -> 1
    w = tis_weights(old, sampler, mask, cap=2.0)
    # w = exp(log 0.5 - log 0.5) = exp(0) = 1 exactly, the cap 2.0 and the masked 1 exact: allclose's default
    # (1e-5 relative) far above.
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 1.0]]))
    assert not w.requires_grad


def test_grpo_loss_with_tis_scales_the_policy_term():
    torch.manual_seed(0)
    logprobs = torch.log(torch.tensor([[0.5, 0.9], [0.2, 0.6]])).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    sampler = torch.log(torch.tensor([[0.25, 0.9], [0.4, 0.6]]))
    # On-policy (old = logprobs): rho = 1, policy_t = -A. TIS weights pi_old/mu = [[2, 1], [0.5, 1]]
    # (cap 3 not reached), so policy_t = [[-2, -1], [0.5, 1]]; token-mean over 4 tokens = -1.5 / 4.
    loss = GRPOLoss(tis_cap=3.0)
    out = loss(logprobs, logprobs.detach(), adv, mask, num_tokens=4, num_seqs=2, sampler_logprobs=sampler)
    # w = exp(log 0.5 - log 0.25) = 2: two fp32 logs (half an ulp each, ~6e-8 at 0.7-1.4), a subtraction and exp
    # (~1 ulp): 2 (1 + ~3e-7) at worst; weighted by |A| = 1 into a sum of 4 then / 4: ~2e-7 / 4 off -0.375 at
    # worst, 1.3e-7 relative. Bound: approx's default 1e-6 relative; the gradient -A w / 4 likewise against
    # allclose's 1e-5 relative. Without TIS rho = exp(0) = 1 and the sum is exactly 0 (approx(0.0): 1e-12).
    assert out.loss.item() == pytest.approx(-1.5 / 4)
    # Gradient d loss / d logprob_t = -A w_t / 4 (d rho / d logprob = rho = 1).
    out.loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.5, -0.25], [0.125, 0.25]]))
    # Without sampler logprobs (native engine) or without tis_cap the loss is the plain one: -(1+1-1-1)/4.
    plain = loss(logprobs, logprobs.detach(), adv, mask, num_tokens=4, num_seqs=2)
    assert plain.loss.item() == pytest.approx(0.0)
    off = GRPOLoss()(logprobs, logprobs.detach(), adv, mask, num_tokens=4, num_seqs=2, sampler_logprobs=sampler)
    assert off.loss.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOLoss(tis_cap=0.0)
    with pytest.raises(ValueError, match="sampler_logprobs must have the shape"):
        loss(logprobs, logprobs.detach(), adv, mask, num_tokens=4, num_seqs=2, sampler_logprobs=sampler[:1])


def test_response_values_line_up_with_the_trainers_logprob_columns():
    # Row 0: prompt [1, 2, 3] + response [7, 8]; row 1: prompt [4, 5] + response [9].
    # start = min prompt length - 1 = 1. Response token j of row i is at position len(p_i) + j, its
    # logprob at column len(p_i) + j - 1 - start: row 0 -> columns 1, 2; row 1 -> column 0.
    out = response_values([[1, 2, 3], [4, 5]], [[-0.1, -0.2], [-0.3]], start=1, width=3)
    # The values are copied (fp32 of -0.1 etc., as the reference): exact; allclose's default.
    assert torch.allclose(out, torch.tensor([[0.0, -0.1, -0.2], [-0.3, 0.0, 0.0]]))


def test_logprob_mismatch_sum_only_counts_response_tokens():
    a = torch.tensor([[-1.0, -2.0, float("nan")]])
    b = torch.tensor([[-1.5, -2.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # |-1 - -1.5| + |-2 - -2| = 0.5 exactly in fp32; approx's default.
    assert logprob_mismatch_sum(a, b, mask).item() == pytest.approx(0.5)


def test_the_old_rope_keyword_still_converts_with_a_warning():
    # tune_to_hf_param(rope_layout=...) and HFModelSpec.rope_layout are rope_order now ("layout" names how a
    # training batch's rows are arranged, nothing else); the old names work for one release, warning.
    q = torch.arange(4 * 8, dtype=torch.float32).reshape(8, 4)
    name = "layers.0.attn.q_proj.weight"
    new = tune_to_hf_param(name, q, rope_order="interleaved", head_dim=4)
    with pytest.warns(FutureWarning, match=r"rope_layout=\.\.\.\) is now rope_order"):
        old = tune_to_hf_param(name, q, rope_layout="interleaved", head_dim=4)
    assert old[0] == new[0] and torch.equal(old[1], new[1]) and not torch.equal(new[1], q)
    with pytest.raises(TypeError, match="needs rope_order"):
        tune_to_hf_param(name, q, head_dim=4)
