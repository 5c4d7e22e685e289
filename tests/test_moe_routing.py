"""Routing replay's parts (torchtune_grpo/models/moe_routing.py, the transformers engine's route record,
torchtune_grpo/training/routes.py, torchtune_grpo/loss/router.py): forced routes are the ones used and keep the
router learning, the engine's routes line up with the trainer's tokens, replay lowers the bf16-engine/fp32-trainer
logprob mismatch, and the router losses do not depend on how the tokens are split."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.hf_families import family_config, scale_routers, sharpen
from tests.hf_moe import ROUTER_GAIN
from tests.tolerances import ulps
from torchtune_grpo.generation._transformers import sample_with_generate
from torchtune_grpo.loss.router import load_balance_sum, z_loss_sum
from torchtune_grpo.models._transformers_policy import build_transformers_decoder
from torchtune_grpo.models.moe_routing import router_hooks, router_scores
from torchtune_grpo.training.batch import batch_logprobs, TrainingBatch
from torchtune_grpo.training.routes import expert_fractions, RouterTerms

FAMILIES = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss", "olmoe", "mixtral")


def _model(family: str, seed: int = 0, router_gain: float = ROUTER_GAIN, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32, attn_implementation="eager")
    model = scale_routers(sharpen(model, family, seed), router_gain).eval()
    return model.to(dtype)


def _decoder(model):
    """The trainer's policy (transformers' module behind the recipe's interface) holding ``model``'s weights."""
    decoder = build_transformers_decoder(model.config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = decoder.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return decoder.eval()


def _stack(recorded, forward: int = 0) -> torch.Tensor:
    return torch.stack([layer[forward] for layer in recorded], dim=1).long()  # [tokens, layers, k]


@pytest.mark.parametrize("family", FAMILIES)
def test_forcing_the_routers_own_choice_is_exact_and_other_routes_are_used(family):
    model = _model(family)
    hooks = router_hooks(model)
    tokens = torch.randint(10, 400, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hooks.recording() as rec:
        plain = model(tokens).logits
    own = _stack(rec).view(2, 7, hooks.num_layers, hooks.top_k)
    # The family's score rule recomputes the router's own gate weights bit for bit: forcing its own choice
    # changes nothing.
    with torch.no_grad(), hooks.forcing(own):
        assert torch.equal(model(tokens).logits, plain)
    # Other experts (each token's k experts shifted by one), with -1 (the router's own choice) on row 1's first
    # three tokens: exactly those are used, and the output changes.
    forced = (own + 1) % hooks.num_experts
    forced[1, :3] = -1
    with torch.no_grad(), hooks.forcing(forced), hooks.recording() as rec:
        moved = model(tokens).logits
    used = _stack(rec).view(2, 7, hooks.num_layers, hooks.top_k)
    assert torch.equal(used[1, :3], own[1, :3])
    assert torch.equal(used[0], forced[0]) and torch.equal(used[1, 3:], forced[1, 3:])
    assert (moved - plain).abs().max() > 1e-2


def test_forced_routes_keep_the_router_learning_as_a_hand_computation_says():
    # One Qwen3-MoE block, experts forced: out_t = sum_j s_tj E_{F_tj}(x_t) with s = renormalised softmax(W x)[F].
    model = _model("qwen3_moe")
    block = model.model.layers[0].mlp
    hooks = router_hooks(model)
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    forced = torch.tensor([[[3, 1]], [[0, 2]], [[2, 3]], [[1, 0]], [[3, 2]]]).view(1, 5, 1, 2)
    upstream = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    routes = torch.cat([forced, torch.full_like(forced, -1)], dim=2)  # layer 1 is not run here
    with hooks.forcing(routes):
        (block(x) * upstream).sum().backward()
    grad = block.gate.weight.grad.clone()
    w = block.gate.weight.detach().clone().requires_grad_(True)
    experts = block.experts
    h = x[0]
    probs = torch.softmax(h @ w.t(), dim=-1).gather(-1, forced[0, :, 0])  # [5, 2]
    scores = probs / probs.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for j in range(2):
        e = forced[0, :, 0, j]
        gate, up = torch.einsum("th,tih->ti", h, experts.gate_up_proj[e].detach()).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        out = out + scores[:, j: j + 1] * torch.einsum("ti,thi->th", act, experts.down_proj[e].detach())
    (out * upstream[0]).sum().backward()
    assert grad.abs().max() > 1e-3
    # The same products and sums in another order: a few ulps of the gradient's largest entries (|g| ~ 1),
    # times the ~H = 64 terms each gradient entry sums.
    torch.testing.assert_close(grad, w.grad, rtol=0, atol=ulps(grad, 64 * 8))


def test_score_rules_are_the_families():
    # gpt-oss: softmax over the k chosen logits; the others: softmax over all, the k gathered, renormalised.
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0]])
    idx = torch.tensor([[3, 0]])
    gpt = _model("gpt_oss").model.layers[0].mlp.router
    qwen = _model("qwen3_moe").model.layers[0].mlp.gate
    e = torch.exp(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(router_scores(gpt, logits, idx), (e / e.sum())[None], rtol=0, atol=1e-7)
    torch.testing.assert_close(router_scores(qwen, logits, idx), (e / e.sum())[None], rtol=0, atol=1e-7)
    qwen.norm_topk_prob = False  # unnormalised: the full softmax's values
    full = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(router_scores(qwen, logits, idx), full[[3, 0]][None], rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def bf16_engine_rollout():
    """A bf16 copy of a qwen3_moe policy samples (routes and logprobs recorded); the policy stays fp32. Router
    gain 1: the gaps between router logits are those of an unscaled random router, so bf16 flips some choices."""
    policy = _decoder(_model("qwen3_moe", seed=4, router_gain=1.0))
    engine = _model("qwen3_moe", seed=4, router_gain=1.0, dtype=torch.bfloat16)
    prompts = [[20 + i for i in range(n)] for n in (5, 9, 7)]  # different lengths: left padding stripped
    rollout = sample_with_generate(
        engine, prompts, group_size=2, max_new_tokens=12, pad_id=0, stop_tokens=[481],
        generator=torch.Generator().manual_seed(5), temperature=1.0, top_k=None, top_p=1.0, with_logprobs=True,
    )
    return policy, engine, rollout


def test_engine_routes_line_up_with_the_tokens():
    # fp32 and decisive routers (no near-ties): the rows generated together, left-padded, with a KV cache, route
    # every input token exactly as the unpadded row alone does.
    engine = _model("qwen3_moe", seed=3)
    hooks = router_hooks(engine)
    prompts = [[20 + i for i in range(n)] for n in (4, 8)]  # different lengths: left padding stripped
    rollout = sample_with_generate(
        engine, prompts, group_size=2, max_new_tokens=6, pad_id=0, stop_tokens=[481],
        generator=torch.Generator().manual_seed(5), temperature=1.0, top_k=None, top_p=1.0,
    )
    assert rollout.logprobs is None  # not asked for
    for i, (p, r) in enumerate(zip(rollout.prompt_ids, rollout.response_ids)):
        routes = rollout.routed_experts[i]
        assert routes.dtype == torch.int16 and routes.shape == (len(p) + len(r), hooks.num_layers, hooks.top_k)
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()  # the last sampled token is never an input
        with torch.no_grad(), hooks.recording() as rec:
            engine(torch.tensor([p + r]))
        own = _stack(rec)[:-1]
        assert torch.equal(own.sort(-1).values, routes[:-1].long().sort(-1).values), i


def test_replay_forces_the_engines_routes_and_lowers_the_mismatch(bf16_engine_rollout):
    policy, engine, rollout = bf16_engine_rollout
    hooks = router_hooks(policy)
    mismatch, agreement = {}, {}
    for replay in (False, True):
        batch = TrainingBatch(rollout.prompt_ids, rollout.response_ids, 0, share_prompt=False,
                              routed_experts=rollout.routed_experts, replay=replay)
        with torch.no_grad(), hooks.recording() as rec:
            trainer = batch_logprobs(policy, batch, micro_batch_size=len(batch))
        used = _stack(rec).view(*batch.routes.shape[:2], hooks.num_layers, hooks.top_k)
        engine_routes = batch.routes.long()
        known = (engine_routes >= 0).all(-1)  # [N, L, layers]
        same = (used.sort(-1).values == engine_routes.sort(-1).values).all(-1)
        agreement[replay] = float(same[known].float().mean())
        sampler = batch.response_values(rollout.logprobs)
        mismatch[replay] = float((trainer - sampler).abs()[batch.response_mask].mean())
    print(f"bf16 engine vs fp32 trainer: router agreement {agreement}, mean |logprob diff| {mismatch}")
    assert agreement[True] == 1.0  # every token, every layer: the recorded experts
    assert agreement[False] < 1.0  # without replay bf16 rounding routes some tokens elsewhere
    assert mismatch[True] < mismatch[False]


def test_router_losses_do_not_depend_on_how_tokens_are_split():
    # The whole batch at once vs four uneven pieces (micro-batches on two processes), each divided by the global
    # token count, with f from both "processes'" routes summed: the same values and gradients.
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 10, 4, generator=gen, dtype=torch.float64).requires_grad_(True)  # [layers, T, E]
    routes = torch.randint(0, 4, (1, 10, 2, 2), generator=gen)
    lengths = [10]
    real = torch.ones(10, dtype=torch.bool)
    real[8:] = False  # padding
    masked = routes.masked_fill(~real[None, :, None, None], -1)
    f_whole = expert_fractions(masked, lengths, 4, lambda v: v)
    # Two "processes" of 5 tokens each: process 0's all-reduce adds process 1's counts.
    counts1 = [float((masked[0, 5:, layer] == e).sum()) for layer in range(2) for e in range(4)]
    f_split = expert_fractions(masked[:, :5], [5], 4, lambda v: [a + b for a, b in zip(v, counts1)])
    torch.testing.assert_close(f_split, f_whole, rtol=0, atol=0)  # integer counts: exact
    n_real = float(real.sum())

    def total(pieces):
        lb = z = 0.0
        for a, b in pieces:
            for layer in range(2):
                lb = lb + load_balance_sum(logits[layer, a:b], real[a:b], f_whole[layer]) / (n_real * 2)
                z = z + z_loss_sum(logits[layer, a:b], real[a:b]) / (n_real * 2)
        return lb, z

    whole = total([(0, 10)])
    split = total([(0, 3), (3, 5), (5, 9), (9, 10)])
    grads = [torch.autograd.grad(sum(t), logits)[0] for t in (whole, split)]
    # fp32 softmax of each token, summed in another grouping: a few ulps of values ~1.
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=0, atol=ulps(a.detach(), 16))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=ulps(grads[0], 16))
    # Uniform routing and probabilities give the Switch loss its minimum, 1.
    flat = torch.zeros(5, 4)
    assert load_balance_sum(flat, torch.ones(5, dtype=torch.bool), torch.full((4,), 0.25)) / 5 == pytest.approx(1.0)
    assert RouterTerms.for_model(torch.nn.Linear(2, 2)) is None  # a dense model has none
