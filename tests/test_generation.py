"""The native engine: sampling filters, greedy equivalence with the unbatched path, stop handling."""

import ctypes

import torch
from torchtune.generation import generate

from torchtune_grpo.generation import NativeGenerator, sample_tokens
from torchtune_grpo.training.batch import pack_sequences
from tests.conftest import make_tiny_decoder


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert sample_tokens(logits, temperature=0.0).tolist() == [1, 0]


def test_top_k_and_top_p_exclude_tokens():
    # probs = softmax(log([0.5, 0.3, 0.15, 0.05])) = [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample_tokens(logits, top_k=2, generator=gen)
    assert set(top2.tolist()) == {0, 1}
    # top_p=0.7: mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 >= 0.7 (dropped).
    nucleus = sample_tokens(logits, top_p=0.7, generator=gen)
    assert set(nucleus.tolist()) == {0, 1}
    # Frequencies follow the renormalised probabilities 0.5/0.8 = 0.625 and 0.375.
    assert abs((nucleus == 0).float().mean().item() - 0.625) < 0.05
    # top_p small keeps only the most likely token.
    assert set(sample_tokens(logits, top_p=0.1, generator=gen).tolist()) == {0}


def _keep_freed_memory() -> None:
    """Where the C library is glibc: keep freed memory in this process's heap (``mallopt``: blocks up to 32 MiB
    from the heap, its top returned to the system only beyond 64 MiB). With glibc's defaults, the sampler's few
    MiB per call are mapped afresh on every call and each page faulted in again: ~85 % of a small call's time.
    Process-wide, like glibc's own adaptive thresholds after a large free (its limits: 32 MiB and twice that)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the test only runs slower
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 64 << 20)


def test_sampling_draws_improbable_tokens_at_their_probability():
    # Issue "the late learning gap": the sampler drew tokens of probability ~1e-7 about half as often as
    # their probability (an exponential race on float32 uniforms). Here 16,383 tokens of p = 2.5e-8 each
    # (tail mass 4.1e-4) and one of p ~ 0.9996: 98,304 draws expect 40.3 tail tokens (sd 6.3). Bound: 4 sd
    # (Poisson tails: a correct sampler fails 1 time in 8,000). The old race's -log U lies on a lattice of step
    # d = 2^-24 near 0, so a tail token won with E[floor(c E)] / E[c E] = 1 / (c (e^(1/c) - 1)) of its probability,
    # c = p / d: 0.52 at p = 5e-8 (the ~56 of 107 tail draws seen when this test drew 131,072 rows at that p), 0.24
    # here: ~9.8 draws expected, 30 short = 4.8 sd, and the bound (> 14.9) passes it 1 time in 14 (131,072 draws
    # at 5e-8: 5.0 sd, 1 time in 11,000 and 1 in 10). The draws that power needs are fewest near p = 2.5e-8 (the
    # old shortfall (1 - r) sqrt(lambda) per drawn row peaks there), and each row costs a pass over the vocabulary.
    # The 98,304 rows go in 6,144 calls of 16 rows, with freed memory kept in the heap (_keep_freed_memory): a
    # call's tensors (probabilities, their float64 copy and cumulative sum: ~5 MiB) are then reused memory in the
    # cache, ~8x faster than 96 calls of 1,024 rows (~320 MiB a call, each page newly mapped and faulted in, every
    # pass from memory: 13-24 s). The same number of independent rows, one float64 uniform each from one
    # generator: the same draw distribution and bound.
    _keep_freed_memory()
    vocab, p_tail, rows, chunks = 16384, 2.5e-8, 16, 6144
    probs = torch.full((vocab,), p_tail, dtype=torch.float64)
    probs[0] = 1.0 - p_tail * (vocab - 1)
    # Materialised rows (not a stride-0 expand, ~15% slower through the sampler's softmax): the same draws.
    logits = probs.log().float().expand(rows, vocab).contiguous()
    gen = torch.Generator().manual_seed(0)
    tail = sum(int((sample_tokens(logits, generator=gen) != 0).sum()) for _ in range(chunks))
    expected = rows * chunks * p_tail * (vocab - 1)
    assert abs(tail - expected) < 4 * expected**0.5, (tail, expected)


def test_the_largest_uniform_still_draws_a_kept_token(monkeypatch):
    # The edge of the inverse CDF: at the largest uniform the draw is the last token with probability > 0
    # (not one past the end, not a token top-k removed). Every uniform is forced to the largest float64 < 1.
    logits = torch.tensor([[0.0, 3.0, 0.5, -1.0, -2.0]]).repeat(8, 1)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, 1 - 2**-53, dtype=kw["dtype"]))
    assert sample_tokens(logits).tolist() == [4] * 8
    assert sample_tokens(logits, top_k=3).tolist() == [2] * 8  # tokens 3 and 4 removed: the last kept is 2


def test_sampling_is_reproducible_with_a_generator():
    logits = torch.randn(16, 50)
    a = sample_tokens(logits, generator=torch.Generator().manual_seed(3))
    b = sample_tokens(logits, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_batched_greedy_equals_single_prompt_generation():
    model = make_tiny_decoder()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]
    engine = NativeGenerator(temperature=0.0, stop_check_interval=3)
    rollout = engine.generate(
        model, prompts, group_size=2, max_new_tokens=10, pad_id=0, stop_tokens=[96]
    )
    assert len(rollout.response_ids) == 6
    for i, prompt in enumerate(prompts):
        # Left padding in the batch must not change a prompt's greedy continuation.
        ref, _ = generate(model, torch.tensor([prompt]), max_generated_tokens=10, pad_id=0, temperature=1e-6, top_k=1)
        expected = ref[0, len(prompt):].tolist()
        assert rollout.response_ids[2 * i] == expected
        assert rollout.response_ids[2 * i + 1] == expected
    assert rollout.prompt_ids[3] == prompts[1]


def test_stop_token_ends_response_and_is_kept():
    model = make_tiny_decoder()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    greedy = NativeGenerator(temperature=0.0).generate(
        model, prompts, group_size=1, max_new_tokens=8, pad_id=0, stop_tokens=[96]
    )
    # Make the 3rd greedy token of prompt 0 a stop token: its response must end right there.
    stop = greedy.response_ids[0][2]
    rollout = NativeGenerator(temperature=0.0).generate(
        model, prompts, group_size=1, max_new_tokens=8, pad_id=0, stop_tokens=[stop]
    )
    first = greedy.response_ids[0].index(stop)
    assert rollout.response_ids[0] == greedy.response_ids[0][: first + 1]
    assert not rollout.truncated[0]
    if stop not in greedy.response_ids[1]:
        assert rollout.truncated[1] and len(rollout.response_ids[1]) == 8


def test_pack_sequences_layout():
    tokens, mask = pack_sequences([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert mask.tolist() == [[False, False, False, True, True], [False, True, True, True, False]]


def test_decode_responses_drops_undecodable_ids_and_tries_each_alone_once():
    from torchtune_grpo.generation import decode_responses

    class Tok:  # decodes ids < 10 as letters; anything else raises, like a tokenizer past its vocabulary
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Tok.calls += 1
            if any(i >= 10 for i in ids):
                raise KeyError(max(ids))
            return "".join("abcdefghij"[i] for i in ids)

    tok = Tok()
    assert decode_responses(tok, [[0, 1, 2], [3, 50, 4, 50, 77]]) == ["abc", "de"]
    # 1 + (1 failed + 4 unique ids alone + 1 final) calls; the bad ids are remembered for this tokenizer:
    assert Tok.calls == 7
    Tok.calls = 0
    assert decode_responses(tok, [[50, 5, 77, 6]] * 3) == ["fg"] * 3
    assert Tok.calls == 3  # one call per completion, none per token
    Tok.calls = 0
    assert decode_responses(Tok(), [[50, 5]]) == ["f"] and Tok.calls == 4  # another tokenizer: fresh memory
