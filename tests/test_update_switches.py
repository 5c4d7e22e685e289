"""The update's switches (docs/gpu.md, "The update switches"): each computes what today's path computes, to a
stated tolerance, and keeps the update independent of how its rows are split.

- ``logprob_head: bf16``: the fused head's products on bf16-rounded inputs with fp32 accumulation, against a
  float64 evaluation of the same rounded inputs (logprobs, entropy, both gradients) and, per token, against
  the fp32 head;
- the ``auto`` checkpointing decision and the checkpointed layers, by hand;
- each switch: a token-budget split of the update gives the weights of one micro-batch per mini-batch, in
  the shared-prompt and the packed layouts.

Checkpointing and compiling give the same numbers bit for bit, and the recipe with every switch on:
tests/test_update_switches_exact.py (outside the second-kernel pass: exact comparisons of one kernel set).
"""

import copy
from typing import Dict

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.loss import GRPOLoss
from torchtune_grpo.models.compiled import compile_decoder_layers
from torchtune_grpo.models.logprobs import chunked_logprobs, head_matmul_kernel, set_head_precision
from torchtune_grpo.runtime.compute import (
    apply_activation_checkpointing, checkpointed_layers, MemoryEstimate, resolve_activation_checkpointing,
    training_memory_estimate,
)
from torchtune_grpo.training.batch import batch_token_logprobs, TrainingBatch
from torchtune_grpo.training.experience import Experience
from torchtune_grpo.training.update import PolicyUpdate

G = 3


def groups_of_rows(seed: int = 0, groups: int = 4):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = torch.randint(1, 97, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            prompts.append(p)
            n = int(torch.randint(2, 30, (1,), generator=g))
            responses.append(torch.randint(1, 97, (n,), generator=g).tolist())
    return prompts, responses


def bf16_head_against_float64(device: torch.device) -> Dict[str, float]:
    """The bf16 head on ``device`` against a float64 evaluation (CPU) of the same bf16-rounded inputs: each
    error over its bound (<= 1 passes), the kernel used. Also run on the GPU (tests/test_gpu.py).

    Only fp32 rounding is left: a logit is a 64-term dot product of exact bf16 x bf16 products (they fit fp32's
    24 bits), rounded up to 64 times at the size of sum_i |h_i w_i|; the log-sum-exp and the gather add a few
    ulp of the largest logit. Bound on logprobs and entropies: 80 ulp of max_v sum_i |h_i w_vi|. Gradients:
    backward rounds the logits' gradient dz to bf16 (relative 2^-9 per element) before the two products, so
    |d grad_h| <= 2^-9 |dz| @ |W| plus fp32 sums far below it; bound 2^-8 |dz| @ |W| per element, and
    2^-8 |dz|^T @ |h| for grad_W.
    """
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 64, generator=g)
    w = torch.randn(300, 64, generator=g) * 0.3
    y = torch.randint(0, 300, (2, 37), generator=g)
    coef = torch.randn(2, 37, 2, generator=g, dtype=torch.float64)  # the loss's weights on logprob and entropy
    hb, wb = h.bfloat16().double().requires_grad_(), w.bfloat16().double().requires_grad_()

    def loss(z):
        logp = torch.log_softmax(z, -1)
        ent = -(logp.exp() * logp).sum(-1)
        return (coef[..., 0] * logp.gather(-1, y[..., None])[..., 0] + coef[..., 1] * ent).sum(), logp, ent

    z = (hb @ wb.t()) / 0.7
    total, ref_logp, ref_ent = loss(z)
    total.backward()
    dz = torch.autograd.functional.vjp(lambda zz: loss(zz)[0], z.detach())[1].abs() / 0.7  # |dL/dlogits|
    scale = float((hb.detach().abs() @ wb.detach().abs().t()).max())
    ratios = {"logprob": 0.0, "entropy": 0.0, "grad_h": 0.0, "grad_w": 0.0}
    for chunk in (5, 512):  # recomputed chunk by chunk in backward, and one chunk kept from forward
        lin = torch.nn.Linear(64, 300, bias=False, device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
        hh = h.to(device, copy=True).requires_grad_()
        out = chunked_logprobs(hh, y.to(device), lin, temperature=0.7, chunk_size=chunk, with_entropy=True,
                               head_precision="bf16")
        c = coef.float().to(device)
        (c[..., 0] * out.logprobs + c[..., 1] * out.entropy).sum().backward()
        atol = 80 * torch.finfo(torch.float32).eps * scale
        ref_lp = ref_logp.detach().gather(-1, y[..., None])[..., 0]
        errors = {
            "logprob": (out.logprobs.double().cpu() - ref_lp).abs() / atol,
            "entropy": (out.entropy.double().cpu() - ref_ent.detach()).abs() / atol,
            "grad_h": (hh.grad.double().cpu() - hb.grad).abs() / (2**-8 * (dz @ wb.detach().abs())),
            "grad_w": (lin.weight.grad.double().cpu() - wb.grad).abs()
            / (2**-8 * (dz.reshape(-1, 300).t() @ hb.detach().abs().reshape(-1, 64))),
        }
        for k, e in errors.items():
            ratios[k] = max(ratios[k], float(e.max()))
    return {**ratios, "kernel": head_matmul_kernel(device)}


def test_bf16_head_is_the_rounded_product_accumulated_in_fp32():
    out = bf16_head_against_float64(torch.device("cpu"))
    assert out["kernel"] == "upcast"  # the CPU has no fp32-output bf16 product: the same products, upcast
    assert max(out[k] for k in ("logprob", "entropy", "grad_h", "grad_w")) <= 1, out


def test_bf16_head_per_token_difference_from_the_fp32_head():
    # The trade, on the tiny decoder with peaked attention (weights x4): rounding h and W to bf16 (relative
    # 2^-9 each) moves a logit by at most 2^-8 sum_i |h_i w_i|, and a logprob (a logit minus a log-sum-exp)
    # by at most twice the largest such move. Measured here: mean 0.09, max 0.35 nats per token against a bound
    # of 1.9 (the x4 weights make logits of ~+-40; SmolLM2-135M's figures: docs/gpu.md).
    model = make_tiny_decoder(scale=4.0)
    prompts, responses = groups_of_rows(seed=1)
    batch = TrainingBatch(prompts, responses, pad_id=0, share_prompt=True)
    fp32 = batch_token_logprobs(model, batch, micro_batch_size=len(batch)).logprobs
    set_head_precision(model, "bf16")
    bf16 = batch_token_logprobs(model, batch, micro_batch_size=len(batch)).logprobs
    diff = (bf16 - fp32).abs()[batch.response_mask]
    with torch.no_grad():  # the final normed hidden states, for the bound
        h = model.norm(torch.cat([l for l in _hidden(model, prompts, responses)]))
        bound = 2 * 2**-8 * float((h.abs() @ model.tok_embeddings.weight.abs().t()).max())
    print(f"bf16 head vs fp32 head: mean {float(diff.mean()):.2e}, max {float(diff.max()):.2e}, bound {bound:.2e}")
    assert 0 < float(diff.mean()) and float(diff.max()) <= bound, (float(diff.mean()), float(diff.max()), bound)
    with pytest.raises(ValueError, match="logprob_head must be one of .*'fp16'"):
        set_head_precision(model, "fp16")


def _hidden(model, prompts, responses):
    out = []
    for p, r in zip(prompts, responses):
        h = model.tok_embeddings(torch.tensor([p + r]))
        for layer in model.layers:
            h = layer(h)
        out.append(h[0])
    return out


def tiny_with(switch: str):
    """The tiny decoder (peaked attention) with one switch."""
    model = make_tiny_decoder(seed=4, scale=0.5).train()
    if switch == "bf16_head":
        set_head_precision(model, "bf16")
    elif switch == "selective_ac":
        apply_activation_checkpointing(model, checkpointed_layers(len(model.layers), "selective", every=2))
    elif switch == "all_ac":
        apply_activation_checkpointing(model, checkpointed_layers(len(model.layers), "on"))
    elif switch == "compiled":
        compile_decoder_layers(model, "aot_eager")
    return model


@pytest.mark.parametrize("switch", ["bf16_head"])
def test_each_switch_keeps_the_update_independent_of_the_split(switch):
    # One micro-batch per mini-batch vs a token budget that sorts and splits each one, 2 mini-batches x 2
    # passes with KL and an entropy bonus, in the shared and the packed layouts. The bound is
    # tests/test_micro_batching.py's (the same regrouped fp32 sums; the bf16 head's products are exact in fp32
    # and accumulate in fp32, so its regrouping error is the fp32 head's): 1e-5 on weights and logged losses.
    # Checkpointing and compiling are not run here: they give every micro-batch's logprobs and gradients bit for
    # bit (tests/test_update_switches_exact.py), so every split, budget and process count gives
    # what the eager model gives, which tests/test_micro_batching.py and the recipe tests check.
    for layout in (dict(share_prompt=True), dict(share_prompt=False, pack=True)):
        prompts, responses = groups_of_rows(seed=3)
        batch = TrainingBatch(prompts, responses, pad_id=0, **layout)
        base_model = tiny_with(switch)
        n = len(batch)
        old = batch_token_logprobs(base_model, batch, micro_batch_size=n).logprobs
        gen = torch.Generator().manual_seed(3)
        exp = Experience(batch=batch, mask=batch.response_mask, kept=torch.ones(n, dtype=torch.bool),
                         advantages=torch.randn(n, generator=gen), old_logprobs=old,
                         ref_logprobs=old + 0.01 * torch.randn(old.shape, generator=gen), engine_logprobs=None)
        results = []
        for max_tokens in (None, 60):
            m = copy.deepcopy(base_model)
            update = PolicyUpdate(
                m, torch.optim.SGD(m.parameters(), lr=0.1),
                GRPOLoss(epsilon=0.2, loss_agg_mode="token-mean", kl_coef=0.05, entropy_coef=0.01),
                ppo_epochs=2, ppo_mini_batches=2, group_size=G, shuffle=False,
                micro_batch_size=n if max_tokens is None else 4, max_tokens_per_micro_batch=max_tokens,
            )
            stats = update(exp)
            results.append(({k: p.detach().clone() for k, p in m.named_parameters()}, stats.losses))
        (base, base_stats), (split, split_stats) = results
        for k, v in base.items():
            torch.testing.assert_close(split[k], v, atol=1e-5, rtol=0, msg=lambda s: f"{switch} {layout} {k}: {s}")
        for key in ("loss", "policy_loss", "kl", "entropy"):
            assert float(split_stats[key]) == pytest.approx(float(base_stats[key]), abs=1e-5), (switch, key)
        start = dict(base_model.named_parameters())
        assert max((base[k] - start[k]).abs().max().item() for k in base) > 1e-3  # it trained


def test_checkpointed_layers_and_the_auto_decision_by_hand():
    assert checkpointed_layers(5, "off") == set() and checkpointed_layers(5, "on") == {0, 1, 2, 3, 4}
    assert checkpointed_layers(5, "selective", every=2) == {1, 3}
    assert checkpointed_layers(5, "selective", every=1) == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="activation_checkpointing_every must be >= 1, got 0"):
        checkpointed_layers(5, "selective", every=0)
    # The tiny decoder: D = 64, q = 4 x 16 = 64, kv = 2 x 16 = 32, I = 128, 2 layers, V = 97, tied.
    # Per token and layer: 4 D + 2 (q + 2 kv) + q + D + 4 I = 256 + 256 + 64 + 64 + 512 = 1152 values.
    model = make_tiny_decoder()
    params = sum(p.numel() for p in model.parameters())
    est = training_memory_estimate(model, tokens=100, bytes_per_param=16, compute_bytes=4, world_size=1,
                                   chunk_size=512, reference=True)
    assert est == MemoryEstimate(states=params * 16 + params * 4, activations=100 * 2 * 1152 * 4,
                                 checkpointed=100 * (2 * 64 + 1152) * 4, head=2 * 100 * 97 * 4)
    need = est.total(checkpointing=False)
    # auto: off while the estimate fits 80% of the device, on past it
    assert resolve_activation_checkpointing("auto", est, int(need / 0.8) + 1) == "off"
    assert resolve_activation_checkpointing("auto", est, int(need / 0.8) - 1) == "on"
    assert resolve_activation_checkpointing("auto", None, 10**12) == "on"  # size unknown: the safe choice
    assert resolve_activation_checkpointing("selective", est, 1) == "selective"
    with pytest.raises(ValueError, match=r"compile_training = 'inductr' is not a torch.compile backend.*'inductor'"):
        compile_decoder_layers(model, "inductr")
