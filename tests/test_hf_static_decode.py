"""Compiled decode on a fixed-shape transformers cache (generation/_hf_static.py), for every family of
tests/hf_families.py (tiny models, peaked attention, 6-token windows shorter than the 9-token prompts plus up to 24
decoded tokens; Qwen3.5's Gated DeltaNet, Gemma 4's key/value-sharing layers):

- ``compile_decode: true`` decodes the eager decode's logits (to rounding) and greedy tokens on transformers' growing
  cache (rows kept to the end in both), traced by dynamo as one graph with no graph break, and a second prompt width
  reuses it (capacities rounded up); on CPU the graph runs through the ``eager``/``aot_eager`` backends (the CUDA path's
  tracing and functionalisation, without CUDA graphs);
- the fixed cache is kept between rollouts of one shape, in place (a CUDA graph replays on its addresses), and
  ``reuse_cache: false`` frees it;
- a mixture of experts (routes recorded by hooks per forward) decodes eagerly and says why;
- the trainer's logprobs of the sampled completions are those of the logits the compiled step gave;
- under FSDP2 with mixed precision (as the recipe trains bf16 on one process), the decode steps run FSDP2's hooks as
  plain casts: the compiled step stays one graph, and every token and logit is the hooks' own.
"""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from tests.hf_families import FAMILIES
from tests.sampler_records import record_sampler, sampled_logprobs
from tests.tolerances import ulps
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.training.batch import batch_token_logprobs, TrainingBatch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [40, 41, 42, 43, 44, 45]]
STOPS = list(range(100, 140))  # rows stop at scattered lengths
KW = dict(group_size=3, max_new_tokens=24, pad_id=0, stop_tokens=STOPS)
# aot_eager (functionalised graph, as inductor compiles it) on the three cache kinds beyond plain attention: windows,
# Gated DeltaNet states, key/value sharing; plain dynamo tracing (eager backend) on the others, which is what
# finds graph breaks and shape specialisation.
BACKEND = {"gemma3_text": "aot_eager", "qwen3_5_text": "aot_eager", "gemma4_text": "aot_eager"}
# The families whose trainer logprobs are checked against the compiled step's sampling (Gated DeltaNet states,
# sliding windows): in test_compiled_fixed_cache_decodes_the_eager_logits, on the step it compiled.
TRAINER_CHECKED = ("qwen3_5_text", "gemma3_text")


@pytest.fixture
def sampled(monkeypatch):
    return record_sampler(monkeypatch)


@pytest.fixture
def compiled_engine():
    """A compiled-decode engine for the family, dynamo's caches and counters clean before and after."""
    torch._dynamo.reset()
    counters.clear()
    yield lambda family, **kw: NativeGenerator(stop_check_interval=4, compile_decode=True,
                                               compile_backend=BACKEND.get(family, "eager"), **kw)
    torch._dynamo.reset()


def _sample(engine, policy, runs, prompts=PROMPTS, seed=1, temperature=1.0, stop_tokens=STOPS):
    runs.append([])
    gen = torch.Generator().manual_seed(seed)
    out = engine.generate(policy, prompts, generator=gen, temperature=temperature,
                          **{**KW, "stop_tokens": stop_tokens})
    return out, torch.rand(2, generator=gen)


def assert_trainer_logprobs_are_those_the_compiled_step_sampled_from(engine, policy, runs) -> None:
    """The trainer's logprobs of a sampled rollout (temperature 1, scattered stops) of ``engine``'s compiled step are
    those of the logits the step gave."""
    # fp32, as test_native_transformers_decode.py's same test on the eager decode (bound 1e-4 derived there: one
    # right-padded training forward against a prefill plus one-token steps; the fixed cache's longer masked rows
    # only reorder sums again).
    out, _ = _sample(engine, policy, runs, seed=2)
    sampled = sampled_logprobs(out.response_ids, runs[-1])
    batch = TrainingBatch(out.prompt_ids, out.response_ids, 0, share_prompt=False)
    trainer = batch_token_logprobs(policy, batch, micro_batch_size=len(batch)).logprobs[batch.response_mask]
    torch.testing.assert_close(trainer.double(), sampled, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_fixed_cache_decodes_the_eager_logits(family, family_policy, sampled, compiled_engine):
    policy = family_policy(family)
    engine = compiled_engine(family)
    # Greedy, no stop token: every row decodes its 24 tokens, 4 windows past its prompt.
    fixed, _ = _sample(engine, policy, sampled, temperature=0.0, stop_tokens=[])
    eager, _ = _sample(NativeGenerator(compact_decode=False), policy, sampled, temperature=0.0, stop_tokens=[])
    assert fixed.response_ids == eager.response_ids
    assert {len(r) for r in fixed.response_ids} == {24}
    # Every step's logits, all 9 rows (none leaves the batch in either run). The same fp32 function: the fixed
    # cache's rows are 64 slots long (masked slots add exact zeros; windowed layers hold their whole history and
    # mask by distance) where the growing cache's hold the filled slots only, so the attention sums run in another
    # blocking order; 2-4 layers of 128-256-term matmuls through peaked softmaxes amplify that rounding. Measured
    # 9 to 45 ulp of the largest logit (smollm3 45, gemma3_text 24). Bound 128 ulp. gemma4_text's fixture attends
    # with weights peaked to 0.98 (tests/hf_families.py), which amplifies rounding several times more (transformers'
    # own generate() and full forward differ by up to 3e-4 on it): measured 179 ulp, bound 512 ulp (2.2e-4). Every
    # greedy step's top-two gap is over twice the bound (checked), so no argmax can flip on another CPU's rounding.
    for (a, _), (b, _) in zip(*sampled):
        bound = ulps(b, 512 if family == "gemma4_text" else 128)
        torch.testing.assert_close(a, b, atol=bound, rtol=0)
        assert float((b.topk(2).values @ torch.tensor([1.0, -1.0])).min()) > 2 * bound
    # One graph, no break; another prompt width (10 tokens) fits the same 64-slot capacity: no recompilation.
    wider, _ = _sample(engine, policy, sampled, prompts=[p + [30] for p in PROMPTS], temperature=0.0, stop_tokens=[])
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert wider.response_ids != fixed.response_ids  # the second rollout really decoded its own prompts
    if family in TRAINER_CHECKED:
        # On the step compiled above (its fixed cache held between rollouts, as in the recipe), not on a second
        # compilation of the same step.
        assert_trainer_logprobs_are_those_the_compiled_step_sampled_from(engine, policy, sampled)


def test_fixed_cache_is_kept_in_place_between_rollouts(family_policy, compiled_engine):
    policy = family_policy("gemma3_text")
    engine = compiled_engine("gemma3_text")
    engine.generate(policy, PROMPTS, **KW)
    (cache, mask), = engine.static_hf_caches._held.values()
    addresses = [layer.keys.data_ptr() for layer in cache.layers] + [mask.data_ptr()]
    engine.generate(policy, PROMPTS[:2] + [[7, 8]], **KW)  # same rows, same capacity
    (again, mask2), = engine.static_hf_caches._held.values()
    assert again is cache and [layer.keys.data_ptr() for layer in again.layers] + [mask2.data_ptr()] == addresses
    engine.generate(policy, PROMPTS[:2], **KW)  # 6 rows: a new cache replaces the old one
    assert len(engine.static_hf_caches._held) == 1 and next(iter(engine.static_hf_caches._held.values()))[0] is not cache
    released = compiled_engine("gemma3_text", reuse_cache=False)
    released.generate(policy, PROMPTS, **KW)
    assert not released.static_hf_caches._held


def test_mixture_of_experts_decodes_eagerly_and_says_why(family_policy, caplog):
    policy = family_policy("qwen3_moe")
    with caplog.at_level(logging.WARNING, logger="torchtune_grpo.generation._hf_static"):
        out = NativeGenerator(compile_decode=True, compile_backend="eager").generate(policy, PROMPTS, **KW)
    assert "qwen3_moe decodes eagerly" in caplog.text and "routes are recorded" in caplog.text
    assert out.routed_experts is not None and len(out.routed_experts) == 9



@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_image_prompts_decode_on_the_fixed_cache(family, vision_dir, tmp_path, sampled, compiled_engine):
    # The prefill with the pixels stays eager (the image-text class's forward; Qwen3.5's M-RoPE positions), its cache
    # then goes into the fixed one; the compiled steps decode text at each row's M-RoPE offset. Greedy, 8 tokens per
    # row, no stop: the eager decode's tokens and logits (bound as the text families': 128 ulp of the largest logit;
    # the same reordered attention sums over the fixed cache's longer rows).
    from tests.test_vision_policy import image_rows, vision_policy

    directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    outs = []
    for engine in (compiled_engine(family), NativeGenerator(compact_decode=False)):
        sampled.append([])
        outs.append(engine.generate(policy, [s["tokens"] for s in data], images=[s["image_inputs"] for s in data],
                                    temperature=0.0, **{**KW, "max_new_tokens": 8, "stop_tokens": []}))
    assert outs[0].response_ids == outs[1].response_ids
    for (a, _), (b, _) in zip(*sampled):
        torch.testing.assert_close(a, b, atol=ulps(b, 128), rtol=0)
        assert float((b.topk(2).values @ torch.tensor([1.0, -1.0])).min()) > 2 * ulps(b, 128)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}


def test_fsdp2_mixed_precision_decodes_in_one_graph_with_the_hooks_numbers(monkeypatch, sampled, clean_env, one_thread):
    # The recipe's bf16 run on one process: FSDP2 per decoder layer (bf16 compute) and at the root (fp32), every
    # parameter gathered for the rollout. FSDP2's hooks are hidden from dynamo, so with them the compiled step splits
    # at every layer (on an H200, Qwen3-0.6B's 28 layers hit dynamo's recompile limit); the engine runs them as
    # plain casts (generation/_decode.py fsdp_hooks_as_casts). The same casts at the same places: every logit and
    # token equal to the hooks' own, bit for bit, eagerly (growing cache, rows compacted) and compiled (the
    # `eager` backend runs the traced ops as they are, so the graph-broken run is the reference).
    from contextlib import contextmanager

    import torchtune_grpo.generation._hf_rollout as hf_rollout
    from tests.hf_families import family_model
    from tests.recipe_utils import init_one_process_group
    from torchtune_grpo.models import TransformersDecoder
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.runtime.sharding import shard_model, unsharded
    from torchtune import training

    init_one_process_group()
    policy = TransformersDecoder(family_model("qwen3"), 256, {})
    shard_model(policy, [lambda name, m: training.get_shard_conditions(name, m, names_to_match=None)],
                cpu_offload=False, precision=Precision.from_name("bf16"))
    layer = policy.layers[0]
    fsdp_hooks = lambda: [*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]  # noqa: E731
    before = fsdp_hooks()

    @contextmanager
    def with_the_hooks(model):
        yield False

    def runs(engine):
        """(the hooks' run, the casts' run), each: the rollout and its steps' logits and tokens."""
        out = []
        for bypass in (with_the_hooks, hf_rollout.fsdp_hooks_as_casts):
            monkeypatch.setattr(hf_rollout, "fsdp_hooks_as_casts", bypass)
            torch._dynamo.reset()
            counters.clear()
            rollout, _ = _sample(engine, policy, sampled, seed=3)
            out.append((rollout, sampled[-1], dict(counters["graph_break"]), counters["stats"]["unique_graphs"]))
        return out

    with unsharded(policy, reshard_after_forward=True):
        assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}  # gathered in the compute dtype
        eager = runs(NativeGenerator(stop_check_interval=4))
        compiled = runs(NativeGenerator(stop_check_interval=4, compile_decode=True, compile_backend="eager"))
    torch._dynamo.reset()
    for (hooks, hook_steps, _, _), (casts, cast_steps, _, _) in (eager, compiled):
        assert casts.response_ids == hooks.response_ids
        assert len(cast_steps) == len(hook_steps) > 0
        for (a, ta), (b, tb) in zip(cast_steps, hook_steps):
            assert torch.equal(ta, tb) and torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert {len(r) for r in eager[0][0].response_ids} != {24}  # some rows stopped early: compaction ran
    (_, _, breaks, graphs), (_, _, no_breaks, one) = compiled
    assert breaks and graphs > 1  # FSDP2's hooks split the step: this test sees the difference
    assert no_breaks == {} and one == 1
    assert fsdp_hooks() == before  # FSDP2's own hooks are back on the layers for training
