"""The compacting decode loop (`NativeGenerator(compact_decode=True)`, generation/_compact.py).

Rows that stopped leave the decode batch; the tokens, the truncation flags and the generator's state after
the rollout are the same as the plain loop's, token for token: greedy and seeded (plain, top-k, top-p), in
the shared-prefix layout (fp32), the per-row layout (`share_prefill: false`, and bf16), and the first turn
of a multi-turn session (which compacts copies of its rows: its caches live on; the later turns:
tests/test_multiturn_continuation.py). A spy checks that the batch really shrank.
"""

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.generation import _rollout_caches
from torchtune_grpo.generation._compact import compacting_decode_loop

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [40]]
STOPS = list(range(30, 42))  # ~12% of the vocabulary: rows stop at scattered lengths


@pytest.fixture
def compactions(monkeypatch):
    """Row counts kept by every ``compact`` call of either layout."""
    seen = []
    for cls in (_rollout_caches.SharedPrefixRollout, _rollout_caches.PerRowRollout):
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


def test_a_session_first_turn_compacts_copies_and_keeps_every_cache(compactions, monkeypatch):
    # A multi-turn session keeps every row's cache for its later turns: its first turn never drops rows
    # (no compact() call) but decodes copies of the live rows (select_rows), written back as rows leave.
    # The same first turn as generate(), and a later turn of rows that stopped early reads their caches.
    selected = []
    for cls in (_rollout_caches.SharedPrefixRollout, _rollout_caches.PerRowRollout):
        original = cls.select_rows
        monkeypatch.setattr(cls, "select_rows", lambda self, rows, o=original: (selected.append(rows.numel()), o(self, rows))[1])
    model = make_tiny_decoder(scale=1.0)
    engine = NativeGenerator(stop_check_interval=4, compact_decode=True)
    reference = _generate(model, False, seed=1)[0]
    with engine.session(model, PROMPTS, group_size=3, max_new_tokens=60, pad_id=0, stop_tokens=STOPS) as s:
        first = s.generate(list(range(12)), [[]] * 12, max_new_tokens=40, generator=torch.Generator().manual_seed(1))
        assert first.response_ids == reference
        assert selected and min(selected) < 12 and not compactions, (selected, compactions)
        early = sorted(range(12), key=lambda i: len(first.response_ids[i]))[:3]  # left the batch first
        histories = [first.response_ids[i] + [7] for i in early]
        later = s.generate(early, histories, max_new_tokens=5)
    resend = engine.generate(model, [PROMPTS[i // 3] + h for i, h in zip(early, histories)], group_size=1,
                             max_new_tokens=5, pad_id=0, stop_tokens=STOPS)
    assert later.response_ids == resend.response_ids


def test_a_row_out_of_room_is_done_but_not_stopped():
    # Greedy over scripted logits: every row's best token is 7, except row 2's 4th token, the stop token 9.
    # room [2, 5, 9]: rows 0 and 1 take 2 and 5 tokens, then padding, without stopping; they leave the batch
    # like stopped rows. The same as the plain loop, which feeds every row to the end.
    vocab, stop = 10, torch.tensor([9])

    def scripted(rows, t):  # [n, V] the next logits of batch rows ``rows`` after token t
        logits = torch.zeros(len(rows), vocab)
        logits[:, 7] = 1.0
        for j, r in enumerate(rows):
            if r == 2 and t + 1 == 3:
                logits[j, 9] = 2.0
        return logits

    live = [0, 1, 2]
    kept = []

    def compact(keep):
        kept.append(keep.tolist())
        live[:] = [live[k] for k in keep.tolist()]

    room = torch.tensor([2, 5, 9])
    kw = dict(max_new_tokens=8, pad_id=0, stop=stop, temperature=0.0, top_k=None, top_p=1.0,
              stop_check_interval=1, generator=None)
    out, stopped = compacting_decode_loop(scripted(live, -1), lambda tok, t: scripted(live, t), compact, room=room, **kw)
    assert out.tolist() == [[7, 7, 0, 0, 0], [7, 7, 7, 7, 7], [7, 7, 7, 9, 0]]
    assert stopped.tolist() == [False, False, True]
    assert kept == [[1, 2], [0]]  # row 0 after its 2nd token; row 2 after its stop token
    engine = NativeGenerator(temperature=0.0, stop_check_interval=1)
    plain = engine.decode_loop(scripted([0, 1, 2], -1), lambda tok, t: scripted([0, 1, 2], t), 8, 0, stop, 0.0,
                                None, room=room)
    assert out.tolist() == plain[0].tolist() and stopped.tolist() == plain[1].tolist()
