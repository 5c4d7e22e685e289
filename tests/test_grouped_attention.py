"""Grouped-query heads left to the kernel in the native engine's decode on transformers' modules
(models/_grouped_attention.py), for every family of tests/hf_families.py and tests/hf_moe.py:

- a rollout (shared prefill, compaction, left padding: a mask at every step) samples from the very logits, bit for
  bit, that transformers' own ``sdpa`` function gives (which copies the key and value heads to the query heads at
  every step); a multi-turn session's turns the same;
- the grouped variant really runs during the rollout on the families on ``sdpa`` (masked, grouped heads, at the
  decode steps), and the model is back on ``sdpa`` afterwards; a family on ``eager`` is left alone.
"""

from contextlib import nullcontext

import pytest
import torch

from tests.hf_families import FAMILIES
from tests.hf_moe import MOE_FAMILY_NAMES
from tests.sampler_records import record_sampler
from torchtune_grpo.generation import _hf_rollout, _hf_session, NativeGenerator

ALL = [*FAMILIES, *MOE_FAMILY_NAMES]
# Prompt lengths 9, 3 and 6: left padding, so every decode step has a mask (the case transformers copies for).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [40, 41, 42, 43, 44, 45]]
KW = dict(group_size=3, max_new_tokens=20, pad_id=0, stop_tokens=list(range(100, 130)))
SESSION_FAMILIES = ["smollm3", "qwen3_moe"]  # full attention in every layer (tests/test_native_transformers_session)


@pytest.fixture
def grouped_kernel_calls(monkeypatch):
    """The query lengths of every masked attention kernel call with grouped heads passed as they are."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, enable_gqa=False, **kw):
        if enable_gqa and attn_mask is not None:
            calls.append(query.size(-2))
        return original(query, key, value, attn_mask, *args, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _no_grouping(monkeypatch):
    """The engine with transformers' own ``sdpa`` throughout (the switch a no-op)."""
    for module in (_hf_rollout, _hf_session):
        monkeypatch.setattr(module, "grouped_kv_attention", lambda model: nullcontext())


def _equal_steps(first, second):
    # Exact: for each query head the kernel meets the same key and value rows in the same order whether the heads
    # are grouped or copied, so it is the same arithmetic. NaN marks rows not in the decode batch, in both runs.
    assert len(first) == len(second)
    for (a, ta), (b, tb) in zip(first, second):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(ta, tb)


@pytest.mark.parametrize("family", ALL)
def test_grouped_heads_change_no_bit_of_a_rollout(family, family_policy, monkeypatch, grouped_kernel_calls):
    model = family_policy(family)
    hf = model.sampler()
    implementation = hf.config._attn_implementation
    runs = record_sampler(monkeypatch)
    engine = NativeGenerator(stop_check_interval=4)
    runs.append([])
    grouped = engine.generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), temperature=1.0, **KW)
    assert hf.config._attn_implementation == implementation  # switched back
    if implementation == "sdpa":  # every family here has grouped heads (4 query, 2 key-value)
        assert grouped_kernel_calls.count(1) >= len(runs[0]) - 1, "the decode steps did not run the grouped kernel"
    else:  # eager (soft caps, sinks): untouched
        assert not grouped_kernel_calls
    _no_grouping(monkeypatch)
    runs.append([])
    plain = engine.generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), temperature=1.0, **KW)
    assert grouped.response_ids == plain.response_ids
    _equal_steps(*runs)


@pytest.mark.parametrize("family", SESSION_FAMILIES)
def test_grouped_heads_change_no_bit_of_a_session(family, family_policy, monkeypatch):
    model = family_policy(family)
    engine = NativeGenerator(stop_check_interval=4)
    runs = record_sampler(monkeypatch)

    def episode():
        runs.append([])
        n = len(PROMPTS) * 2
        with engine.session(model, PROMPTS, group_size=2, max_new_tokens=60, pad_id=0,
                            stop_tokens=KW["stop_tokens"]) as session:
            first = session.generate(list(range(n)), [[]] * n, generator=torch.Generator().manual_seed(3),
                                     max_new_tokens=8)
            replies = [r + [200, 201 + i] for i, r in enumerate(first.response_ids)]
            second = session.generate([0, 2, 5], [replies[i] for i in (0, 2, 5)],
                                      generator=torch.Generator().manual_seed(4), max_new_tokens=8)
        return first.response_ids, second.response_ids

    grouped = episode()
    _no_grouping(monkeypatch)
    assert episode() == grouped
    _equal_steps(*runs)
