"""The native engine's speed machinery keeps results exact: cache reuse, shared prefill, compiled decode.

All greedy comparisons are exact token equality against a fresh engine or torchtune's own
``torchtune.generation.generate`` (the simple, unbatched path).
"""

import torch
from torch._dynamo.utils import counters
from torchtune.generation import generate

from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.generation._cache import attention_modules
from tests.conftest import make_tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]


def _greedy(engine, model, prompts, group_size=2, max_new_tokens=10):
    return engine.generate(
        model, prompts, group_size=group_size, max_new_tokens=max_new_tokens, pad_id=0, stop_tokens=[96]
    ).response_ids


def _simple_path(model, prompt, max_new_tokens):
    ref, _ = generate(
        model, torch.tensor([prompt]), max_generated_tokens=max_new_tokens, pad_id=0, temperature=1e-6, top_k=1
    )
    return ref[0, len(prompt):].tolist()


def test_cache_is_allocated_once_and_reused_across_calls_and_shapes():
    model = make_tiny_decoder()
    engine = NativeGenerator(temperature=0.0, cache_len_multiple=64)
    first = _greedy(engine, model, PROMPTS)
    assert engine.cache.allocations == 1
    # Same batch, other prompt lengths and budget that still fit the 64-slot cache: no new allocation,
    # and the stale contents of the previous call change nothing.
    longer = [p + [20, 21, 22] for p in PROMPTS]
    assert _greedy(engine, model, longer, max_new_tokens=12) == _greedy(
        NativeGenerator(temperature=0.0), model, longer, max_new_tokens=12
    )
    assert _greedy(engine, model, PROMPTS) == first
    assert engine.cache.allocations == 1
    # fp32: the shared-prefix layout, each prompt's keys/values once ([B, ...]) and each row's completion
    # ([B x G, ...]), 64 slots each.
    assert [k[0].shape for k in engine.cache.k] == [(3, 2, 64, 16), (6, 2, 64, 16)]
    # A longer sequence than the cache holds grows it (rounded up to 64 slots) ...
    assert _greedy(engine, model, PROMPTS, max_new_tokens=70)[0][:10] == first[0]
    assert engine.cache.allocations == 2 and engine.cache.capacities == [64, 128]
    # ... and another batch size (group size) replaces it; results stay those of the simple path.
    out = _greedy(engine, model, PROMPTS, group_size=3)
    assert engine.cache.allocations == 3
    for i, prompt in enumerate(PROMPTS):
        expected = _simple_path(model, prompt, 10)
        assert out[3 * i] == out[3 * i + 1] == out[3 * i + 2] == expected


def test_release_cache_and_no_reuse_free_the_storage():
    model = make_tiny_decoder()
    engine = NativeGenerator(temperature=0.0)
    _greedy(engine, model, PROMPTS)
    assert engine.cache.k
    engine.release_cache()
    assert not engine.cache.k
    engine = NativeGenerator(temperature=0.0, reuse_cache=False)
    _greedy(engine, model, PROMPTS)
    assert not engine.cache.k


def test_training_forward_after_generation_sees_no_cache():
    # torchtune's attention takes the causal (is_causal) path only when attn.kv_cache is None: a cache
    # left attached, even disabled, would make a mask-less training forward attend to the future.
    model = make_tiny_decoder()
    tokens = torch.randint(1, 90, (2, 12))
    before = model(tokens)
    _greedy(NativeGenerator(temperature=0.0), model, PROMPTS)
    assert all(a.kv_cache is None and not a.cache_enabled for a in attention_modules(model))
    assert torch.equal(model(tokens), before)
    assert "unembed" not in model.__dict__


def test_shared_prefill_equals_prefilling_every_row():
    model = make_tiny_decoder()
    shared = NativeGenerator(temperature=0.0, share_prefill=True)
    unshared = NativeGenerator(temperature=0.0, share_prefill=False)
    assert _greedy(shared, model, PROMPTS, group_size=4) == _greedy(unshared, model, PROMPTS, group_size=4)
    # Sampling with the same generator: the same noise meets the same logits (up to fp batch effects,
    # which this tiny fp32 model does not show), so the samples agree too.
    kwargs = dict(group_size=4, max_new_tokens=12, pad_id=0, stop_tokens=[96])
    a = NativeGenerator(share_prefill=True).generate(
        model, PROMPTS, generator=torch.Generator().manual_seed(7), **kwargs
    )
    b = NativeGenerator(share_prefill=False).generate(
        model, PROMPTS, generator=torch.Generator().manual_seed(7), **kwargs
    )
    assert a.response_ids == b.response_ids
    # ... and the G samples of a group really differ (each row has its own noise after the copy).
    assert len({tuple(r) for r in a.response_ids[:4]}) > 1


def test_one_prompt_with_grouped_query_attention_decodes_like_torchtune():
    # batch_size 1 (one prompt per call) with GQA (4 query / 2 key-value heads) crashed at the first decode
    # step ("view size is not compatible"): the group's attention output was a strided view. Every row of
    # the group must give torchtune's own greedy tokens for that prompt.
    model = make_tiny_decoder()
    for prompt in PROMPTS:
        rows = _greedy(NativeGenerator(temperature=0.0), model, [prompt], group_size=3)
        assert rows == [_simple_path(model, prompt, 10)] * 3


def test_stop_checks_only_every_k_tokens_do_not_change_results():
    model = make_tiny_decoder()
    greedy = NativeGenerator(temperature=0.0).generate(
        model, PROMPTS, group_size=1, max_new_tokens=12, pad_id=0, stop_tokens=[96]
    )
    stop = greedy.response_ids[1][1]  # the 2nd greedy token of prompt 1 becomes a stop token
    for interval in (1, 3, 100):
        out = NativeGenerator(temperature=0.0, stop_check_interval=interval).generate(
            model, PROMPTS, group_size=1, max_new_tokens=12, pad_id=0, stop_tokens=[stop]
        )
        for row, full in zip(out.response_ids, greedy.response_ids):
            expected = full[: full.index(stop) + 1] if stop in full else full
            assert row == expected


def test_compiled_decode_step_is_one_graph_without_breaks_and_exact():
    # The CUDA path compiles decode_step (mode="reduce-overhead"); on CPU the same tracing runs with the
    # aot_eager backend: one graph, no graph break (a break would mean a host sync or Python-side
    # dynamism in the step), no recompilation for another prompt length, and the same tokens as eager.
    # Both cache layouts: shared prefix (fp32 default) and per row (share_prefill=False, as half precision).
    for share in (True, False):
        torch._dynamo.reset()
        counters.clear()
        model = make_tiny_decoder()
        engine = NativeGenerator(
            temperature=0.0, compile_decode=True, compile_backend="aot_eager", share_prefill=share
        )
        eager = NativeGenerator(temperature=0.0)
        assert _greedy(engine, model, PROMPTS) == _greedy(eager, model, PROMPTS)
        longer = [p + [30] for p in PROMPTS]
        assert _greedy(engine, model, longer) == _greedy(eager, model, longer)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
        assert len(engine.cache.k) == (2 if share else 1)
    torch._dynamo.reset()


def test_fsdp_model_decodes_without_per_layer_hooks_in_one_compiled_graph(clean_env, one_thread):
    # FSDP2 on a one-process gloo group (in this process; the ``clean_env`` fixture destroys the group), as the
    # recipe runs: once every parameter is gathered, decode steps call the layers directly, so the compiled
    # step is one graph (not one per layer) and tokens are exact; multi-turn sessions continue episodes on it
    # exactly.
    from torch.distributed.fsdp import fully_shard, FSDPModule

    import tests.test_multiturn_continuation as mt
    from tests.recipe_utils import init_one_process_group
    from torchtune_grpo.generation._native import can_skip_module_hooks

    init_one_process_group()

    def gathered(model):
        """Sharded as the recipe shards, then every parameter gathered as torchtune_grpo.runtime.sharding.unsharded does."""
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert not can_skip_module_hooks(model)  # sharded parameters: FSDP's hooks must gather them
        for m in fsdp:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        return model, fsdp

    kw = dict(group_size=2, max_new_tokens=10, pad_id=0, stop_tokens=[96])
    ref = NativeGenerator(temperature=0.0).generate(make_tiny_decoder(), PROMPTS, **kw).response_ids
    model, fsdp = gathered(make_tiny_decoder())
    assert can_skip_module_hooks(model)
    assert NativeGenerator(temperature=0.0).generate(model, PROMPTS, **kw).response_ids == ref
    torch._dynamo.reset()
    counters.clear()
    try:
        engine = NativeGenerator(temperature=0.0, compile_decode=True, compile_backend="aot_eager")
        assert engine.generate(model, PROMPTS, **kw).response_ids == ref
        assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    # Multi-turn sessions (tests/test_multiturn_continuation.py) on the same unsharded FSDP model: prefills
    # through FSDP's root hooks, decode steps through the layers; the plain model's episodes.
    plain = mt.episodes(NativeGenerator(temperature=0.0), mt.make_tiny_decoder(scale=8.0))
    sharded, _ = gathered(mt.make_tiny_decoder(scale=8.0))
    got = mt.episodes(NativeGenerator(temperature=0.0), sharded)
    assert got.response_ids == plain.response_ids and max(got.turns) == 3
    for m in fsdp:
        m.reshard()
    assert not can_skip_module_hooks(model)


def test_shared_prefix_attention_equals_sdpa_over_each_rows_full_cache():
    # Worked against the definition: each row attends over [its prompt | its completion] with SDPA
    # (GQA, padded prompt slots masked), the prompt's keys/values repeated for every row of the group.
    import torch.nn.functional as F

    from torchtune_grpo.generation._cache import CacheState
    from torchtune_grpo.generation._prefix_attention import PrefixDecodeMask, SharedPrefixKVCache

    torch.manual_seed(0)
    b, g, h, h_kv, d, p, t = 3, 4, 4, 2, 8, 5, 3
    n = b * g
    pk, pv = torch.randn(b, h_kv, 8, d), torch.randn(b, h_kv, 8, d)  # 8 slots stored, p read
    ck, cv = torch.randn(n, h_kv, 6, d), torch.randn(n, h_kv, 6, d)  # t - 1 written, then this token
    q, k_new, v_new = torch.randn(n, h, 1, d), torch.randn(n, h_kv, 1, d), torch.randn(n, h_kv, 1, d)
    pad = torch.tensor([0, 2, 4])  # left padding of each prompt
    real = torch.arange(p)[None, :] >= pad[:, None]  # [B, P]
    prefix_mask = torch.zeros(b, p).masked_fill(~real, float("-inf"))[:, None, None, :]

    # Reference: every row's full keys [P + t], its prompt's keys repeated.
    full_k = torch.cat([pk[:, :, :p].repeat_interleave(g, 0), ck[:, :, : t - 1], k_new], dim=2)
    full_v = torch.cat([pv[:, :, :p].repeat_interleave(g, 0), cv[:, :, : t - 1], v_new], dim=2)
    keep = torch.cat([real.repeat_interleave(g, 0), torch.ones(n, t, dtype=torch.bool)], dim=1)
    ref = F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=keep[:, None, None, :], enable_gqa=True)

    # Eager: the completion window is exactly the t written slots.
    state = CacheState(slots=torch.tensor([t - 1]), window=t)
    cache = SharedPrefixKVCache(pk, pv, ck.clone(), cv.clone(), state, prefix_window=p)
    out = cache.attend(q, k_new, v_new, PrefixDecodeMask(prefix_mask, None))
    assert out.shape == (n, h, 1, d)
    # Same attention, other arithmetic: the cache scores prompt and completion keys in two einsums and takes one
    # softmax over their concatenation, SDPA one fused kernel (its own blocking and exp): q.k over d = 8 and the
    # weighted sum over <= 8 values of N(0, 1) inputs, outputs |o| <~ 2 (ulp 2.4e-7). A few roundings each side:
    # ~1e-6 absolute worst case at |o| ~ 2. Bound: 1e-6 + 1e-5 relative (~10 ulp at 2), for every kernel.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(cache.k_cache[:, :, t - 1], k_new[:, :, 0])  # the new token was written

    # Compiled-style fixed windows: 6 completion slots (the last 3 unwritten, masked) and 8 prompt slots
    # (3 unused, masked). Leftover finite values there must not matter.
    state = CacheState(slots=torch.tensor([t - 1]), window=6)
    cache = SharedPrefixKVCache(pk, pv, ck.clone(), cv.clone(), state, prefix_window=8)
    wide_prefix = torch.full((b, 1, 1, 8), float("-inf"))
    wide_prefix[..., :p] = prefix_mask
    completion = torch.zeros(1, 1, 1, 6).masked_fill(torch.arange(6) >= t, float("-inf"))
    out = cache.attend(q, k_new, v_new, PrefixDecodeMask(wide_prefix, completion))
    # As above (a wider, masked window adds exact zeros). Bound: 1e-6 + 1e-5 relative.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_half_precision_and_per_row_option_use_one_cache_row_per_sequence():
    # bf16 scores would be rounded by a bf16 matmul (SDPA keeps them fp32): such rollouts keep the per-row
    # layout; so does share_prefill=False. fp32 with share_prefill stores each prompt once (rows B, then N).
    model = make_tiny_decoder()
    engine = NativeGenerator(temperature=0.0)
    _greedy(engine, model, PROMPTS, group_size=4)
    assert [k[0].size(0) for k in engine.cache.k] == [3, 12]
    unshared = NativeGenerator(temperature=0.0, share_prefill=False)
    _greedy(unshared, model, PROMPTS, group_size=4)
    assert [k[0].size(0) for k in unshared.cache.k] == [12]
    half = NativeGenerator(temperature=0.0)
    out = _greedy(half, make_tiny_decoder().to(torch.bfloat16), PROMPTS, group_size=4)
    assert [(k[0].size(0), k[0].dtype) for k in half.cache.k] == [(12, torch.bfloat16)]
    assert all(out[4 * i] == out[4 * i + j] for i in range(3) for j in range(4))  # greedy: a group agrees


def test_rollout_tensors_are_normal_tensors_usable_in_training():
    # The engine decodes under torch.inference_mode; nothing it returns may be an inference tensor (those
    # cannot be saved for backward or updated in place by the training step).
    model = make_tiny_decoder()
    rollout = NativeGenerator().generate(
        model, PROMPTS, group_size=2, max_new_tokens=4, pad_id=0, stop_tokens=[96],
        generator=torch.Generator().manual_seed(0),
    )
    assert not rollout.truncated.is_inference()
    w = torch.ones(len(rollout.response_ids), requires_grad=True)
    (w * rollout.truncated).sum().backward()  # saved for backward: fails on an inference tensor
    assert torch.equal(w.grad, rollout.truncated.float())
    rollout.truncated[0] = False  # in place: fails on an inference tensor
    # The model's own forward and training still work after a rollout.
    model(torch.randint(1, 90, (2, 12))).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_lean_decode_layers_give_torchtunes_tokens_and_step_aside_for_hooks(monkeypatch):
    # The lean decode layer (submodule forwards called directly, one RoPE call for q and k) must give the
    # simple path's greedy tokens for both RoPE flavours (Qwen2's rotate-half, Llama 3's scaled interleaved),
    # and must not run when a submodule carries a forward hook (it would skip the hook).
    from torchtune.models.llama3_2 import llama3_2

    import torchtune_grpo.generation._decode_steps as layouts

    calls = []
    real = layouts.lean_decode_layer
    monkeypatch.setattr(layouts, "lean_decode_layer", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    llama = llama3_2(
        vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256,
        intermediate_dim=128, scale_factor=32,
    )
    with torch.no_grad():
        for p in llama.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    for model in (make_tiny_decoder(), llama.eval()):
        calls.clear()
        out = _greedy(NativeGenerator(temperature=0.0), model, PROMPTS, group_size=2)
        assert len(calls) == 2 * 9  # 2 layers x 9 decode steps (the 10th token needs none)
        for i, prompt in enumerate(PROMPTS):
            assert out[2 * i] == out[2 * i + 1] == _simple_path(model, prompt, 10)

    model = make_tiny_decoder()
    seen = []
    model.layers[0].mlp.w1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls.clear()
    out = _greedy(NativeGenerator(temperature=0.0), model, PROMPTS, group_size=2)
    assert calls == [] and len(seen) == 1 + 9  # the hook ran at the prefill and every decode step
    assert out[0] == _simple_path(model, PROMPTS[0], 10)
