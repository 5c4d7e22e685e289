"""Packed rows (torchtune_grpo/training/packed_rows.py, `pack_sequences_in_training`): several sequences per row,
document-masked, positions restarting per sequence; logprobs, entropies and gradients equal to one padded row
per sequence (fp32), for two model families, any micro-batch split and under activation checkpointing; a
token-budget plan of packed rows bounds the real tokens. The update's split-independence with packed rows:
tests/test_micro_batching.py (layout "packed")."""

import random

import pytest
import torch
from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import make_tiny_decoder
from tests.test_shared_prompt import _llama_tiny, _logprobs_and_grads
from tests.tolerances import logit_ulps, ulps
from torchtune_grpo.training.packed_rows import packed_layout
from torchtune_grpo.training.batch import TrainingBatch


def test_layout_by_hand():
    # Sequences (prompt + response[:-1]): 0 = [1, 2 | 7] (3 slots), 1 = [1, 2 | 8, 8] (4 slots),
    # 2 = [3 | ] (1 slot: a one-token response is predicted at the prompt's last token). Width 4 = the
    # longest; first-fit decreasing: seq 1 fills row 0, seqs 0 and 2 share row 1.
    prompts = [[1, 2], [1, 2], [3]]
    responses = [[7, 9], [8, 8, 9], [5]]
    # start = min prompt length - 1 = 0; T = longest unshared row (5) - 1 - 0 = 4.
    lay = packed_layout(prompts, responses, pad_id=0, start=0, width=4)
    assert lay.tokens.tolist() == [[1, 2, 8, 8], [1, 2, 7, 3]]
    assert lay.input_pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]  # positions restart per sequence
    # seq 1's tokens 8, 8, 9 predicted at row 0 slots 1, 2, 3; seq 0's 7, 9 at row 1 slots 1, 2; seq 2's 5
    # at row 1 slot 3 (its prompt's only token).
    assert sorted(zip(lay.dst.tolist(), lay.src.tolist(), lay.targets.tolist())) == [
        (0 * 4 + 1, 4 + 1, 7), (0 * 4 + 2, 4 + 2, 9),
        (1 * 4 + 1, 1, 8), (1 * 4 + 2, 2, 8), (1 * 4 + 3, 3, 9),
        (2 * 4 + 0, 4 + 3, 5),
    ]
    m = lay.mask.mask[1, 0].int().tolist()  # row 1: seq 0 in slots 0-2, seq 2 in slot 3
    assert m == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


def _long_tailed(seed, vocab, groups=3, g=4):
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 9))]
        for _ in range(g):
            prompts.append(p)
            responses.append([rng.randrange(1, vocab) for _ in range(min(60, int(rng.lognormvariate(1.6, 1.0)) + 1))])
    return prompts, responses


@pytest.mark.parametrize("family", ["qwen2", "llama3_2"])
@pytest.mark.parametrize("micro_batch_size", [12, 5])
def test_logprobs_entropy_and_gradients_match_padded_rows(family, micro_batch_size):
    model = make_tiny_decoder(scale=1.0).train() if family == "qwen2" else _llama_tiny()
    prompts, responses = _long_tailed(0, 97)
    n = len(prompts)
    mbs = [slice(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]
    padded = TrainingBatch(prompts, responses, 0, share_prompt=False)
    packed = TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True)
    assert sum(packed.layout(s).tokens.size(0) for s in mbs) < n  # really several sequences per row
    lp_a, ent_a, grads_a = _logprobs_and_grads(model, padded, mbs)
    lp_b, ent_b, grads_b = _logprobs_and_grads(model, packed, mbs)
    mask = padded.response_mask
    assert (lp_b[~mask] == 0).all() and (lp_b[mask] != 0).all()
    # Packed and padded rows run other matmul and attention shapes (other blocking, another mask), so every
    # layer's sums round in another order. A logprob is a logit / 0.7 minus a logsumexp, an entropy a
    # logsumexp minus sum p z: each a few-ulp result of ~9 matmuls at the logits' magnitude (|z| / 0.7 up to
    # ~100 here, 1 ulp = 1.2e-5), not at the logprob's (which can be ~0): about sqrt(9) = 3 ulp each side.
    # Bound: 16 ulp of the largest logit / 0.7 (measured: 2.3e-5, ~2 ulp, with AVX-512, AVX2 and scalar
    # kernels). A weight's gradient sums per-position products over the batch's ~200 positions in another
    # order, on top of the forward's few ulp: ~sqrt(200) = 14 ulp of the partial sums, which stay below the
    # tensor's largest element. Bound: 32 ulp of each gradient tensor's largest element (measured: <= 6 ulp, with
    # AVX-512, AVX2 and scalar kernels).
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(lp_b, lp_a, atol=atol, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=atol, rtol=0)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=ulps(g, 32), rtol=0, msg=lambda m: f"{name}: {m}")


def test_activation_checkpointing_recomputes_the_packed_layout():
    prompts, responses = _long_tailed(1, 97, groups=2)
    mbs = [slice(0, len(prompts))]
    reference = _logprobs_and_grads(make_tiny_decoder(scale=1.0).train(), TrainingBatch(prompts, responses, 0, share_prompt=False), mbs)
    model = make_tiny_decoder(scale=1.0).train()
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    lp, _, grads = _logprobs_and_grads(model, TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True), mbs)
    # Packed rows against padded ones, as in test_logprobs_entropy_and_gradients_match_padded_rows (the
    # recomputation itself repeats the same kernels): 16 ulp of the largest logit / 0.7 for the logprobs,
    # 32 ulp of each gradient tensor's largest element.
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(lp, reference[0], atol=atol, rtol=0)
    for (name, g), g_ckpt in zip(reference[2].items(), grads.values()):
        torch.testing.assert_close(g_ckpt, g, atol=ulps(g, 32), rtol=0, msg=lambda m: f"{name}: {m}")


def test_packing_removes_padding_and_a_plan_bounds_real_tokens():
    prompts, responses = _long_tailed(2, 97, groups=4)
    padded = TrainingBatch(prompts, responses, 0, share_prompt=False)
    packed = TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True)
    every = slice(0, len(prompts))
    assert packed.real_tokens(every) == sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses))
    waste = lambda b: 1 - b.real_tokens(every) / b.padded_tokens(every)  # noqa: E731
    assert waste(packed) < 0.5 * waste(padded), (waste(packed), waste(padded))
    plan = packed.plan(max_tokens=80, max_rows=16)
    ordered = packed.select(plan.order, row_width=plan.row_width)
    for s in plan.slices():
        # The packed cost is the real tokens: within the budget unless a sequence alone exceeds it.
        assert ordered.real_tokens(s) <= 80 or s.stop - s.start == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_plan_fills_rows_below_ten_percent_padding_within_the_budget(seed):
    # Issue 30's workload shape: 8 prompts of 32-96 tokens x 8 completions with log-normal lengths (median 64,
    # capped at 1,024). Each micro-batch's rows are as wide as its longest sequence and filled from every
    # sequence left, so the short ones fill the room the long ones leave; the planned rows are the layout's.
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(8):
        p = [rng.randrange(1, 97) for _ in range(rng.randint(32, 96))]
        for _ in range(8):
            prompts.append(p)
            responses.append([rng.randrange(1, 97) for _ in range(min(1024, int(rng.lognormvariate(4.16, 1.0)) + 1))])
    batch = TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True)
    longest = max(len(p) + len(r) - 1 for p, r in zip(prompts, responses))
    budget = 8 * longest
    plan = batch.plan(max_tokens=budget, max_rows=64)
    ordered = batch.select(plan.order, row_width=plan.row_width)
    real = padded = 0
    for s in plan.slices():
        slots = ordered.padded_tokens(s)  # the packed layout the update runs
        assert slots <= budget, (s, slots, budget)
        real, padded = real + ordered.real_tokens(s), padded + slots
    assert sorted(plan.order) == list(range(len(prompts)))
    assert 1 - real / padded < 0.10, (seed, 1 - real / padded, plan.sizes)


@pytest.mark.parametrize("width", [37, 150])  # below and above FlexAttention's 128-slot blocks
def test_flex_block_mask_attends_exactly_the_dense_masks_pairs(width):
    # packed_attention: flex gives FlexAttention a block mask of the pairs the dense mask allows: the same
    # sequence, causal, and a pad slot seeing itself. Checked on the CPU through eager FlexAttention's
    # forward (the CPU has no FlexAttention backward; the device's gradients: tests/test_gpu.py), with
    # grouped-query heads, against the dense mask's SDPA.
    from torchtune_grpo.training.packed_rows import _block_mask, flex_packed_attention, PackedMask

    gen = torch.Generator().manual_seed(width)
    rows, segments = 3, torch.full((3, width), -1, dtype=torch.long)
    for r in range(rows):  # sequences of random lengths, then padding
        at, seg = 0, 0
        while at < width - 10:
            n = int(torch.randint(1, 40, (1,), generator=gen))
            segments[r, at : at + n] = seg
            at, seg = at + n, seg + 1
    q = torch.randn(rows, 4, width, 16, generator=gen) * 3  # peaked attention: a wrong pair shows
    k, v = torch.randn(rows, 2, width, 16, generator=gen) * 3, torch.randn(rows, 2, width, 16, generator=gen)
    dense = PackedMask(segments, backend="flex").attention(q, k, v)  # on the CPU: the dense mask's SDPA
    with torch.no_grad():
        flex = flex_packed_attention(q, k, v, _block_mask(segments))
    # Flex attention (blockwise online softmax) against SDPA over the dense mask: the same sums over <= 40 keys
    # of d = 16 in another order, outputs |o| <~ 4.4 (ulp 4.8e-7): a few ulp, ~1e-6. Bound: 1e-5 + 1e-5
    # relative (>= 20 ulp; measured 7e-7 with AVX-512).
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    # Not a vacuous check: attending across sequences would change the result.
    crossing = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (crossing - dense).abs().max() > 0.1
