"""Training with each prompt computed once per group (torchtune_grpo/training/batch.py, `share_prompt_in_training`),
and on one process without FSDP2 (`fsdp_single_process: false`, the default) against FSDP2
(`fsdp_single_process: true`).

The shared layout must give the same logprobs, entropies and gradients as one row per sequence (fp32, to
~1e-5), for micro-batches that split a group, with activation checkpointing, under FSDP2, and in the recipe
(weights after training steps). 1 vs 2 processes with the layout on (the default) is covered by
tests/test_algorithms_recipe.py::test_every_variant_is_independent_of_micro_batches_and_processes.
"""

import random

import pytest
import torch
from torchtune import training
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import make_tiny_decoder
from tests.tolerances import logit_ulps, ulps
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.training.batch import (
    install_shared_prompt_attention,
    shared_prompt_layout,
    supports_shared_prompt,
    TrainingBatch,
)


def test_layout_by_hand():
    # Two prompts: [1, 2, 3] with responses [7, 8] and [9]; [4, 5] with [6, 6, 6]. P = 3, M = 2, and
    # C = 3 - 1 = 2: a response's last token is an input to nothing.
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]
    responses = [[7, 8], [9], [6, 6, 6]]
    # Unshared rows: L = 5, start = min(3, 3, 2) - 1 = 1, so T = 5 - 1 - 1 = 3 columns (predictions of
    # tokens 2, 3, 4 of each row).
    lay = shared_prompt_layout(prompts, responses, pad_id=0, start=1, width=3)
    s = 3 + 2 * 2
    assert lay.tokens.tolist() == [
        [1, 2, 3, 7, 0, 0, 0],
        [4, 5, 0, 6, 6, 0, 0],  # one completion: its second region is empty
    ]
    # Each completion continues its own prompt: positions 3, 4 (row 0), 2, 3 (row 1).
    assert lay.input_pos.tolist() == [[0, 1, 2, 3, 4, 3, 4], [0, 1, 2, 2, 3, 2, 3]]
    # Seq 0: token 7 predicted at the prompt's last token (slot 2), 8 at slot 3; seq 1: 9 at slot 2;
    # seq 2: 6, 6, 6 at row 1's slots 1, 3, 4.
    assert lay.src.tolist() == [2, 3, 2, s + 1, s + 3, s + 4]
    assert lay.targets.tolist() == [7, 8, 9, 6, 6, 6]
    # Column of response token t of seq i: len(prompt) + t - 1 - start, flat i * T + column.
    assert lay.dst.tolist() == [0 * 3 + 1, 0 * 3 + 2, 1 * 3 + 1, 2 * 3 + 0, 2 * 3 + 1, 2 * 3 + 2]
    m = lay.mask.completion_mask  # [R*M, 1, C, P+C]
    assert m.shape == (4, 1, 2, 5)
    assert m[0, 0].tolist() == [  # row 0's completions see all 3 prompt tokens, then causally
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert m[2, 0, 0].tolist() == [True, True, False, True, False]  # row 1: a prompt of 2 tokens


def _groups(seed, vocab, num_prompts=3, group_size=3, max_response=7):
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(num_prompts):
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(group_size):
            prompts.append(p)
            responses.append([rng.randrange(1, vocab) for _ in range(rng.randint(1, max_response))])
    return prompts, responses


def _logprobs_and_grads(model, batch, micro_batches):
    model.zero_grad(set_to_none=True)
    outs = [
        batch.logprobs(model, mb, temperature=0.7, chunk_size=5, with_entropy=True, entropy_grad=True)
        for mb in micro_batches
    ]
    lp = torch.cat([o.logprobs for o in outs])
    ent = torch.cat([o.entropy for o in outs])
    # A loss over response tokens only, with different weights per token (as any GRPO loss).
    w = torch.linspace(-1.0, 2.0, lp.numel(), device=lp.device).view_as(lp)
    ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _llama_tiny():
    torch.manual_seed(1)
    return llama3_2(
        vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
        max_seq_len=256, scale_factor=32, tie_word_embeddings=True,
    )


@pytest.mark.parametrize("family", ["qwen2", "llama3_2"])
@pytest.mark.parametrize("micro_batch_size", [9, 4])  # 4: micro-batches split groups of 3
def test_logprobs_entropy_and_gradients_match_unshared(family, micro_batch_size):
    model = make_tiny_decoder(scale=1.0).train() if family == "qwen2" else _llama_tiny()
    prompts, responses = _groups(0, 97)
    n = len(prompts)
    mbs = [slice(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]
    unshared = TrainingBatch(prompts, responses, 0, share_prompt=False)
    shared = TrainingBatch(prompts, responses, 0, share_prompt=True)
    lp_a, ent_a, grads_a = _logprobs_and_grads(model, unshared, mbs)
    lp_b, ent_b, grads_b = _logprobs_and_grads(model, shared, mbs)
    mask = unshared.response_mask
    assert torch.equal(mask, shared.response_mask)
    assert (lp_a[mask] != 0).all() and (lp_a[~mask] == 0).all() and (lp_b[~mask] == 0).all()
    # Shared and unshared rows run other matmul and attention shapes (a prompt computed once per group, another
    # mask), so every layer's sums round in another order. A logprob is a logit / 0.7 minus a logsumexp, an
    # entropy a logsumexp minus sum p z: each a few-ulp result of ~9 matmuls at the logits' magnitude (|z| / 0.7
    # up to ~100 here, 1 ulp = 1.2e-5), not at the logprob's (which can be ~0): about sqrt(9) = 3 ulp each side.
    # Bound: 16 ulp of the largest logit / 0.7. A weight's gradient sums per-position products over the batch's
    # positions in another order (prompt positions once per group or once per row), on top of the forward's
    # few ulp: ~sqrt(n) ulp of the partial sums, which stay below the tensor's largest element. Bound: 32 ulp
    # of each gradient tensor's largest element (the tests/test_packed_rows.py bounds). Measured, with AVX-512,
    # AVX2 and scalar kernels: logprobs 3.1e-5 apart (0.15 of the bound), gradients <= 0.19 of the bound.
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(lp_b, lp_a, atol=atol, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=atol, rtol=0)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=ulps(g, 32), rtol=0, msg=lambda m: f"{name}: {m}")


def test_activation_checkpointing_recomputes_the_shared_layout():
    # Checkpointed layers re-run attention in backward: the layout travels as the mask, so it is seen.
    prompts, responses = _groups(2, 97, num_prompts=2, group_size=4)
    mbs = [slice(0, len(prompts))]
    reference = _logprobs_and_grads(
        make_tiny_decoder(scale=1.0).train(), TrainingBatch(prompts, responses, 0, share_prompt=False), mbs
    )
    model = make_tiny_decoder(scale=1.0).train()
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    lp, _, grads = _logprobs_and_grads(model, TrainingBatch(prompts, responses, 0), mbs)
    # Shared against unshared rows, as in test_logprobs_entropy_and_gradients_match_unshared (the recomputation
    # itself repeats the same kernels): 16 ulp of the largest logit / 0.7 for the logprobs, 32 ulp of each
    # gradient tensor's largest element.
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(lp, reference[0], atol=atol, rtol=0)
    assert len(grads) == len(reference[2])
    for (name, g), g_ckpt in zip(reference[2].items(), grads.values()):  # same order, wrapped names
        torch.testing.assert_close(g_ckpt, g, atol=ulps(g, 32), rtol=0, msg=lambda m: f"{name}: {m}")


def test_generation_is_unchanged_by_the_training_attention():
    # The engine swaps in its cached attention during a rollout and gives the training forward back after.
    model = make_tiny_decoder()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    kw = dict(group_size=2, max_new_tokens=8, pad_id=0, stop_tokens=[96])
    before = NativeGenerator(temperature=0.0).generate(model, prompts, **kw).response_ids
    assert install_shared_prompt_attention(model) and install_shared_prompt_attention(model)
    patched = [a.forward for a in model.modules() if hasattr(a, "kv_cache")]
    assert NativeGenerator(temperature=0.0).generate(model, prompts, **kw).response_ids == before
    assert [a.forward for a in model.modules() if hasattr(a, "kv_cache")] == patched
    assert supports_shared_prompt(model)


def test_unsupported_models_train_unshared():
    class Custom(torch.nn.Module):
        pass

    assert not supports_shared_prompt(Custom())
    model = make_tiny_decoder(scale=1.0)
    attn = model.layers[0].attn
    attn.forward = lambda *a, **k: type(attn).forward(attn, *a, **k)  # someone else's instance forward
    assert not supports_shared_prompt(model)
    prompts, responses = _groups(3, 97, num_prompts=2, group_size=2)
    out = TrainingBatch(prompts, responses, 0).logprobs(model, slice(0, 4))
    ref = TrainingBatch(prompts, responses, 0, share_prompt=False).logprobs(model, slice(0, 4))
    assert torch.equal(out.logprobs, ref.logprobs)


def test_fsdp2_shared_matches_unshared(clean_env, one_thread):
    # FSDP2 on a one-process gloo group (in this process; ``clean_env`` destroys the group), as the recipe runs.
    from torch.distributed.fsdp import fully_shard

    from tests.recipe_utils import init_one_process_group

    init_one_process_group()
    prompts, responses = _groups(4, 97, num_prompts=3, group_size=4)
    mbs = [slice(0, 6), slice(6, 12)]
    results = []
    for share in (False, True):
        model = make_tiny_decoder(scale=1.0).train()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.set_requires_gradient_sync(True)
        lp, ent, grads = _logprobs_and_grads(model, TrainingBatch(prompts, responses, 0, share_prompt=share), mbs)
        results.append((lp, ent, {k: v.full_tensor() for k, v in grads.items()}))
    (a, ea, ga), (b, eb, gb) = results
    # Shared against unshared rows under FSDP2, as in test_logprobs_entropy_and_gradients_match_unshared: 16 ulp
    # of the largest logit / 0.7 (of the same, unsharded weights) for logprobs and entropies, 32 ulp of each
    # gradient tensor's largest element.
    atol = logit_ulps(make_tiny_decoder(scale=1.0), [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(b, a, atol=atol, rtol=0)
    torch.testing.assert_close(eb, ea, atol=atol, rtol=0)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], atol=ulps(ga[k], 32), rtol=0, msg=lambda m: f"{k}: {m}")


def test_the_loss_cycle_starts_at_each_runs_first_step():
    # The workload below cycles loss variants by step. Its step count once came from the process-wide count of
    # generation calls, so an earlier in-process run on the same pytest worker shifted the cycle: another
    # workload. Shifted by 6 (one of the 9 shifts), step 5's KL reached 14.8 per token and step 6's
    # seq-mean-token-sum update amplified rounding ~50x: micro-batches of 3 and 16 rows of the same unshared
    # layout ended 1.5e-5 apart, shared and unshared prompts 1.1e-4, both over the 1e-5 bound derived below (the
    # other 8 shifts: <= 2.2e-7). That was this test's flake. The cycle now counts from the loss's construction.
    from tests import _engines
    from tests._losses import StepCyclingLoss
    from tests.test_algorithms_recipe import VARIANTS

    saved = _engines.GENERATE_CALLS
    try:
        _engines.GENERATE_CALLS = 6  # what earlier runs in this process left
        loss = StepCyclingLoss(VARIANTS, max_response_length=8)
        loss.losses = [lambda *args, i=i, **kwargs: i for i in range(len(VARIANTS))]  # each answers its index
        picked = []
        for _ in range(len(VARIANTS) + 1):
            _engines.GENERATE_CALLS += 1  # the step's generation round
            picked.append(loss())
        assert picked == list(range(len(VARIANTS))) + [0]
    finally:
        _engines.GENERATE_CALLS = saved


@pytest.mark.slow
def test_recipe_weights_match_unshared_training(tmp_path, clean_env, one_thread):
    # The split-independence workload of tests/test_algorithms_recipe.py (every loss aggregation mode, KL,
    # entropy bonus, truncation masking, ppo_epochs 2, outcome and process-supervised advantages on alternate
    # steps, the rollout correction's masks), trained three ways: one row per sequence in one
    # micro-batch; shared prompts with micro-batches of 3 sequences (groups of 4 split across micro-batches);
    # both under FSDP2 (fsdp_single_process: true); and shared prompts on the plain module
    # (fsdp_single_process: false, the default: no FSDP2 on one process). In process: the recipe's own
    # setup/train/cleanup, no launcher (the launcher and 2 processes: tests/test_algorithms_recipe.py).
    from tests.recipe_utils import read_jsonl, run_in_process, weights, with_overrides
    from tests.test_algorithms_recipe import _split_config, VARIANTS

    runs = {
        "unshared": dict(share_prompt_in_training=False, fsdp_single_process=True),
        "shared": dict(share_prompt_in_training=True, fsdp_single_process=True),
        "plain": dict(share_prompt_in_training=True, fsdp_single_process=False),
    }
    results = {}
    for name, overrides in runs.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        run_in_process(with_overrides(_split_config(run_dir, 4, 3 if name == "shared" else 16), **overrides,
                                      ))
        out = run_dir / "out"
        results[name] = [weights(out / f"step_{k}") for k in range(1, len(VARIANTS) + 1)]
        results[name + "_metrics"] = read_jsonl(out / "metrics.jsonl")
    # The three runs compute each step's gradient as the same sum of per-token terms in another grouping (shared or
    # unshared prompts, micro-batches of 3 or 16 rows: other matmul shapes, logits a few ulp apart) and take the same
    # SGD step (lr 0.05, no clipping) on weights |w| <~ 1 (1 ulp 1.2e-7): ~sqrt(n) ulp of each gradient's partial sums
    # times lr, plus one rounding of each weight, per step, over the 9 steps. Bound: 1e-5 (~80 ulp of the largest
    # weight; measured 2.2e-7). It holds for this workload's conditioning, which the variant order sets (see
    # test_the_loss_cycle_starts_at_each_runs_first_step). No decision flips between the layouts: every token's
    # clip and rollout-correction decision stays the same with its log-probability moved by +-1e-4 (measured).
    for other in ("shared", "plain"):
        for k in range(len(VARIANTS)):
            for key, value in results["unshared"][k].items():
                torch.testing.assert_close(
                    results[other][k][key], value, atol=1e-5, rtol=0,
                    msg=lambda m: f"{other}, step {k + 1}, {key}: {m}",
                )
        # The step's metrics are fp32 sums over its ~400 response tokens, grouped differently (other
        # micro-batches, prompts shared or not: ~sqrt(400) = 20 ulp, 2.4e-6 relative), of per-token terms whose
        # log-ratios carry an absolute error of a few ulp of the logits (other matmul shapes). For the k3 KL
        # that absolute error becomes a relative one (dk3 / k3 -> d(log-ratio) as the ratio grows; the KL
        # reaches ~190 per token at step 7): ~1e-5 at logits of ~50 (1 ulp = 3.8e-6). Bound: 5e-5 relative,
        # 1e-5 absolute for values near 0 (measured: 5.2e-6 relative, kl at step 7 with AVX2 kernels).
        for ma, mb in zip(results["unshared_metrics"], results[other + "_metrics"]):
            for key in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "truncated_fraction"):
                assert mb[key] == pytest.approx(ma[key], rel=5e-5, abs=1e-5), (other, ma["step"], key)


@pytest.mark.slow
def test_plain_module_on_one_process_resumes_exactly(tmp_path, clean_env, one_thread, caplog):
    # fsdp_single_process: false (the default) keeps the plain module: checkpoint, optimizer state and resume
    # still work. In process (resuming through `tune run`: tests/test_recipe.py, tests/test_distributed_runs.py).
    import json
    import logging
    import shutil

    from tests.recipe_utils import read_jsonl, run_in_process, weights, with_overrides, write_config

    cfg = write_config(tmp_path, max_steps=2, save_every_n_steps=1, fsdp_single_process=False)
    run_in_process(cfg)
    out = tmp_path / "out"
    uninterrupted = weights(out / "step_2")
    shutil.rmtree(out / "step_2")
    metrics = read_jsonl(out / "metrics.jsonl")[:1]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    with caplog.at_level(logging.INFO):
        run_in_process(with_overrides(cfg, resume_from_checkpoint=True))
    assert f"Resuming from {out / 'step_1'}" in caplog.text
    resumed = weights(out / "step_2")
    # A resumed run is the uninterrupted computation itself: weights, optimizer and LR state, RNG streams and
    # data order restored bit for bit, the same kernels on the same shapes. So it compares a computation with
    # itself: exact (formerly 1e-6 + 1e-5 relative; measured bitwise equal with AVX-512, AVX2 and scalar kernels).
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], atol=0, rtol=0)
