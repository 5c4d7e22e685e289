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
    # 1.5e-5: the fixed paths measured up to 4.4e-6 (generic path; the summation order, hence the last bits,
    # depends on the thread count), the old code 5e-5 and more.
    torch.testing.assert_close(out.entropy[0].double(), ref, rtol=0, atol=1.5e-5)
    # (logprobs carry the fp32 rounding of logits ~100 themselves: ulp 8e-6)
    torch.testing.assert_close(out.logprobs[0].double(), log_p.gather(-1, targets[0, :, None])[:, 0], rtol=0, atol=1e-4)
