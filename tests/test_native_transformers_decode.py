"""The native engine on transformers' own modules (generation/_hf_rollout.py), for every family of
tests/hf_families.py and tests/hf_moe.py (tiny models built once per module, in memory, as ``make_family_dir``
makes them; 6-token windows, shorter than the 9-token prompts plus up to 24 decoded tokens):

- the prompts prefilled once per group and finished rows leaving the batch give the same tokens, under the same
  seed, as every row prefilled and decoded to the end (``share_prefill: false, compact_decode: false``), the
  generator drawing exactly as much; for a mixture of experts, the same routes;
- greedy decoding gives transformers' own ``generate(do_sample=False)`` tokens, and a mixture of experts' routes
  are those :func:`~torchtune_grpo.generation._transformers.routes_of_generate` reads from ``generate``;
- left padding changes nothing: a padded row's first logits are the unpadded prompt's;
- the trainer's logprobs of the sampled completions are those of the logits the engine sampled from.
"""

import pytest
import torch

from tests.hf_families import FAMILIES
from tests.hf_moe import MOE_FAMILY_NAMES
from tests.sampler_records import flip_chance, record_sampler, sampled_logprobs
from tests.tolerances import ulps
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.generation._hf_rollout import HFRollout
from torchtune_grpo.generation._transformers import sample_with_generate
from torchtune_grpo.training.batch import batch_token_logprobs, TrainingBatch

ALL = [*FAMILIES, *MOE_FAMILY_NAMES]
# Lengths 9, 3 and 6: left padding of 0, 6 and 3 tokens (a whole window of padding in the second row).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [40, 41, 42, 43, 44, 45]]
# 40 of the 512 ids stop a row: rows stop at scattered lengths (1 to the 24-token budget), so the batch shrinks.
STOPS = list(range(100, 140))
KW = dict(group_size=3, max_new_tokens=24, pad_id=0, stop_tokens=STOPS)


@pytest.fixture
def sampled(monkeypatch):
    """Every sampler call of the test's ``generate`` runs (tests/sampler_records.py)."""
    return record_sampler(monkeypatch)


@pytest.fixture
def kept(monkeypatch):
    """The row counts every :meth:`HFRollout.compact` keeps."""
    seen = []
    original = HFRollout.compact

    def spy(self, keep):
        seen.append(keep.numel())
        return original(self, keep)

    monkeypatch.setattr(HFRollout, "compact", spy)
    return seen


def _run(policy, runs, seed, temperature=1.0, **engine):
    runs.append([])
    gen = torch.Generator().manual_seed(seed)
    out = NativeGenerator(stop_check_interval=4, **engine).generate(
        policy, PROMPTS, generator=gen, temperature=temperature, **KW)
    return out, torch.rand(2, generator=gen)


@pytest.mark.parametrize("family", ALL)
def test_shared_prefill_and_compaction_give_the_per_row_tokens(family, family_policy, sampled, kept):
    model = family_policy(family)
    fast, fast_next = _run(model, sampled, seed=1)
    assert kept and min(kept) < 9  # the batch shrank as rows stopped
    kept.clear()
    slow, slow_next = _run(model, sampled, seed=1, share_prefill=False, compact_decode=False)
    assert not kept
    assert fast.response_ids == slow.response_ids
    assert fast.truncated.tolist() == slow.truncated.tolist()
    assert torch.equal(fast_next, slow_next)  # the generator drew exactly as much
    lengths = sorted(len(r) for r in fast.response_ids)
    assert lengths[0] < 8 and lengths[-1] > 12, lengths  # long-tailed: some rows decoded well after others left
    if family in MOE_FAMILY_NAMES:  # decisive routers: the group's one prefill routes its prompt as each row's
        assert all(torch.equal(a, b) for a, b in zip(fast.routed_experts, slow.routed_experts))
    # Why equal tokens are not luck: the two layouts' logits differ by rounding (batch sizes of the matrix products:
    # [B x 9] against [B x G x 9] prefill rows, shrinking decode batches), measured up to 6e-5 (gemma3_text; 1e-5
    # typically). A seeded draw flips only if its uniform falls between a CDF entry of one run and the same entry
    # of the other: the chance is at most the sum over vocabulary entries of |CDF_a - CDF_b|, summed here over
    # every step and row both runs sampled (measured 3e-4 to 4.5e-3 per family, 0.019 over the 15 families). Bound
    # 0.01: a kernel of other rounding (AVX2, another BLAS) fails this test spuriously less than 1 time in 100.
    chance = flip_chance(*sampled)
    assert chance < 0.01, chance


@pytest.mark.parametrize("family", ALL)
def test_greedy_equals_transformers_generate(family, family_policy, sampled):
    model = family_policy(family)
    ours, _ = _run(model, sampled, seed=0, temperature=0.0)
    theirs = sample_with_generate(model.sampler(), PROMPTS, generator=None, temperature=0.0, top_k=None, top_p=1.0,
                                  **KW)
    assert ours.prompt_ids == theirs.prompt_ids
    assert ours.response_ids == theirs.response_ids
    assert ours.truncated.tolist() == theirs.truncated.tolist()
    assert len({len(r) for r in ours.response_ids}) > 1  # rows stopped at different steps
    if family in MOE_FAMILY_NAMES:
        assert all(torch.equal(a, b) for a, b in zip(ours.routed_experts, theirs.routed_experts))
    else:
        assert ours.routed_experts is None
    # Not a near-tie: generate() computes the same logits in other batch shapes ([B x G] prefill rows, no rows
    # leaving), which moves them by rounding only (<= 6e-5 measured, previous test); every argmax here won by
    # >= 1e-3 (measured minimum 1.5e-3, gpt_oss), 16x that.
    margins = [(lg[~lg.isnan().any(1)].topk(2).values @ torch.tensor([1.0, -1.0])).min() for lg, _ in sampled[0]]
    assert min(margins) >= 1e-3, min(margins)


@pytest.mark.parametrize("family", ALL)
def test_left_padding_is_exact(family, family_policy):
    # Softmax layers mask the padded keys; Gated DeltaNet zeroes the padded positions' inputs, so the convolution
    # and the recurrent state see nothing of them. The padded rows' first logits equal each prompt's alone to
    # rounding: other batch shapes, and in Gated DeltaNet's chunked scan other chunk boundaries; 2-4 layers of
    # matmuls over 128-256 terms, peaked softmaxes amplifying the differences of their inputs: measured up to 13 ulp
    # of the largest logit (qwen3_5_moe, 1.2e-5 at |z| 7.7; both CPU kernels). Bound: 32 ulp. The padding unmasked
    # (no attention mask) moves the padded rows' logits by 1 to 7.5.
    hf = family_policy(family).sampler()
    with torch.inference_mode():
        together = HFRollout(hf, PROMPTS, 1, 0).prefill()  # [3, V]
        alone = torch.cat([HFRollout(hf, [p], 1, 0).prefill() for p in PROMPTS])
    torch.testing.assert_close(together, alone, atol=ulps(alone, 32), rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma3_text", "gpt_oss", "olmoe"])
def test_trainer_logprobs_are_those_the_engine_sampled_from(family, family_policy, sampled):
    # fp32. The engine sampled each token from its decode logits (a cache filled by a left-padded prefill, then one
    # token per forward: Gated DeltaNet's recurrent step, windows of cached keys, MoE experts of 1-token batches);
    # the trainer recomputes each completion in one right-padded forward (chunked scan, full windows). The same
    # function summed in other orders: a logprob is a logit minus a logsumexp, each the end of 2-3 layers of matmuls
    # over 128-256 terms through peaked softmaxes, which amplify their inputs' rounding. Measured (both CPU kernels,
    # ~130 tokens each): up to 3.4e-5 (gemma3_text, |logit| <= 9.2, ~30 ulp), 2.5e-5 qwen3_5_text, 2.2e-5 olmoe,
    # 7e-6 gpt_oss. Bound 1e-4. Not gemma4_text here: its attention is peaked to 0.98 (tests/hf_families.py), and
    # transformers' own generate() logits differ from its full forward by up to 3e-4 on it.
    model = family_policy(family)
    out, _ = _run(model, sampled, seed=2)
    engine = sampled_logprobs(out.response_ids, sampled[0])
    batch = TrainingBatch(out.prompt_ids, out.response_ids, 0, share_prompt=False)
    trainer = batch_token_logprobs(model, batch, micro_batch_size=len(batch)).logprobs[batch.response_mask]
    torch.testing.assert_close(trainer.double(), engine, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ALL)
def test_ready_made_decode_masks_are_transformers_own(family, family_policy, monkeypatch):
    # A decode step's masks handed to the model built (HFRollout._decode_step_mask) against transformers building
    # them from the 2-D padding mask: the same keys kept, so the same logits bit for bit. 40 steps on the padded
    # prompts: every layer's 6-token window (sliding layers keep their last 5 slots) long passed, rows of 0, 6 and
    # 3 padding slots. gpt_oss runs ``eager`` only (additive masks in the forward's dtype, which under mixed
    # precision only the forward knows): transformers builds its masks, as before.
    from torchtune_grpo.models import grouped_kv_attention
    from torchtune_grpo.models._transformers_layouts import decode_mask_unsupported

    hf = family_policy(family).sampler()
    if family == "gpt_oss":
        assert "eager" in decode_mask_unsupported(hf.config)
        assert not HFRollout(hf, PROMPTS, 2, 0)._ready_masks
        return
    built = []
    original = HFRollout._decode_step_mask

    def spy(self, mask):
        out = original(self, mask)
        built.append(out is not mask)
        return out

    monkeypatch.setattr(HFRollout, "_decode_step_mask", spy)

    def decode(ready):
        run = HFRollout(hf, PROMPTS, 2, 0)
        assert run._ready_masks  # every test family on sdpa takes the ready-made masks
        run._ready_masks = ready
        with torch.inference_mode(), grouped_kv_attention(hf):
            logits, out = run.prefill(), []
            for t in range(40):
                logits = run.decode(logits.argmax(-1), t)
                out.append(logits)
        return torch.stack(out)  # [40, 6, V]

    theirs = decode(False)
    assert not built
    ours = decode(True)
    assert len(built) == 40 and all(built)  # every step's masks were handed over built
    assert torch.equal(ours, theirs)
