"""torchtune_grpo.models: the decoder built from a Hugging Face directory computes the same logits as
transformers, for every supported architecture, and unsupported configs are named errors."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.hf_models import ARCHITECTURES, hf_logits, make_hf_model
from torchtune_grpo.models import HFCheckpointer, HFModelSpec, hf_model

VOCAB = 160  # tests/hf_models.py


def _tokens(batch: int = 2, length: int = 100, seed: int = 1) -> torch.Tensor:
    # 100 positions: past the llama3_2 fixture's original_max_position_embeddings (32), so the scaled
    # low frequencies matter.
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _ours(directory: Path, tmp_path: Path, **kwargs) -> nn.Module:
    model = hf_model(str(directory), **kwargs)
    state = HFCheckpointer(str(directory), str(tmp_path / "unused_out")).load_checkpoint()["model"]
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved random model per architecture: {arch: directory}."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: (make_hf_model(root / arch, arch), root / arch)[1] for arch in ARCHITECTURES}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_equal_transformers(arch, saved, tmp_path):
    tokens = _tokens()
    with torch.no_grad():
        ours = _ours(saved[arch], tmp_path)(tokens)
    ref = hf_logits(saved[arch], tokens)
    assert ours.shape == ref.shape == (2, 100, VOCAB)
    assert ref.abs().max() > 1.0  # not a degenerate model
    # transformers and torchtune compute the same fp32 function in another order: ~15 matmuls (2 layers x 7 projections,
    # the head), the RMSNorms' reductions, attention, and RoPE tables each library builds itself (angles pos x theta up
    # to ~100 rad, where 1 ulp is 7.6e-6: a relative error of that size in q and k). On logits |z| <~ 4 (1 ulp 4.8e-7):
    # ~sqrt(15) = 4 ulp from the matmuls, ~1e-5 relative from the rope angles at worst. Bound: 1e-4 (measured 1.9e-6, 4
    # ulp, with AVX-512 and AVX2 kernels).
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_applied(saved, tmp_path):
    # Without the llama3 scaling the same weights give other logits at these lengths: the equality above
    # really tests the scaling.
    directory = saved["llama3_2"]
    model = _ours(directory, tmp_path)
    from torchtune.modules import RotaryPositionalEmbeddings

    spec = HFModelSpec.from_directory(directory)
    plain = RotaryPositionalEmbeddings(spec.head_dim, max_seq_len=spec.max_seq_len, base=spec.rope_base)
    for layer in model.layers:
        layer.attn.pos_embeddings = plain
    with torch.no_grad():
        diff = (model(_tokens()) - hf_logits(directory, _tokens())).abs().max()
    assert diff > 1e-2


def test_qwen3_norm_before_rope_matters(saved, tmp_path):
    # torchtune 0.6.1's MultiHeadAttention(q_norm=..., k_norm=...) normalises after RoPE: with random norm
    # weights that is a different model, which is why the norm lives in the projection.
    directory = saved["qwen3"]
    model = _ours(directory, tmp_path)
    for layer in model.layers:
        attn = layer.attn
        attn.q_norm, attn.k_norm = attn.q_proj.norm, attn.k_proj.norm
        for proj in (attn.q_proj, attn.k_proj):
            proj.forward = nn.Linear.forward.__get__(proj)  # projection only, norm moved after RoPE
    with torch.no_grad():
        diff = (model(_tokens()) - hf_logits(directory, _tokens())).abs().max()
    assert diff > 1e-2


def test_tied_model_has_no_output_weight(saved):
    tied = hf_model(str(saved["qwen3_tied"]))
    untied = hf_model(str(saved["qwen3"]))
    assert "output.weight" not in tied.state_dict()
    assert untied.state_dict()["output.weight"].shape == (VOCAB, 64)
    # Qwen3 heads are head_dim (32) wide, not hidden_size / heads (16): q_proj is [4 * 32, 64]
    assert untied.layers[0].attn.q_proj.weight.shape == (128, 64)
    assert untied.layers[0].attn.q_proj.norm.scale.shape == (32,)


def test_qlora_state_dict_is_dequantised(tmp_path):
    # As torchtune's QLoRA builders: the adapted layers hold NF4 weights, and state_dict() (what the recipe
    # loads, gathers, merges and saves) gives them back as plain tensors of the model's dtype. Sizes NF4 can
    # quantise: q_proj 128 x 128 = 16,384 values = 64 x 256.
    from torchao.dtypes.nf4tensor import NF4Tensor
    from torchtune_grpo.models import lora_hf_model

    make_hf_model(tmp_path, "qwen3", hidden_size=128, intermediate_size=256, num_key_value_heads=4, head_dim=32)
    model = lora_hf_model(str(tmp_path), ["q_proj", "v_proj"], quantize_base=True)
    q_proj = model.layers[0].attn.q_proj
    assert isinstance(q_proj.weight, NF4Tensor) and not isinstance(model.layers[0].attn.k_proj.weight, NF4Tensor)
    state = model.state_dict()
    assert not any(isinstance(v, NF4Tensor) for v in state.values())
    weight = state["layers.0.attn.q_proj.weight"]
    assert weight.dtype == torch.float32 and torch.equal(weight, q_proj.weight.get_original_weight())
    assert isinstance(q_proj.weight, NF4Tensor)  # the model itself keeps its NF4 weights


def test_qlora_sizes_nf4_cannot_quantise_are_named(saved):
    from torchtune_grpo.models import lora_hf_model

    # The tiny Qwen3: 4 heads x head_dim 32 on hidden 64, 2 KV heads. q_proj is 128 x 64 = 8,192 values and
    # v_proj 64 x 64 = 4,096: not multiples of NF4's 64 x 256 = 16,384 (torchao itself only asserts on counts).
    with pytest.raises(ValueError, match=r"multiple of 16,384 values; .*q_proj \(128 x 64 = 8,192 values\), "
                                         r"v_proj \(64 x 64 = 4,096 values\)\. Leave those layers out"):
        lora_hf_model(str(saved["qwen3"]), ["q_proj", "v_proj"], quantize_base=True)
    lora_hf_model(str(saved["qwen3"]), ["q_proj", "v_proj"])  # without NF4 any size is fine


def _saved_with(directory: Path, arch: str, **changes) -> Path:
    """A random ``arch`` model saved to ``directory``, its config.json then edited."""
    make_hf_model(directory, arch)
    return _config(directory, **changes)


def _config(directory: Path, **changes) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "arch, changes, names",
    [
        ("qwen3", {"model_type": "qwen3_moe"},
         ["model_type", "'qwen3_moe'", "mixture-of-experts", "model.backend: transformers"]),
        ("qwen3", {"num_experts": 8}, ["num_experts = 8", "mixture-of-experts", "model.backend: transformers"]),
        ("qwen3", {"use_sliding_window": True}, ["use_sliding_window"]),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, ["layer_types", "sliding_attention"]),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
         ["rope_parameters.rope_type", "'yarn'", "'default'", "'llama3'"]),
        ("llama3", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
         ["rope_scaling.rope_type", "'linear'"]),
        ("llama3", {"hidden_act": "gelu"}, ["hidden_act", "'gelu'", "'silu'"]),
        ("llama3", {"attention_bias": True}, ["attention_bias"]),
        ("llama3", {"quantization_config": {"quant_method": "gptq"}}, ["quantization_config", "gptq"]),
    ],
)
def test_unsupported_config_is_named(arch, changes, names, tmp_path):
    # Forced onto torchtune's modules, a field they do not build is an error naming it (and the key to change).
    directory = _saved_with(tmp_path / arch, arch, **changes)
    with pytest.raises(ValueError) as err:
        hf_model(str(directory), backend="torchtune")
    for name in names:
        assert name in str(err.value), (name, str(err.value))
    if "quantization" not in str(changes):
        assert "model.backend" in str(err.value)
    with pytest.raises(ValueError):  # the checkpointer checks the same config
        HFCheckpointer(str(directory), str(tmp_path / "out"), backend="torchtune")


@pytest.mark.parametrize(
    "arch, changes, backend",
    [
        ("qwen3", {}, "torchtune"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "transformers"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "transformers"),
        ("llama3", {"hidden_act": "gelu"}, "transformers"),
        ("llama3", {"attention_bias": True}, "transformers"),
        ("mistral", {"sliding_window": 8}, "transformers"),  # a window shorter than the context
        ("mistral", {"sliding_window": 512}, "torchtune"),  # = max_position_embeddings: never bites
    ],
)
def test_auto_backend_is_torchtune_where_it_builds_the_same_model(arch, changes, backend, tmp_path):
    directory = _saved_with(tmp_path / arch, arch, **changes)
    model = hf_model(str(directory))
    assert (type(model).__name__ == "TransformersDecoder") == (backend == "transformers")
    assert HFCheckpointer(str(directory), str(tmp_path / "out")).backend == backend


@pytest.mark.parametrize(
    "changes, names",
    [
        ({"quantization_config": {"quant_method": "gptq"}}, ["quantization_config", "gptq"]),
        ({"is_encoder_decoder": True}, ["encoder-decoder"]),
    ],
)
def test_refused_by_either_backend(changes, names, tmp_path):
    directory = _saved_with(tmp_path / "m", "qwen3", **changes)
    for backend in ("auto", "transformers"):
        with pytest.raises(ValueError) as err:
            hf_model(str(directory), backend=backend)
        assert all(n in str(err.value) for n in names), str(err.value)


def test_unknown_backend_names_the_key(tmp_path):
    directory = _saved_with(tmp_path / "m", "qwen3")
    with pytest.raises(ValueError, match=r"model.backend = 'tensorflow'.*'auto', 'torchtune', 'transformers'"):
        hf_model(str(directory), backend="tensorflow")


def test_hub_style_rope_fields(tmp_path):
    # Hub config.json files (transformers 4) write rope_theta + rope_scaling, transformers 5 writes
    # rope_parameters: both give the same spec.
    make_hf_model(tmp_path / "m", "llama3_2")
    v5 = HFModelSpec.from_directory(tmp_path / "m")
    params = json.loads((tmp_path / "m" / "config.json").read_text())["rope_parameters"]
    theta = params.pop("rope_theta")
    _config(tmp_path / "m", rope_parameters=None, rope_theta=theta, rope_scaling=params)
    v4 = HFModelSpec.from_directory(tmp_path / "m")
    assert v4 == v5 and v4.rope_base == 500000.0 and v4.rope_scaling.factor == 8.0


def test_mistral_sliding_window_bounds_max_seq_len(tmp_path):
    # Attention within a window of 128 equals full attention on sequences of at most 128 tokens: the model
    # is built for exactly those, and asking for more is an error naming the field.
    # That is the torchtune backend (forced); by default such a directory is transformers' own module, whose
    # attention applies the window, for any length up to max_position_embeddings.
    directory = _saved_with(tmp_path / "m", "mistral", sliding_window=128)
    assert hf_model(str(directory), backend="torchtune").max_seq_len == 128
    assert hf_model(str(directory), backend="torchtune", max_seq_len=64).max_seq_len == 64
    with pytest.raises(ValueError, match="sliding_window = 128"):
        hf_model(str(directory), backend="torchtune", max_seq_len=256)
    assert hf_model(str(directory)).max_seq_len == 512


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_model(str(tmp_path / "nowhere"))
