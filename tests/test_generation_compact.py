"""The compacting decode loop (`NativeGenerator(compact_decode=True)`, generation/_compact.py).

Rows that stopped leave the decode batch; the tokens, the truncation flags and the generator's state after
the rollout are the same as the plain loop's, token for token: greedy and seeded (plain, top-k, top-p), in
the shared-prefix layout (fp32), the per-row layout (`share_prefill: false`, and bf16), and the first turn
of a multi-turn session (which never compacts: its caches live on). A spy checks that the batch really
shrank.
"""

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.generation import _layouts

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [40]]
STOPS = list(range(30, 42))  # ~12% of the vocabulary: rows stop at scattered lengths


@pytest.fixture
def compactions(monkeypatch):
    """Row counts kept by every ``compact`` call of either layout."""
    seen = []
    for cls in (_layouts.SharedPrefixRollout, _layouts.PerRowRollout):
        original = cls.compact

        def spy(self, keep, original=original):
            seen.append(keep.numel())
            return original(self, keep)

        monkeypatch.setattr(cls, "compact", spy)
    return seen


def _generate(model, compact, *, seed=0, temperature=1.0, dtype=torch.float32, **engine_kw):
    engine = NativeGenerator(temperature=temperature, stop_check_interval=4, compact_decode=compact, **engine_kw)
    gen = torch.Generator().manual_seed(seed)
    out = engine.generate(
        model.to(dtype), PROMPTS, group_size=3, max_new_tokens=40, pad_id=0, stop_tokens=STOPS, generator=gen
    )
    return out.response_ids, out.truncated.tolist(), torch.rand(3, generator=gen)


CASES = {
    "seeded": dict(temperature=1.0),
    "greedy": dict(temperature=0.0),
    "top_k": dict(temperature=0.8, top_k=20),
    "top_p": dict(temperature=1.2, top_p=0.9),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_compacting_decode_matches_the_plain_loop(case, layout, compactions):
    model = make_tiny_decoder(scale=1.0 if case != "greedy" else 4.0)
    kw = dict(CASES[case], share_prefill=layout == "shared_prefix")
    for seed in range(3):
        before = len(compactions)
        plain_ids, plain_trunc, plain_next = _generate(model, False, seed=seed, **kw)
        assert len(compactions) == before  # the plain loop never compacts
        ids, trunc, nxt = _generate(model, True, seed=seed, **kw)
        assert ids == plain_ids, (case, layout, seed)
        assert trunc == plain_trunc
        assert torch.equal(nxt, plain_next)  # the generator drew exactly as much
    lengths = sorted(len(r) for r in plain_ids)
    if case != "greedy":  # long-tailed: the batch shrank while some rows kept going
        assert lengths[0] < 10 and lengths[-1] > 20, lengths
        assert compactions and min(compactions) < 12, compactions


def test_bf16_per_row_cache_matches(compactions):
    # Half-precision caches decode in the per-row layout.
    model = make_tiny_decoder(scale=1.0)
    for seed in range(2):
        assert _generate(model, True, seed=seed, dtype=torch.bfloat16)[:2] == _generate(
            model, False, seed=seed, dtype=torch.bfloat16
        )[:2]
    assert compactions


def test_a_session_first_turn_never_compacts(compactions):
    # A multi-turn session keeps every row's cache for its later turns: the same first turn as generate().
    model = make_tiny_decoder(scale=1.0)
    engine = NativeGenerator(stop_check_interval=4, compact_decode=True)
    reference = _generate(model, False, seed=1)[0]
    with engine.session(model, PROMPTS, group_size=3, max_new_tokens=40, pad_id=0, stop_tokens=STOPS) as s:
        first = s.generate(list(range(12)), [[]] * 12, max_new_tokens=40, generator=torch.Generator().manual_seed(1))
        assert first.response_ids == reference
        ongoing = [i for i, r in enumerate(first.response_ids) if len(r) < 39][:3]
        s.generate(ongoing, [first.response_ids[i] + [7] for i in ongoing], max_new_tokens=5,
                   generator=torch.Generator().manual_seed(2))
    assert not compactions
