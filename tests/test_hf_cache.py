"""The native engine's growing KV cache (generation/_hf_cache.py) holds exactly what transformers' ``DynamicLayer``
and ``DynamicSlidingWindowLayer`` hold and returns what they return, through growth past its room, batch reorders
(the group repeat and compaction) and crops; only those two layer kinds are replaced. Copies only: every comparison
is exact."""

import torch
from transformers import AutoConfig, DynamicLayer
from transformers.cache_utils import DynamicSlidingWindowLayer

from torchtune_grpo.generation._hf_cache import GrowingLayer, GrowingWindowLayer, growing_cache


def _steps(layer_a, layer_b, batch, steps, new):
    for _ in range(steps):
        k, v = torch.randn(batch, 2, new, 4), torch.randn(batch, 2, new, 4)
        ka, va = layer_a.update(k, v)
        kb, vb = layer_b.update(k.clone(), v.clone())
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)
        assert layer_a.get_seq_length() == layer_b.get_seq_length()
        assert layer_a.get_mask_sizes(1) == layer_b.get_mask_sizes(1)


def _repeat_then_compact(layer_a, layer_b):
    index = torch.tensor([0, 0, 1, 1, 1])  # repeat to a group's rows, then drop some (compaction)
    for layer in (layer_a, layer_b):
        layer.reorder_cache(index)
    assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)
    for layer in (layer_a, layer_b):
        layer.batch_select_indices(torch.tensor([1, 4]))


def test_growing_layer_equals_dynamic_layer_through_growth_reorders_and_crops():
    torch.manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    _steps(grow, plain, batch=2, steps=1, new=30)  # a prefill of 30 slots: room for 30 + 64
    room = grow._k.size(-2)
    _steps(grow, plain, batch=2, steps=70, new=1)  # past the first room: one doubling
    assert grow._k.size(-2) == 2 * room and grow.get_seq_length() == plain.get_seq_length() == 100
    _repeat_then_compact(grow, plain)
    _steps(grow, plain, batch=2, steps=5, new=1)
    grow.crop(-3)
    plain.crop(-3)
    assert grow.get_seq_length() == plain.get_seq_length() == 102
    _steps(grow, plain, batch=2, steps=2, new=3)  # a later turn's tokens after the crop
    assert torch.equal(grow.keys, plain.keys)


def test_growing_window_layer_equals_transformers_sliding_layer():
    torch.manual_seed(0)
    for prefill in (30, 5):  # longer than the window of 8, and shorter
        grow, plain = GrowingWindowLayer(sliding_window=8), DynamicSlidingWindowLayer(sliding_window=8)
        _steps(grow, plain, batch=2, steps=1, new=prefill)
        room = grow._k.size(-2)
        _steps(grow, plain, batch=2, steps=room + 10, new=1)  # past the first buffer's room: a new buffer
        assert grow._k.size(-2) == 2 * 8 + 64 and grow.keys.size(-2) == 7  # at most two windows and the spare room
        _repeat_then_compact(grow, plain)
        _steps(grow, plain, batch=2, steps=90, new=1)
        _steps(grow, plain, batch=2, steps=3, new=3)  # several tokens at once (a later turn)
    # A long window holds what the row has, doubled as it grows, not the window: 4,096 slots would be allocated
    # for a 10-token prefill otherwise.
    grow, plain = GrowingWindowLayer(sliding_window=4096), DynamicSlidingWindowLayer(sliding_window=4096)
    _steps(grow, plain, batch=2, steps=1, new=10)
    assert grow._k.size(-2) == 10 + 64
    _steps(grow, plain, batch=2, steps=65, new=1)
    assert grow._k.size(-2) == 2 * (10 + 64)


def test_only_attention_layers_grow():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=3, sliding_window=8, vocab_size=64,
                                  hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    kinds = [type(layer).__name__ for layer in growing_cache(config).layers]
    assert kinds == ["GrowingWindowLayer", "GrowingLayer", "GrowingWindowLayer"]
    assert [layer.sliding_window for layer in growing_cache(config).layers if layer.is_sliding] == [8, 8]
    # Every slot kept (a prefill whose keys go on to a fixed-shape cache): the window is the mask's business.
    assert {type(layer) for layer in growing_cache(config, full_history=True).layers} == {GrowingLayer}
    qwen3_5 = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=2, vocab_size=64, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   layer_types=["linear_attention", "full_attention"])
    layers = growing_cache(qwen3_5).layers
    assert type(layers[0]) not in (GrowingLayer, GrowingWindowLayer) and type(layers[1]) is GrowingLayer
    llama = AutoConfig.for_model("llama", num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=2)
    assert [type(layer) for layer in growing_cache(llama).layers] == [GrowingLayer, GrowingLayer]
