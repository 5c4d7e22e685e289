"""The native engine's growing KV cache (generation/_hf_cache.py) holds exactly what transformers' ``DynamicLayer``
holds, through growth past its room, batch reorders (the group repeat and compaction) and crops; only plain
full-attention layers are replaced. Copies only: every comparison is exact."""

import torch
from transformers import AutoConfig, DynamicLayer

from torchtune_grpo.generation._hf_cache import GrowingLayer, growing_cache


def _steps(layer_a, layer_b, batch, steps, new):
    for _ in range(steps):
        k, v = torch.randn(batch, 2, new, 4), torch.randn(batch, 2, new, 4)
        ka, va = layer_a.update(k, v)
        kb, vb = layer_b.update(k.clone(), v.clone())
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_growing_layer_equals_dynamic_layer_through_growth_reorders_and_crops():
    torch.manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    _steps(grow, plain, batch=2, steps=1, new=30)  # a prefill of 30 slots: room for 30 + 64
    room = grow._k.size(-2)
    _steps(grow, plain, batch=2, steps=70, new=1)  # past the first room: one doubling
    assert grow._k.size(-2) == 2 * room and grow.get_seq_length() == plain.get_seq_length() == 100
    index = torch.tensor([0, 0, 1, 1, 1])  # repeat to a group's rows, then drop some (compaction)
    grow.reorder_cache(index)
    plain.reorder_cache(index)
    assert torch.equal(grow.keys, plain.keys) and torch.equal(grow.values, plain.values)
    keep = torch.tensor([1, 4])
    grow.batch_select_indices(keep)
    plain.batch_select_indices(keep)
    _steps(grow, plain, batch=2, steps=5, new=1)
    grow.crop(-3)
    plain.crop(-3)
    assert grow.get_seq_length() == plain.get_seq_length() == 102
    _steps(grow, plain, batch=2, steps=2, new=3)  # a later turn's tokens after the crop
    assert torch.equal(grow.keys, plain.keys)


def test_only_full_attention_layers_grow():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=3, sliding_window=8, vocab_size=64,
                                  hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    kinds = [type(layer).__name__ for layer in growing_cache(config).layers]
    assert kinds == ["DynamicSlidingWindowLayer", "GrowingLayer", "DynamicSlidingWindowLayer"]
    llama = AutoConfig.for_model("llama", num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=2)
    assert [type(layer) for layer in growing_cache(llama).layers] == [GrowingLayer, GrowingLayer]
