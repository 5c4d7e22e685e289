"""The native engine's multi-turn sessions: continuing each episode's KV cache gives exactly what recomputing
the whole history every turn gives (tokens and logprobs), and later turns prefill only what was appended.

The reference is the same engine without sessions (``Resend``): run_episodes then re-sends every live
episode's prompt and history to ``generate`` each turn. The tiny decoder's weights are scaled up (x8) so
its greedy and sampled turns vary with the context instead of copying the last token; every id divisible
by 4 is a stop token, so turns end after a few tokens, at different lengths per episode.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import torchtune_grpo.generation._native as native
from tests.conftest import make_tiny_decoder
from tests.tolerances import ulps
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.multiturn import EnvReply
from torchtune_grpo.multiturn.episodes import run_episodes

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43], [20, 21]]  # left-padded to 6 in a batch
STOPS = list(range(4, 97, 4))
# Reply lengths per episode (its prompt's index) and turn; None: the environment ends the episode there.
# Episode 1 ends after its 2nd turn; the others would go on past max_turns = 3.
REPLY_LENGTHS = {0: [3, 7, None], 1: [1, None], 2: [6, 2, None], 3: [4, 5, 2]}


class IdTokenizer:
    pad_id, eot_id, stop_tokens = 0, None, STOPS  # eot_id None: any stop token ends a turn, not the episode

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class IdTurns:
    def reply_ids(self, messages):
        return [int(x) for m in messages for x in m["content"].split()]


class Replies:
    """Answers turn k of the episode of prompt ``id`` with ``REPLY_LENGTHS[id][k]`` made-up ids."""

    def start(self, fields):
        return {"id": fields["id"], "turn": 0}

    def step(self, state, message):
        i, k = state["id"], state["turn"]
        state["turn"] += 1
        n = REPLY_LENGTHS[i][k]
        if n is None:
            return EnvReply([], True, {})
        ids = [50 + (7 * i + 3 * k + j) % 40 for j in range(n)]
        return EnvReply([{"role": "user", "content": " ".join(map(str, ids))}], False, {})


class Resend(NativeGenerator):
    """The same engine without sessions: the reference path."""

    def session(self, *args, **kwargs):
        return None


def episodes(engine, model, prompts=PROMPTS, group_size=1, seed=None, budget=40):
    return run_episodes(
        engine, model, prompts, [{"id": i} for i in range(len(prompts))], env=Replies(), turns=IdTurns(),
        tokenizer=IdTokenizer(), group_size=group_size, max_new_tokens=budget, max_turns=3,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
    )


def runs(mask, value):
    """Lengths of the runs of ``value`` in ``mask``, in order."""
    out, n = [], 0
    for m in mask + [None]:
        if m == value:
            n += 1
        elif n:
            out, n = out + [n], 0
    return out


@pytest.fixture
def sampled_logprobs(monkeypatch):
    """Per engine call (a turn), per sampling step: the logprob of each sampled row's token ``[n]`` (NaN for
    the rows a compacting loop no longer decodes: they stopped)."""
    calls = []
    sample = native.sample_tokens

    def recording(logits, **kwargs):
        token = sample(logits, **kwargs)
        lp = torch.log_softmax(logits.float(), -1).gather(1, token[:, None])[:, 0]
        if kwargs.get("noise_rows") is not None:  # the compacting loop's live rows of its batch
            lp = torch.full((kwargs["noise_batch"],), float("nan")).index_copy(0, kwargs["noise_rows"], lp)
        calls[-1].append(lp)
        return token

    monkeypatch.setattr(native, "sample_tokens", recording)
    return calls


def turn_marking(cls, calls):
    """``cls`` whose every generate call (engine or session) opens a new entry in ``calls``."""

    class Marking(cls):
        def generate(self, *args, **kwargs):
            calls.append([])
            return super().generate(*args, **kwargs)

        def session(self, *args, **kwargs):
            session = super().session(*args, **kwargs)
            if session is not None:
                generate = session.generate
                session.generate = lambda *a, **k: (calls.append([]), generate(*a, **k))[1]
            return session

    return Marking


def logprobs_per_episode(eps, calls):
    """Each episode's recorded logprobs of its sampled tokens, in order (turn k samples the episodes with
    more than k turns; the first turn samples all of them)."""
    out = [[] for _ in eps.turns]
    for k, steps in enumerate(calls):
        lp = torch.stack(steps, 1)  # [rows, steps]
        rows = [i for i, n in enumerate(eps.turns) if n > k]
        for j, i in enumerate(rows):
            out[i] += lp[j, : runs(eps.action_mask[i], 1)[k]].tolist()
    return out


@pytest.mark.parametrize("share_prefill", [True, False], ids=["shared_prefix_layout", "per_row_layout"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("compact", [True, False], ids=["turns_run_live_rows", "turns_run_every_row"])
def test_continuation_equals_recomputing_every_history(share_prefill, sampling, compact, sampled_logprobs):
    # Logprobs agree to rounding, not bit for bit: the two paths run different batch shapes (a history's
    # keys/values computed in an earlier, differently padded forward). A logprob is a logit minus a
    # logsumexp, each a different-order fp32 result of ~9 matmuls (2 layers x 4, then the head) on logits
    # made large by the x8 weights (|logit| up to ~290, where 1 ulp = 3.4e-5): about sqrt(9) = 3 ulp each,
    # ~4-5 ulp apart typically. Bound: 16 ulp of the model's largest logit (measured: 1.3e-4 ~ 4 ulp with
    # AVX2 kernels, 8e-5 with AVX-512).
    model = make_tiny_decoder(scale=8.0)
    with torch.no_grad():
        atol = ulps(model(torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(1))), 16)
    temperature, group_size, seed = (0.0, 1, None) if sampling == "greedy" else (1.0, 2, 3)
    results = []
    for cls in (NativeGenerator, Resend):
        sampled_logprobs.clear()
        # compact: every turn of the session decodes its live rows only (a later turn the continued rows
        # alone, copied out of the session's caches and back; rows that stop leave at the stop checks).
        engine = turn_marking(cls, sampled_logprobs)(
            temperature=temperature, share_prefill=share_prefill, compact_decode=compact
        )
        eps = episodes(engine, model, group_size=group_size, seed=seed)
        results.append((eps, logprobs_per_episode(eps, sampled_logprobs)))
    (cont, cont_lps), (ref, ref_lps) = results
    assert cont.response_ids == ref.response_ids and cont.action_mask == ref.action_mask
    assert cont.turns == ref.turns and cont.truncated.tolist() == ref.truncated.tolist()
    for got, want, mask in zip(cont_lps, ref_lps, cont.action_mask):
        assert len(got) == len(want) == sum(mask)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=atol)
    # Not a trivial case: model turns of several lengths, replies of several lengths, episodes that the
    # environment ended early (prompt 1's, after 2 turns) beside ones that ran to max_turns.
    assert len({n for m in cont.action_mask for n in runs(m, 1)}) >= 3
    assert len({n for m in cont.action_mask for n in runs(m, 0)}) >= 3
    ended_early = [i for i, n in enumerate(cont.turns) if n < 3 and not cont.truncated[i]]
    assert ended_early and max(cont.turns) == 3


def forward_widths(model):
    """Record the ``[rows, tokens]`` shape of every model forward over more than one token (the prefills;
    a decode step feeds one token per row). The hook also makes decode steps take the model's forward."""
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)) if args[0].size(1) > 1 else None)
    return shapes


def test_later_turns_prefill_only_the_reply_and_the_last_sampled_token():
    # One episode: prompt 0 (6 tokens). Its first turn prefills the prompt; turn 2 the model's last token
    # (its stop token, sampled but never fed) and the 3-token reply: 1 + 3 = 4; turn 3: 1 + 7 = 8.
    model = make_tiny_decoder(scale=8.0)
    shapes = forward_widths(model)
    eps = episodes(NativeGenerator(temperature=0.0), model, prompts=PROMPTS[:1])
    assert eps.turns == [3] and runs(eps.action_mask[0], 0) == [3, 7]
    assert shapes == [(1, 6), (1, 4), (1, 8)]
    # Re-sending: every turn prefills the prompt and the whole history so far.
    shapes.clear()
    ref = episodes(Resend(temperature=0.0), model, prompts=PROMPTS[:1])
    first, second = runs(ref.action_mask[0], 1)[:2]
    assert shapes == [(1, 6), (1, 6 + first + 3), (1, 6 + first + 3 + second + 7)]


@pytest.mark.parametrize("compact", [True, False])
def test_rows_of_different_lengths_append_one_block_as_wide_as_the_longest_reply(compact):
    # Four episodes: each later turn is one [n, M] forward, M = 1 + the longest reply among the episodes
    # still running: turn 2 replies 3, 1, 6, 4 -> M = 7; turn 3 (episode 1 ended) replies 7, 2, 5 -> M = 8,
    # over the 3 running episodes (compact_decode) or all 4, the ended one fed padding.
    model = make_tiny_decoder(scale=8.0)
    shapes = forward_widths(model)
    eps = episodes(NativeGenerator(temperature=0.0, compact_decode=compact), model)
    assert eps.turns[1] == 2 and min(eps.turns[i] for i in (0, 2, 3)) == 3
    assert shapes == [(4, 6), (4, 7), (3 if compact else 4, 8)]


@pytest.mark.parametrize("share_prefill", [True, False], ids=["shared_prefix_layout", "per_row_layout"])
def test_a_turn_over_some_rows_of_some_groups_equals_the_full_batch_turn(share_prefill):
    # Groups of 3; turn 2 continues whole group 1 (rows 3-5, its prompt stays shared) and one row each of
    # groups 0 and 3 (they get their own prompt copy), in an unsorted order; turn 3 continues two of them.
    # The same tokens and the same generator state as the turn run over all 12 rows, and the caches
    # written back serve turn 3.
    model = make_tiny_decoder(scale=8.0)
    results = []
    for compact in (True, False):
        engine = NativeGenerator(temperature=1.0, share_prefill=share_prefill, compact_decode=compact)
        gen = torch.Generator().manual_seed(5)
        with engine.session(model, PROMPTS, group_size=3, max_new_tokens=40, pad_id=0, stop_tokens=STOPS) as s:
            first = s.generate(list(range(12)), [[]] * 12, max_new_tokens=12, generator=gen)
            hist = {i: list(r) + [51, 52 + i] for i, r in enumerate(first.response_ids)}
            rows2 = [9, 3, 4, 5, 1]
            second = s.generate(rows2, [hist[i] for i in rows2], max_new_tokens=12, generator=gen)
            rows3 = [4, 9]
            resp3 = [hist[i] + list(second.response_ids[rows2.index(i)]) + [60] for i in rows3]
            third = s.generate(rows3, resp3, max_new_tokens=12, generator=gen)
        results.append((second.response_ids, third.response_ids, torch.rand(4, generator=gen)))
    (a2, a3, a_next), (b2, b3, b_next) = results
    assert a2 == b2 and a3 == b3 and torch.equal(a_next, b_next)
    assert len({len(r) for r in a2}) > 1  # turns of several lengths: not a trivial case


def forward_batches(model):
    """Record every model forward as ``(rows, tokens)``; a multi-token forward starts a turn (a prefill or
    a later turn's append), one-token forwards are its decode steps."""
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    return shapes


def decode_batches_per_turn(shapes):
    """The decode steps' batch sizes of each turn, from :func:`forward_batches`' record."""
    turns = []
    for rows, tokens in shapes:
        if tokens > 1:
            turns.append([])
        else:
            turns[-1].append(rows)
    return turns


@pytest.mark.parametrize("share_prefill", [True, False], ids=["shared_prefix_layout", "per_row_layout"])
def test_rows_that_stop_leave_the_batch_within_every_turn_and_keep_their_caches(share_prefill):
    # Stop checks at every token: whenever a quarter of the decode batch or more has stopped, those rows
    # leave it, within the first turn and within later ones. Their caches are written back to the
    # session first, so the next turn, which continues them, reads what they wrote (a row stopping in a
    # second compacted batch lives only in a copy until then). The same episodes as the session with every
    # row in every decode step and as re-sending every history.
    model = make_tiny_decoder(scale=8.0)
    shapes = forward_batches(model)
    kw = dict(temperature=1.0, share_prefill=share_prefill, stop_check_interval=1)
    got = episodes(NativeGenerator(**kw), model, group_size=3, seed=11)
    turns = decode_batches_per_turn(shapes)
    full = episodes(NativeGenerator(compact_decode=False, **kw), model, group_size=3, seed=11)
    ref = episodes(Resend(compact_decode=False, **kw), model, group_size=3, seed=11)
    for other in (full, ref):
        assert got.response_ids == other.response_ids and got.action_mask == other.action_mask
        assert got.turns == other.turns and got.truncated.tolist() == other.truncated.tolist()
    # Three turns, each decode batch shrinking within the turn: the first from all 12 rows, the later
    # ones from the rows they continue (episode 1's 3 rows end after turn 2), at least twice per turn, so
    # rows also left copies (written back before they were dropped).
    assert len(turns) == 3 and turns[0][0] == 12 and turns[2][0] <= 9
    for steps in turns:
        assert steps == sorted(steps, reverse=True) and len(set(steps)) >= 3, turns
    assert max(got.turns) == 3 and sum(got.turns) > 12 + 9  # later turns continued rows that left a batch


def test_a_session_reuses_the_longest_cached_prefix_of_any_history():
    # A continued history that departs from what the session returned (here: the first turn's tokens
    # replaced after its first one) reuses the cached common prefix and recomputes the rest: the same
    # tokens as generating from the whole history.
    model = make_tiny_decoder(scale=8.0)
    engine = NativeGenerator(temperature=0.0)
    kw = dict(pad_id=0, stop_tokens=STOPS)
    with engine.session(model, PROMPTS, group_size=1, max_new_tokens=30, **kw) as session:
        first = session.generate(range(4), [[]] * 4, max_new_tokens=10)
        histories = [first.response_ids[0] + [55, 56], first.response_ids[2][:1] + [61, 62, 63]]
        out = session.generate([0, 2], histories, max_new_tokens=10)
    ref = engine.generate(model, [PROMPTS[0] + histories[0], PROMPTS[2] + histories[1]], group_size=1,
                          max_new_tokens=10, **kw)
    assert out.response_ids == ref.response_ids
    assert out.prompt_ids == [PROMPTS[0] + histories[0], PROMPTS[2] + histories[1]]


def test_session_errors_name_the_problem():
    model = make_tiny_decoder()
    session = NativeGenerator(temperature=0.0).session(
        model, PROMPTS[:2], group_size=2, max_new_tokens=8, pad_id=0, stop_tokens=STOPS
    )
    with pytest.raises(ValueError, match="first turn of a session samples every row from its prompt: rows must be 0 .. 3"):
        session.generate([0, 1], [[], []], max_new_tokens=4)
    session.generate(range(4), [[]] * 4, max_new_tokens=4)
    with pytest.raises(ValueError, match="row 2: an empty response cannot be continued"):
        session.generate([2], [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="row 1: 8 tokens leave no room in the session's budget of 8"):
        session.generate([1], [[1] * 8], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"distinct indices in \[0, 4\)"):
        session.generate([4], [[1]], max_new_tokens=4)
    session.close()
    with pytest.raises(RuntimeError, match="session is closed"):
        session.generate([0], [[1]], max_new_tokens=4)


def test_an_open_session_owns_the_engine_cache():
    # generate() or a second session on the same engine would overwrite the open session's keys and values:
    # refused, naming the fix; after close() both work and the session's turns were not disturbed.
    model = make_tiny_decoder(scale=8.0)
    engine = NativeGenerator(temperature=0.0)
    kw = dict(pad_id=0, stop_tokens=STOPS)
    session = engine.session(model, PROMPTS, group_size=1, max_new_tokens=30, **kw)
    first = session.generate(range(4), [[]] * 4, max_new_tokens=10)
    for call in (lambda: engine.generate(model, PROMPTS, group_size=1, max_new_tokens=4, **kw),
                 lambda: engine.session(model, PROMPTS, group_size=1, max_new_tokens=4, **kw),
                 engine.release_cache):
        with pytest.raises(RuntimeError, match=r"NativeGenerator\.(generate|session|release_cache)\(\): this engine "
                                               r"has an open multi-turn session .* close it first"):
            call()
    history = first.response_ids[0] + [55, 56]
    out = session.generate([0], [history], max_new_tokens=10)
    session.close()
    ref = engine.generate(model, [PROMPTS[0] + history], group_size=1, max_new_tokens=10, **kw)
    assert out.response_ids == ref.response_ids
    whole = engine.generate(model, PROMPTS, group_size=1, max_new_tokens=4, **kw)
    with engine.session(model, PROMPTS, group_size=1, max_new_tokens=4, **kw) as again:
        assert again.generate(range(4), [[]] * 4, max_new_tokens=4).response_ids == whole.response_ids


def test_budget_ends_each_row_and_the_cache_is_sized_from_it():
    # Budget 12: the first turn samples up to 12 tokens; a row continued with 10 tokens has room for 2,
    # whatever max_new_tokens says, and is truncated there (no stop token). The cache holds the budget.
    model = make_tiny_decoder(scale=8.0)
    engine = NativeGenerator(temperature=0.0, cache_len_multiple=1)
    with engine.session(model, PROMPTS, group_size=1, max_new_tokens=12, pad_id=0, stop_tokens=[96]) as s:
        s.generate(range(4), [[]] * 4, max_new_tokens=12)
        assert engine.cache.capacities == [6, 12]  # shared-prefix layout: prompts [B, 6], completions [N, 12]
        out = s.generate([1], [[30] * 10], max_new_tokens=12)
    assert len(out.response_ids[0]) == 2 and out.truncated.tolist() == [True]
    ref = engine.generate(model, [PROMPTS[1] + [30] * 10], group_size=1, max_new_tokens=2, pad_id=0,
                          stop_tokens=[96])
    assert out.response_ids == ref.response_ids


def test_compiled_continuation_is_one_more_graph_and_exact():
    # The CUDA path compiles the decode steps; on CPU the same tracing runs with aot_eager. Later turns
    # decode with per-row write slots: one more graph (the first turn's is the other), none per turn or
    # live count, no graph break, and the tokens of the eager reference.
    torch._dynamo.reset()
    counters.clear()
    model = make_tiny_decoder(scale=8.0)
    compiled = NativeGenerator(temperature=0.0, share_prefill=False, compile_decode=True, compile_backend="aot_eager")
    got = episodes(compiled, model, budget=24)
    ref = episodes(Resend(temperature=0.0), model, budget=24)
    assert got.response_ids == ref.response_ids and max(got.turns) == 3
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()

