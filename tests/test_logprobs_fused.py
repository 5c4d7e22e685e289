"""The fused chunked logprob function (manual gradients) equals the generic checkpointed path."""

import pytest
import torch
from torchtune.modules import TiedLinear

from torchtune_grpo.models.logprobs import _projection_weight, chunked_logprobs, sequence_logprobs
from tests.conftest import make_tiny_decoder


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_values_and_gradients_match_the_generic_path(tied, with_entropy, entropy_grad, temperature):
    torch.manual_seed(0)
    d, v = 16, 50
    emb = torch.nn.Embedding(v, d)
    lin = torch.nn.Linear(d, v, bias=False)
    proj = TiedLinear(emb) if tied else lin
    weight = emb.weight if tied else lin.weight
    hidden = torch.randn(2, 13, d, requires_grad=True)
    targets = torch.randint(0, v, (2, 13))
    g_lp, g_ent = torch.randn(2, 13), torch.randn(2, 13)
    results = []
    for fused in (True, False):
        hidden.grad, weight.grad = None, None
        # chunk_size 5 does not divide 26 tokens: the last chunk is partial.
        out = chunked_logprobs(
            hidden, targets, proj, temperature=temperature, chunk_size=5,
            with_entropy=with_entropy, entropy_grad=entropy_grad, fused=fused,
        )
        loss = (out.logprobs * g_lp).sum()
        if with_entropy:
            loss = loss + (out.entropy * g_ent).sum()
        loss.backward()
        results.append((out, hidden.grad.clone(), weight.grad.clone()))
    (fused_out, fused_dh, fused_dw), (ref_out, ref_dh, ref_dw) = results
    # The fused path computes log-softmax, entropy and the gradients (p - onehot) / T by hand chunk by chunk, the
    # generic one through autograd: other op orders at the logits' magnitude (|z| / 0.7 <~ 23 for the logprobs, 1 ulp =
    # 1.9e-6) and the gradients' (<~ 9, 1 ulp 9.5e-7), where dW sums 26 tokens and dh 50 vocab terms (~sqrt(n) ulp of
    # the partial sums: ~5e-6). Bounds: assert_close's fp32 default (1e-5 + 1.3e-6 relative) for the logprobs, 1e-4 +
    # 1e-5 relative for the entropy and gradients (measured: 1.9e-6 and 2.7e-6).
    torch.testing.assert_close(fused_out.logprobs, ref_out.logprobs)
    if with_entropy:
        torch.testing.assert_close(fused_out.entropy, ref_out.entropy, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused_dh, ref_dh, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused_dw, ref_dw, rtol=1e-5, atol=1e-4)


def test_only_plain_linear_projections_take_the_fused_path():
    assert _projection_weight(torch.nn.Linear(4, 8, bias=False)) is not None
    assert _projection_weight(TiedLinear(torch.nn.Embedding(8, 4))) is not None
    assert _projection_weight(torch.nn.Linear(4, 8, bias=True)) is None
    assert _projection_weight(lambda h: h) is None


def test_sequence_logprobs_of_a_decoder_match_with_and_without_fusion():
    model = make_tiny_decoder()
    tokens = torch.randint(1, 90, (3, 11))
    grads = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            out = sequence_logprobs(model, tokens, start=2, with_entropy=True, chunk_size=7)
        else:
            # The generic path, as before fusion: per-chunk checkpointing.
            import torchtune_grpo.models.logprobs as lp

            original = lp._projection_weight
            lp._projection_weight = lambda project: None
            try:
                out = sequence_logprobs(model, tokens, start=2, with_entropy=True, chunk_size=7)
            finally:
                lp._projection_weight = original
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append((out.logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    # Same gradients up to fp32 rounding (this decoder's weights are scaled up 4x, so they are large).
    for a, b in zip(grads[0][1], grads[1][1]):
        # Each parameter's gradient sums contributions of 27 positions and 97 vocab entries through 2 layers, fused and
        # generic (other op orders): ~sqrt(n) ulp of the partial sums, below the tensor's largest element, plus a few
        # ulp carried from the forward. Bound: 1e-4 of each tensor's largest element (~840 ulp; far above).
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, True), (True, True)])
def test_a_single_chunk_keeps_its_logits_and_gives_the_same_gradients(with_entropy, entropy_grad):
    # 26 tokens in one chunk (logits kept from forward) vs chunks of 4 (recomputed in backward); backward
    # runs twice on the kept logits (retain_graph) and must not consume them.
    torch.manual_seed(1)
    d, v = 16, 50
    lin = torch.nn.Linear(d, v, bias=False)
    hidden = torch.randn(2, 13, d, requires_grad=True)
    targets = torch.randint(0, v, (2, 13))
    g_lp, g_ent = torch.randn(2, 13), torch.randn(2, 13)
    grads = []
    for chunk_size in (512, 4):
        hidden.grad, lin.weight.grad = None, None
        out = chunked_logprobs(
            hidden, targets, lin, temperature=0.7, chunk_size=chunk_size, with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        loss = (out.logprobs * g_lp).sum() + ((out.entropy * g_ent).sum() if with_entropy else 0)
        loss.backward(retain_graph=True)
        first = (hidden.grad.clone(), lin.weight.grad.clone())
        loss.backward()
        torch.testing.assert_close(hidden.grad, 2 * first[0])
        grads.append(first)
    # One chunk of 26 tokens against chunks of 4: dh per token is the same 50-term sum (a re-blocked matmul: a few ulp
    # at |dh| <~ 0.7, 1 ulp 6e-8); dW sums the 26 tokens' outer products at once or 4 by 4: ~sqrt(26) = 5 ulp of the
    # partial sums at |dW| <~ 5.5 (1 ulp 4.8e-7) typically. Bound: 1e-6 + 1e-5 relative (measured: 1.9e-6 at |dW| ~ 5,
    # 0.16 of the bound, with AVX-512 and AVX2 kernels).
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("single_chunk", [True, False])
def test_entropy_is_exact_when_logits_are_large(fused, single_chunk):
    # Real models' logits sit far from 0 (SmolLM2-135M: ~20-50). Entropy is shift-invariant, but
    # lse - sum_v p_v z_v in fp32 sums terms of the size of the logits: with every logit shifted by +100 it
    # was off by 5e-5 (generic) to 3e-4 (fused, CPU einsum) nats; benchmarks/learning_parity_checks.py found
    # 7.6e-3 on SmolLM2 against a float64 reference. Reference: float64 -sum p log p of the same logits.
    torch.manual_seed(0)
    d, v, t = 16, 8192, 24
    lin = torch.nn.Linear(d, v, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.5)
        lin.weight[:, 0] = 100.0  # hidden unit 0 is 1 below: +100 on every logit
    hidden = torch.randn(1, t, d)
    hidden[..., 0] = 1.0
    hidden.requires_grad_(True)
    targets = torch.randint(0, v, (1, t))
    out = chunked_logprobs(hidden, targets, lin, chunk_size=t if single_chunk else 5, with_entropy=True,
                           entropy_grad=False, fused=fused)
    # The same fp32 logits, then float64: what is measured is the entropy's arithmetic, not the logits' rounding.
    with torch.no_grad():
        logits = lin(hidden)[0].double()  # [t, V]
    log_p = torch.log_softmax(logits, dim=-1)
    ref = -(log_p.exp() * log_p).sum(-1)
    assert float(ref.min()) > 1.0  # not degenerate: over a nat of spread at every position
    # The entropy of logits shifted to their max is a p-weighted sum over 8192 entries of terms <~ 10: its
    # rounding is relative to the partial sums (<= the entropy, ~8: 1 ulp 9.5e-7), and only the few hundred
    # entries with non-negligible p contribute: ~sqrt(300) / 2 ulp ~ 1e-5 at worst typically. Bound: 1.5e-5 (16
    # ulp of the entropy). Measured: up to 4.4e-6 (generic path; the summation order, hence the last bits,
    # depends on the thread count), 8.5e-7 with AVX-512 and 1.2e-6 with AVX2 kernels here; the old unshifted
    # code 5e-5 and more.
    torch.testing.assert_close(out.entropy[0].double(), ref, rtol=0, atol=1.5e-5)
    # A logprob is z_t - lse with z ~ 100: fp32 rounds the logsumexp and the difference at ~110 (1 ulp 7.6e-6),
    # ~2 ulp against float64 on the same logits. Bound: 1e-4 (~13 ulp; measured 3.9e-6).
    torch.testing.assert_close(out.logprobs[0].double(), log_p.gather(-1, targets[0, :, None])[:, 0], rtol=0, atol=1e-4)
