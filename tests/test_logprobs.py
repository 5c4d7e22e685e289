"""Chunked log-probabilities equal the full-logits computation, in value and in gradient."""

import pytest
import torch

from torchtune_grpo.models.logprobs import chunked_logprobs, sequence_logprobs
from tests.conftest import make_tiny_decoder


def _full_logprobs(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_full_values_and_grads(chunk_size, temperature):
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 9))

    out = chunked_logprobs(hidden, targets, proj, temperature=temperature, chunk_size=chunk_size, with_entropy=True)
    ref = _full_logprobs(proj(hidden), targets, temperature)
    # Chunked (the head applied to chunks of rows, a log-softmax per chunk) against the full logits: the same 16-term
    # dot products, possibly blocked otherwise, then log_softmax over 50: a few roundings at the logits' magnitude (|z|
    # / 0.7 <~ 6 here, 1 ulp = 4.8e-7). Bound: 1e-5 + 1e-5 relative (>= 20 ulp; measured 4.8e-7, 1 ulp, with AVX-512 and
    # AVX2 kernels) for logprobs and entropies.
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(proj(hidden) / temperature, -1)
    ref_entropy = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(out.entropy, ref_entropy, atol=1e-5, rtol=1e-5)

    w = torch.randn(3, 9)
    (g_chunk_h, g_chunk_w) = torch.autograd.grad((out.logprobs * w).sum(), [hidden, proj.weight])
    (g_ref_h, g_ref_w) = torch.autograd.grad((ref * w).sum(), [hidden, proj.weight])
    # Gradients: dh sums 50 vocab terms, dW 27 tokens' outer products (chunk by chunk here, at once there): a sum of n
    # terms regrouped is ~sqrt(n) ulp of its partial sums apart, <= |g| ~ 10 (ulp 9.5e-7): ~5e-6 at worst typical.
    # Bound: 1e-5 + 1e-4 relative (measured 1.9e-6).
    torch.testing.assert_close(g_chunk_h, g_ref_h, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_chunk_w, g_ref_w, atol=1e-5, rtol=1e-4)


def test_uniform_logits_give_log_vocab():
    # Zero projection -> uniform distribution over V=8: every logprob is -log 8, entropy log 8.
    proj = torch.nn.Linear(4, 8, bias=False)
    torch.nn.init.zeros_(proj.weight)
    out = chunked_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), proj, chunk_size=2, with_entropy=True)
    expected = torch.full((2, 3), -torch.log(torch.tensor(8.0)).item())
    torch.testing.assert_close(out.logprobs, expected)
    torch.testing.assert_close(out.entropy, -expected)


def test_sequence_logprobs_matches_model_logits():
    model = make_tiny_decoder()
    tokens = torch.randint(1, 97, (4, 12))
    full = _full_logprobs(model(tokens)[:, :-1], tokens[:, 1:])
    out = sequence_logprobs(model, tokens, chunk_size=5)
    # The same decoder forward on the same tokens (chunking splits only the head's rows): logits |z| up to ~150 (x4
    # weights, 1 ulp = 1.5e-5), a re-blocked head matmul a few ulp at most. Bound: 1e-4 (~7 ulp) + 1e-4 relative
    # (measured: bitwise equal).
    torch.testing.assert_close(out.logprobs, full, atol=1e-4, rtol=1e-4)
    # `start` skips leading predictions without changing the others.
    out3 = sequence_logprobs(model, tokens, start=3, chunk_size=4, with_entropy=True)
    assert out3.logprobs.shape == (4, 8) and out3.entropy.shape == (4, 8)
    torch.testing.assert_close(out3.logprobs, full[:, 3:], atol=1e-4, rtol=1e-4)
    # The model is left as it was: a plain forward gives logits again.
    assert model(tokens).shape == (4, 12, 97)


def test_sequence_logprobs_gradient_matches_full():
    model = make_tiny_decoder(scale=1.0).train()
    tokens = torch.randint(1, 97, (2, 10))
    lp = sequence_logprobs(model, tokens, start=2, chunk_size=3).logprobs
    g_chunk = torch.autograd.grad(lp.sum(), model.tok_embeddings.weight)[0]
    full = _full_logprobs(model(tokens)[:, 2:-1], tokens[:, 3:])
    g_full = torch.autograd.grad(full.sum(), model.tok_embeddings.weight)[0]
    # Embedding gradients of the x1 model (|g| <~ 7, ulp 4.8e-7): the backward sums ~20 tokens' contributions per row,
    # chunk by chunk against at once: ~sqrt(20) ulp of the partial sums, ~2e-6. Bound: 1e-4 + 1e-3 relative (measured
    # 9.5e-7).
    torch.testing.assert_close(g_chunk, g_full, atol=1e-4, rtol=1e-3)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), torch.nn.Linear(4, 3), chunk_size=0)
