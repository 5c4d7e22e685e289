"""HFCheckpointer: Hugging Face directories in (single file, sharded, bf16, tied) and out (a directory
transformers loads with the trained model's logits), with named errors for broken directories."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import ARCHITECTURES, hf_logits, make_hf_model
from torchtune_grpo.models import HFCheckpointer, hf_model, weight_files

VOCAB = 160


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def _train_a_little(model: torch.nn.Module, seed: int = 7) -> None:
    """Stands in for training: every parameter moves, so a save that dropped or mis-mapped one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sharded_round_trip(arch, tmp_path):
    # Source sharded by transformers (index + several files) -> our model -> changed -> saved -> transformers.
    src = tmp_path / "src"
    make_hf_model(src, arch, max_shard_size="40KB")
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    files = weight_files(src)
    assert len(files) > 1 and (src / "model.safetensors.index.json").is_file()

    ckpt = HFCheckpointer(str(src), str(tmp_path / "out"))
    model = hf_model(str(src))
    model.load_state_dict(ckpt.load_checkpoint()["model"])
    model.eval()
    with torch.no_grad():
        # transformers against torchtune on the same weights (as tests/test_models.py): other op orders in ~15 matmuls,
        # the norms, attention and each library's RoPE tables, on logits |z| <~ 4 (1 ulp 4.8e-7): a few ulp, ~1e-5
        # relative at worst from the rope angles. Bound: 1e-4 (measured 1.4e-6).
        torch.testing.assert_close(model(_tokens()), hf_logits(src, _tokens()), atol=1e-4, rtol=0)

    _train_a_little(model)
    out = ckpt.save_checkpoint({"model": model.state_dict()}, epoch=3)
    assert out == tmp_path / "out" / "epoch_3"
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    # config, tokenizer and generation files come along unchanged
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    saved_names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert ("lm_head.weight" in saved_names) == (not ARCHITECTURES[arch]["tie_word_embeddings"])
    with torch.no_grad():
        # The saved copy against the model: as above, transformers against torchtune (measured 1.7e-6). Bound: 1e-4.
        torch.testing.assert_close(hf_logits(out, _tokens()), model(_tokens()), atol=1e-4, rtol=0)


def test_bf16_single_file_and_reshard(tmp_path):
    src = tmp_path / "src"
    make_hf_model(src, "qwen3", dtype=torch.bfloat16)
    assert weight_files(src) == ["model.safetensors"]
    ckpt = HFCheckpointer(str(src), str(tmp_path / "out"), max_shard_size_gib=30 / 2**20)  # 30 KiB shards
    state = ckpt.load_checkpoint()["model"]
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    out = ckpt.save_checkpoint({"model": state}, epoch=1)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    reloaded = {}
    for shard in shards:
        reloaded.update(load_file(str(shard)))
    original = load_file(str(src / "model.safetensors"))
    assert reloaded.keys() == original.keys()
    for key, tensor in original.items():
        assert reloaded[key].dtype == torch.bfloat16 and torch.equal(reloaded[key], tensor), key


def test_missing_shard_is_named(tmp_path):
    make_hf_model(tmp_path / "m", "llama3", max_shard_size="40KB")
    victim = weight_files(tmp_path / "m")[1]
    (tmp_path / "m" / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out"))


def test_no_weights(tmp_path):
    make_hf_model(tmp_path / "m", "llama3")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*model.safetensors"):
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out"))


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    make_hf_model(tmp_path / "m", "qwen2")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["intermediate_size"] = 80  # the weights have 96
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out")).load_checkpoint()
    message = str(err.value)
    # the first MLP tensor read (safetensors lists names sorted): down_proj, [hidden, intermediate]
    assert "tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 96)" in message
    assert "config.json describes (64, 80)" in message


def test_unexpected_and_missing_tensors_are_named(tmp_path):
    make_hf_model(tmp_path / "m", "llama3")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3 tensor in a Llama
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_norm.weight' does not belong to a llama"):
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out")).load_checkpoint()
    del weights["model.layers.0.self_attn.q_norm.weight"], weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out")).load_checkpoint()


def test_output_dir_must_differ(tmp_path):
    make_hf_model(tmp_path / "m", "llama3")
    with pytest.raises(ValueError, match="output_dir must differ"):
        HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "m"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_weight_sync_names_every_architecture(arch, tmp_path):
    # The vLLM engine receives the trainer's parameters one by one under Hugging Face names: for every
    # architecture that is exactly the checkpoint's tensors again (RoPE permutation undone for Llama/Mistral,
    # Qwen3's q/k norms named q_norm/k_norm).
    from torchtune_grpo.generation import TuneToHFNames

    make_hf_model(tmp_path / "m", arch)
    original = load_file(str(tmp_path / "m" / "model.safetensors"))
    tune = HFCheckpointer(str(tmp_path / "m"), str(tmp_path / "out")).load_checkpoint()["model"]
    to_hf = TuneToHFNames(json.loads((tmp_path / "m" / "config.json").read_text()))
    synced = dict(to_hf(name, tensor) for name, tensor in tune.items())
    assert "model.layers.1.mlp.down_proj.weight" in synced
    assert synced.keys() == original.keys()  # transformers saves no lm_head for a tied model either
    for name, tensor in synced.items():
        assert torch.equal(tensor, original[name]), name
