"""The packed and shared-prompt training layouts on transformers' own modules (every family of the fixtures).

Each family's tiny model (:mod:`tests.hf_families`, its layouts-only ``LAYOUT_FAMILIES`` included, and
:mod:`tests.hf_moe`: peaked attention, windows of 6) is built
once per module, in memory, and three fp32 computations of the same step are compared with each other and with an
fp64 one: one row per sequence (transformers' own masks), shared-prompt rows and packed rows (our explicit masks).
The sequences are long enough for the windows to bite (24-51 tokens), prompts are shared by groups of 3 with
different response lengths, and the two micro-batches split the second group (its prompt in two rows).

The bounds (see ``_bound``): the fp32 layouts compute the same functions with the same operations, only summed in
another order (another attention mask and matmul shapes; a shared prompt's key/value gradients summed over its
completions in one matmul instead of over rows). Each fp32 result's rounding error therefore has the size of the
fp32 one-row-per-sequence result's own error, which the fp64 computation measures element by element; that
measured error already includes how ill-conditioned each quantity is (peaked softmaxes, gradients that cancel
over tokens), which a fixed number of ulp of the result cannot. Two fp32 results of the same error size differ
by at most twice it; a factor 4 covers two random orders whose largest errors land on different elements, and a
floor of 8 ulp of the largest value covers tensors whose fp32 error happened to be ~0.
"""

import random
from typing import Dict, List, Tuple

import pytest
import torch

from tests.hf_families import FAMILIES, family_config, LAYOUT_FAMILIES, scale_routers, sharpen
from tests.hf_models import randomize
from tests.hf_moe import MOE_FAMILIES, ROUTER_GAIN
from tests.tolerances import ulps
from torchtune_grpo.models import TransformersDecoder
from torchtune_grpo.models._transformers_layouts import config_unsupported, SlotPairs
from torchtune_grpo.models._transformers_recurrent import SequenceRows
from torchtune_grpo.models.moe_routing import moe_shape, router_hooks
from torchtune_grpo.training.batch import shared_prompt_unsupported, training_layout, TrainingBatch

# Tiny ops: one intra-op thread (tests/conftest.py), else a busy 2-core machine makes them 10-100x slower.
pytestmark = pytest.mark.usefixtures("one_thread")
TEMPERATURE = 0.7
LINEAR_ATTENTION = ["qwen3_5_text", "qwen3_5_moe_text"]  # Gated DeltaNet: split by sequence in those layers
EVERY_FAMILY = [*FAMILIES, *MOE_FAMILIES, *LAYOUT_FAMILIES]
MEASURED: Dict[str, Dict[str, float]] = {}  # family -> quantity -> measured / bound (printed with -s)


@pytest.fixture(scope="module", autouse=True)
def _print_measured():
    """After the module: measured max difference / bound per family and quantity (shown with ``pytest -s``)."""
    yield
    for family, record in sorted(MEASURED.items()):
        print(family, {k: round(v, 3) for k, v in sorted(record.items())})


@pytest.fixture(scope="module")
def model_of():
    """``model_of(family, attention=None)``: the family's policy, built once per module (fp32, in memory)."""
    built = {}

    def get(family: str, attention=None) -> TransformersDecoder:
        key = (family, attention)
        if key not in built:
            torch.manual_seed(0)
            kw = {} if attention is None else {"attn_implementation": attention}
            lm = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32, **kw)
            randomize(lm, 0)
            sharpen(lm, family, 0)
            scale_routers(lm, ROUTER_GAIN)
            built[key] = TransformersDecoder(lm, 256, {}).train()
        return built[key]

    from transformers import AutoModelForCausalLM

    return get


def _groups(seed: int = 0) -> Tuple[List[List[int]], List[List[int]]]:
    """2 prompts (12-13 tokens) x 3 responses of 38-39, 13-14, 12-13 tokens: sequences of 24-52 tokens, far
    longer than the 6-token windows; the two short ones of a group fit one packed row next to each other."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(2):
        p = [rng.randrange(1, 480) for _ in range(rng.randint(12, 13))]
        for n in (38, 13, 12):
            prompts.append(p)
            responses.append([rng.randrange(1, 480) for _ in range(n + rng.randint(0, 1))])
    return prompts, responses


MICRO_BATCHES = [slice(0, 4), slice(4, 6)]  # the second group split: its prompt shared in two rows


def _weights(batch: TrainingBatch) -> torch.Tensor:
    """Per-token loss weights of both signs (as any GRPO loss's advantages), ``[N, T]``."""
    return torch.linspace(-1.0, 2.0, batch.response_mask.numel()).view_as(batch.response_mask)


def _fp32(model, batch: TrainingBatch):
    """Logprobs, entropies ``[N, T]``, the loss and every parameter's gradient, through the training path."""
    model.zero_grad(set_to_none=True)
    outs = [batch.logprobs(model, mb, temperature=TEMPERATURE, chunk_size=64, with_entropy=True, entropy_grad=True)
            for mb in MICRO_BATCHES]
    lp, ent = torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs])
    w = _weights(batch)
    loss = (lp * w).sum() + 0.3 * (ent * w).sum()
    loss.backward()
    return lp.detach(), ent.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _fp64(model, batch: TrainingBatch):
    """The same quantities in fp64, one row per sequence, logits and log-softmax in fp64 (the training path's
    head computes in fp32 whatever the model's dtype, so this is computed from the model's logits directly)."""
    lm = model.causal_lm
    experts = getattr(lm.config, "_experts_implementation", None)
    if experts is not None:  # grouped_mm (the MoE default) has no fp64 kernel; the eager loop computes the same
        lm.set_experts_implementation("eager")
    model.double()
    try:
        model.zero_grad(set_to_none=True)
        rows = slice(0, len(batch))
        width = batch.forward_width(rows)
        tokens = batch.tokens[:, :width]
        with batch.routing(model, rows):  # the replayed routes, laid out as these rows
            logits = model(tokens)  # [N, W, V] fp64
        t, start = batch.width, batch.start
        z = logits[:, start : start + t] / TEMPERATURE
        logp = torch.log_softmax(z, dim=-1)
        lp = logp.gather(-1, batch.tokens[:, start + 1 : start + 1 + t, None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        keep = batch.response_mask
        lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
        w = _weights(batch).double()
        loss = (lp * w).sum() + 0.3 * (ent * w).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return lp.detach(), ent.detach(), loss.detach(), grads
    finally:
        model.float()
        model.zero_grad(set_to_none=True)
        if experts is not None:
            lm.set_experts_implementation(experts)


def _bound(fp32: torch.Tensor, fp64: torch.Tensor) -> float:
    """4 x the fp32 one-row-per-sequence result's largest error (measured against fp64), at least 8 ulp of the
    largest value (the module docstring derives it)."""
    error = (fp32.double() - fp64).abs().max().item()
    return max(4.0 * error, ulps(fp64, 8))


def _compare(family: str, name: str, got: torch.Tensor, unshared: torch.Tensor, exact: torch.Tensor) -> None:
    bound = _bound(unshared, exact)
    diff = (got.double() - unshared.double()).abs().max().item()
    record = MEASURED.setdefault(family, {})
    record[name] = max(record.get(name, 0.0), diff / bound)
    assert diff <= bound, f"{family} {name}: |layout - one row per sequence| = {diff:.3g} > bound {bound:.3g}"


def _check_layouts(family, model, batches, reference):
    unshared, exact = reference
    for layout, batch in batches.items():
        assert all(batch.layout_for(model, mb) is not None for mb in MICRO_BATCHES), f"{family}: no {layout} rows"
        lp, ent, loss, grads = _fp32(model, batch)
        assert torch.equal(lp == 0, unshared[0] == 0)
        _compare(family, f"{layout} logprobs", lp, unshared[0], exact[0])
        _compare(family, f"{layout} entropy", ent, unshared[1], exact[1])
        _compare(family, f"{layout} loss", loss, unshared[2], exact[2])
        for pname, g in unshared[3].items():
            _compare(family, f"{layout} grads", grads[pname], g, exact[3][pname])


def _batches(prompts, responses, **kw) -> Dict[str, TrainingBatch]:
    packed = TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True, **kw)
    # Several sequences in one packed row, and both micro-batches' groups sharing a row each.
    assert any((packed.layout(mb).mask.segments.max(dim=1).values >= 1).any() for mb in MICRO_BATCHES)
    return {"shared": TrainingBatch(prompts, responses, 0, share_prompt=True, **kw), "packed": packed}


@pytest.mark.parametrize("family,attention",
                         [(f, None) for f in EVERY_FAMILY]
                         + [(f, "eager") for f in ("mistral", "gemma3_text", "gemma2")])
def test_layouts_equal_one_row_per_sequence(family, attention, model_of):
    model = model_of(family, attention)
    assert shared_prompt_unsupported(model) is None
    prompts, responses = _groups()
    unshared_batch = TrainingBatch(prompts, responses, 0, share_prompt=False)
    reference = (_fp32(model, unshared_batch), _fp64(model, unshared_batch))
    _check_layouts(family if attention is None else f"{family}:{attention}", model,
                   _batches(prompts, responses), reference)


def _random_routes(prompts, responses, layers: int, k: int, experts: int) -> List[torch.Tensor]:
    """Engine routes unlike the router's own: random distinct experts per token and layer, a group's prompt
    routed alike in its rows (as one engine prefill gives them)."""
    gen = torch.Generator().manual_seed(0)

    def pick(n: int) -> torch.Tensor:
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]).view(n, layers, k)

    out, by_prompt = [], {}
    for p, r in zip(prompts, responses):
        if tuple(p) not in by_prompt:
            by_prompt[tuple(p)] = pick(len(p))
        out.append(torch.cat([by_prompt[tuple(p)], pick(len(r))]).to(torch.int16))
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_layouts_equal_one_row_per_sequence_with_routing_replay(family, model_of):
    model = model_of(family)
    prompts, responses = _groups()
    layers, experts, k = moe_shape(model)
    kw = dict(routed_experts=_random_routes(prompts, responses, layers, k, experts), replay=True)
    unshared_batch = TrainingBatch(prompts, responses, 0, share_prompt=False, **kw)
    reference = (_fp32(model, unshared_batch), _fp64(model, unshared_batch))
    own = _fp32(model, TrainingBatch(prompts, responses, 0, share_prompt=False))
    # The forced routes really change the model (else this test would not test replay): far above any bound.
    assert (own[0] - reference[0][0]).abs().max() > 0.1
    batches = _batches(prompts, responses, **kw)
    with router_hooks(model).recording() as recorded:
        batches["shared"].logprobs(model, MICRO_BATCHES[0])
    routes = batches["shared"].routes_for(MICRO_BATCHES[0], model)  # [R, S, layers, k] in the layout's slots
    real = routes[..., 0, 0] >= 0
    for layer in range(layers):  # every real slot used the engine's route
        used = recorded[layer][0].view(*routes.shape[:2], k).long()
        assert torch.equal(used[real], routes[:, :, layer][real].long())
    _check_layouts(f"{family}+replay", model, batches, reference)


@pytest.mark.parametrize("family", LINEAR_ATTENTION)
def test_linear_attention_layers_take_the_rows_apart_by_sequence(family, model_of, monkeypatch):
    """Gated DeltaNet layers under a layout run each sequence on a row of its own (the layouts' equality with one
    row per sequence is in ``test_layouts_equal_one_row_per_sequence``); without that split the packed row's
    state flows from one sequence into the next, and the logprobs of every later sequence of a row move."""
    model = model_of(family)
    common = dict(max_prompt_length=13, max_response_length=40, group_size=3, micro_batch_size=6)
    assert shared_prompt_unsupported(model) is None
    assert training_layout(model, share_prompt=True, explicit=True, **common) == (True, None)
    # A multi-turn session's masks by position still refuse them: a running state cannot skip a hole.
    assert "Gated DeltaNet" in config_unsupported(model.causal_lm.config)
    prompts, responses = _groups()
    batches = _batches(prompts, responses)
    # The shared rows' plan: one row per completion (the prompt is not a row of its own); packed: per sequence.
    for layout, batch in batches.items():
        lay = batch.layout(MICRO_BATCHES[0])
        plan = SequenceRows(lay.mask.pairs(lay.input_pos))
        assert plan.gather.size(0) == MICRO_BATCHES[0].stop - MICRO_BATCHES[0].start, layout
    unshared = _fp32(model, TrainingBatch(prompts, responses, 0, share_prompt=False))[0]
    whole_rows = lambda self, forward, hidden, **kw: forward(hidden, cache_params=None, attention_mask=None, **kw)
    monkeypatch.setattr(SequenceRows, "run", whole_rows)
    leaked = _fp32(model, batches["packed"])[0]
    # The layouts' bound for these logprobs is ~1e-5 (MEASURED); the leaked state moves them by orders more.
    assert (leaked - unshared).abs().max() > 1e-2


def test_sequence_rows_by_hand():
    """A shared prompt of 2 tokens (one padding slot after it) and two completions of 2 slots: two rows, each the
    prompt then one completion; the prompt's outputs from the first; padding reads the zero after the outputs."""
    segment = torch.tensor([[0, 0, -1, 1, 1, 2, 2]])
    shared = torch.tensor([[True, True, False, False, False, False, False]])
    plan = SequenceRows(SlotPairs(segment, shared, torch.tensor([[0, 1, 0, 2, 3, 2, 3]])))
    assert plan.gather.tolist() == [[0, 1, 3, 4], [0, 1, 5, 6]]
    assert plan.source.tolist() == [0, 1, 8, 2, 3, 6, 7]
    packed = SequenceRows(SlotPairs(torch.tensor([[0, 0, 0, 1, -1], [0, 1, 1, 2, 2]]), torch.zeros(2, 5, dtype=torch.bool),
                                    torch.zeros(2, 5, dtype=torch.long)))
    assert packed.gather.tolist() == [[0, 1, 2], [3, 10, 10], [5, 10, 10], [6, 7, 10], [8, 9, 10]]
    assert packed.source.tolist() == [0, 1, 2, 3, 15, 6, 9, 10, 12, 13]
    # Each row's outputs come back to its slots: a layer that adds its row's running sum shows the state per row.
    hidden = torch.arange(1.0, 11.0).view(2, 5, 1)
    out = packed.run(lambda x, **kw: x.cumsum(1), hidden)
    assert out[..., 0].tolist() == [[1.0, 3.0, 6.0, 4.0, 0.0], [6.0, 7.0, 15.0, 9.0, 19.0]]


def test_supported_family_takes_the_layouts_silently(model_of):
    model = model_of("gemma3_text")
    common = dict(max_prompt_length=13, max_response_length=40, group_size=3, micro_batch_size=6)
    assert training_layout(model, share_prompt=True, explicit=True, **common) == (True, None)
    assert training_layout(model, share_prompt=False, explicit=False, pack=True, **common) == (False, None)


def test_flash_attention_is_refused_by_name(model_of):
    model = model_of("qwen3")
    config = model.causal_lm.config
    saved = config._attn_implementation
    config._attn_implementation = "flash_attention_2"  # set on the config only: nothing runs
    try:
        assert "'flash_attention_2'" in shared_prompt_unsupported(model)
    finally:
        config._attn_implementation = saved


def test_shared_prompt_attention_is_its_slot_pairs():
    """The torchtune path's split attention (:meth:`SharedPromptMask.attention`) computes exactly the pairs its
    :meth:`pairs` describes (the transformers path's masks), on every slot a result is read from."""
    from torchtune_grpo.training.batch import shared_prompt_layout

    prompts, responses = _groups()
    lay = shared_prompt_layout(prompts[:4], responses[:4], 0, start=10, width=60)
    r, s = lay.tokens.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(r, 2, s, 8, generator=gen) for _ in range(3))
    split = lay.mask.attention(q, k, v)
    allowed = lay.mask.pairs(lay.input_pos).allowed()[:, None]  # [R, 1, S, S]
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    read = lay.source[..., 0] >= 0  # slots holding a real token (padding's outputs are never read)
    # A softmax over the same pairs, summed in another order (the split attention's key set is the prompt and one
    # completion, the dense one the whole row with zeros for the masked pairs): each output is a convex combination
    # of values, so its rounding is a few ulp of max |v| per term over <= 50 keys, ~sqrt(50) = 7; bound 16 ulp.
    torch.testing.assert_close(split.transpose(1, 2)[read], dense.transpose(1, 2)[read], atol=ulps(v, 16), rtol=0)


def test_packed_mask_is_its_slot_pairs():
    """The torchtune path's block-diagonal mask (:attr:`PackedMask.mask`) allows exactly the pairs its
    :meth:`PackedMask.pairs` describes on every real query slot (padding's outputs are never read)."""
    from torchtune_grpo.training.packed_rows import packed_layout

    prompts, responses = _groups()
    lay = packed_layout(prompts, responses, 0, start=10, width=60)
    assert (lay.mask.segments.max(dim=1).values >= 1).any()  # several sequences in a row
    read = lay.source[..., 0] >= 0  # [R, S]
    assert torch.equal(lay.mask.mask[:, 0][read], lay.mask.pairs(lay.input_pos).allowed()[read])
