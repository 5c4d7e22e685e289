"""The reference model in less memory (torchtune_grpo/runtime/reference_setup.py, `reference:`).

By hand: NF4 codes are QLoRA's 16 levels times each block's absmax, int8 values and row scales, the bytes each
mode holds. Equalities: the NF4 reference is exactly the model with de-quantised weights; an offloaded reference
streams one layer at a time and computes exactly what the resident one does. Through the recipe: an NF4,
offloaded reference gives the same weights on 1 process (1 or 4 micro-batches, a token budget) and 2 processes,
a resumed run is the uninterrupted one, and a KL other than the full reference's; bad settings name the key.
"""

import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune.models.qwen2 import qwen2

from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, recipe_in_process, run_in_process, run_tune, weights, write_config
from torchtune_grpo.runtime.model_setup import Placement
from torchtune_grpo.runtime.precision import Precision
from torchtune_grpo.runtime.reference_setup import (
    build_reference, module_bytes, OffloadedLayers, ReferenceOptions,
)

# NF4 needs sizes that divide into blocks of 64 (DESIGN.md): 128 wide, 256 intermediate, 4 heads.
MODEL = {"vocab_size": 96, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "embed_dim": 128,
         "intermediate_dim": 256, "max_seq_len": 64, "tie_word_embeddings": True}
CPU = Placement(torch.device("cpu"), 1, Precision.from_name("fp32"))
# QLoRA's NF4 levels (Dettmers et al. 2023, arXiv:2305.14314, appendix E), rounded to 4 decimals there.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
])


@pytest.fixture(scope="module")
def tiny():
    """A tiny decoder with weights of std 0.2 (peaked attention: scores of several units) and its state."""
    torch.manual_seed(0)
    model = qwen2(**MODEL)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    cfg = OmegaConf.create({"_component_": "torchtune.models.qwen2.qwen2", **MODEL})
    tokens = torch.randint(0, MODEL["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(1))
    return model.eval(), cfg, {k: v.clone() for k, v in model.state_dict().items()}, tokens


def _reference(tiny, precision, offload=False):
    _, cfg, state, _ = tiny
    return build_reference(cfg, state, CPU, ReferenceOptions(precision, offload), source="test", max_len=32)


def _linear_names(model):
    return [f"layers.{n}" for n, m in model.layers.named_modules() if isinstance(m, nn.Linear)]


def test_nf4_reference_is_the_model_with_its_weights_dequantised(tiny):
    model, _, state, tokens = tiny
    ref = _reference(tiny, "nf4")
    names = _linear_names(model)
    assert len(names) == 2 * 7  # q, k, v, output proj and the MLP's three, per layer
    plain = qwen2(**MODEL).eval()
    dequantised = dict(state)
    for name in names:
        w = ref.get_submodule(name).weight
        assert type(w).__name__ == "NF4Tensor"
        deq = w.get_original_weight()  # [out, in] fp32
        # Every value is one of the 16 levels times its block's absmax, and the absmax element is exactly +-1 level
        # (double quantisation rounds the absmax itself, not the level): compare in blocks of 64.
        blocks = deq.reshape(-1, 64)
        scale = blocks.abs().amax(dim=1, keepdim=True)
        level = blocks / scale
        nearest = (level.unsqueeze(-1) - NF4_LEVELS).abs().min(dim=-1).values
        assert nearest.max() < 5e-5, nearest.max()  # the paper prints the levels to 4 decimals: within 0.5e-4
        # 4 bits of a weight of std 0.2: the error is a fraction of the block's absmax (~0.5), never the weight
        assert 0 < (deq - state[f"{name}.weight"]).abs().max() < 0.25 * scale.max()
        dequantised[f"{name}.weight"] = deq
    # Embeddings, norms and biases are not quantised: the same tensors as the checkpoint's.
    assert torch.equal(ref.tok_embeddings.weight, state["tok_embeddings.weight"])
    plain.load_state_dict(dequantised)
    with torch.no_grad():
        # The same kernels on the same values (NF4's linear de-quantises to fp32, then F.linear): bit for bit.
        assert torch.equal(ref(tokens), plain(tokens))
        assert not torch.equal(ref(tokens), model(tokens))  # and not the full-precision model


def test_int8_reference_by_hand(tiny):
    model, _, state, _ = tiny
    ref = _reference(tiny, "int8")
    name = "layers.0.mlp.w1"
    w = state[f"{name}.weight"]  # [256, 128]
    q = ref.get_submodule(name).weight
    # Symmetric per output row, torchao's mapping: [-max|w_row|, max|w_row|] over the 255 steps of int8's
    # [-128, 127], so scale = max|w_row| / 127.5 and value = clamp(round(w / scale), -128, 127).
    scale = w.abs().amax(dim=1, keepdim=True) / 127.5
    torch.testing.assert_close(q.scale.reshape(-1, 1), scale, atol=0, rtol=torch.finfo(torch.float32).eps)
    codes = q.qdata.float()
    assert codes.min() >= -128 and codes.max() <= 127
    # Rounded to nearest: torchao divides in its own way (a reciprocal, one more rounding), so a quotient within an
    # ulp or two of a .5 tie may go either way: |code - w / scale| <= 0.5 + 2 ulp at 128 (1.5e-5 each).
    assert (codes - w / q.scale.reshape(-1, 1)).abs().max() <= 0.5 + 2 * 128 * torch.finfo(torch.float32).eps
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    deq = codes * scale  # [256, 128]
    # torchao computes (x @ q^T) * scale, the check x @ (q * scale)^T: two K-term dot products (K = 128) of the same
    # exact terms, each within (K + 2) fp32 unit roundoffs of sum |x_k| |w_jk| (the products, the sum, the scaling).
    bound = 2 * (128 + 2) * torch.finfo(torch.float32).eps / 2 * (x.abs() @ deq.abs().T)
    diff = (ref.get_submodule(name)(x) - x @ deq.T).abs()
    assert (diff <= bound).all(), (diff - bound).max()
    assert set(_linear_names(ref)) == {n for n, m in ref.named_modules() if type(getattr(m, "weight", None)).__name__
                                       == "Int8Tensor"}


def test_bytes_of_each_mode_by_hand(tiny):
    model, _, state, _ = tiny
    full = module_bytes(_reference(tiny, "compute"))
    total = sum(t.numel() * 4 for t in state.values()) + sum(b.numel() * 4 for b in model.buffers())
    assert full == {("cpu", "float32"): total}
    linears = [tuple(state[f"{n}.weight"].shape) for n in _linear_names(model)]
    n = [a * b for a, b in linears]  # 8 of 128 x 128, 6 of 256 x 128
    # NF4 per weight of n values: n / 2 bytes of codes, one int8 scale per block of 64, one fp32 factor per
    # 256 blocks, an fp32 mean and the 16 fp32 levels; everything else stays fp32.
    nf4_fp32 = sum(4 * (k // 64 // 256) + 4 + 16 * 4 for k in n)
    assert module_bytes(_reference(tiny, "nf4")) == {
        ("cpu", "uint8"): sum(k // 2 for k in n), ("cpu", "int8"): sum(k // 64 for k in n),
        ("cpu", "float32"): total - 4 * sum(n) + nf4_fp32,
    }
    # int8: one byte per weight and an fp32 scale per output row.
    assert module_bytes(_reference(tiny, "int8")) == {
        ("cpu", "int8"): sum(n), ("cpu", "float32"): total - 4 * sum(n) + sum(4 * a for a, _ in linears),
    }
    # bf16: every parameter in 2 bytes; the RoPE cache (a buffer, not in the state dict) stays fp32, as torchtune
    # computes it.
    buffers = sum(b.numel() * 4 for b in model.buffers())
    assert module_bytes(_reference(tiny, "bf16")) == {
        ("cpu", "bfloat16"): (total - buffers) // 2, ("cpu", "float32"): buffers,
    }


def test_offloaded_layers_are_swapped_in_one_at_a_time_and_compute_the_same(tiny):
    _, _, _, tokens = tiny
    resident, ref = _reference(tiny, "nf4"), _reference(tiny, "nf4", offload=True)
    streamer = ref.offloaded_layers
    assert isinstance(streamer, OffloadedLayers) and not hasattr(resident, "offloaded_layers")
    host = [[p for _, _, p in slots] for slots in streamer.slots]
    seen = []

    def probe(i):
        def hook(module, args, output):  # runs before the streamer's own forward hook restores the host copy
            live = [p for _, p in module.named_parameters()]
            seen.append((i, all(a is not b for a, b in zip(live, host[i])), sorted(streamer.pending)))
        return hook

    for i, layer in enumerate(ref.layers):
        # forward hooks run in registration order: put the probe first
        handle = layer.register_forward_hook(probe(i), prepend=True)
    with torch.no_grad():
        out, expected = ref(tokens), resident(tokens)
    # Layer 0: its copy in place and layer 1's started; layer 1: its copy in place, nothing left to prefetch.
    assert seen == [(0, True, [1]), (1, True, [])]
    assert streamer.copies == 2
    assert all(p is h for layer, hs in zip(ref.layers, host) for p, h in zip(layer.parameters(), hs))  # restored
    assert torch.equal(out, expected)
    handle.remove()


def _config(run_dir: Path, **overrides) -> Path:
    # Scripted rollouts (tests/_engines.py: completions a function of the prompt) and shuffle=False: rank r of W
    # takes prompts r, r+W, ..., so every run trains on the same sequences whatever the split.
    run_dir.mkdir(parents=True)
    settings = dict(
        vowel_reward=False, max_steps=2, save_every_n_steps=1, shuffle=False, batch_size=4, micro_batch_size=16,
        generation={"_component_": "tests._engines.ScriptedGenerator"},
        reward_functions=[{"_component_": "tests._rewards.EvenTokenReward"}],
        kl_coef=0.5, optimizer={"_component_": "torch.optim.SGD", "lr": 0.5}, lr_scheduler=None,
        clip_grad_norm=None, **{"reference.precision": "nf4", "reference.offload": True},
    )
    settings.update(overrides)
    return write_config(run_dir, **settings)


@pytest.mark.slow
def test_nf4_offloaded_reference_through_the_recipe(tmp_path, clean_env, one_thread):
    # A: 1 process, 1 micro-batch; B: 4 micro-batches by a token budget; C: 2 processes (`tune run`); R: A resumed
    # after step 1; F: the full reference; H: bf16.
    runs = {
        "A": {}, "B": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 96},
        "F": {"reference.precision": "compute", "reference.offload": False},
        # H: a bf16 reference of the fp32 policy, FSDP2-wrapped as on N processes (the sharded path)
        "H": {"reference.precision": "bf16", "reference.offload": False, "fsdp_single_process": True},
    }
    results = {}
    for name, overrides in runs.items():
        run_in_process(_config(tmp_path / name, **overrides))
        results[name] = read_jsonl(tmp_path / name / "out" / "metrics.jsonl")
    card = (tmp_path / "A" / "out" / "algorithm_card.md").read_text()
    assert "linear weights NF4 (4-bit blocks of 64), the rest in float32; transformer layers in CPU memory" in card
    assert "pi_ref is computed by a quantised copy of the initial policy" in card
    # R: A's run as if stopped after its step-1 checkpoint (A saves every step), resumed for step 2.
    resumed = _config(tmp_path / "R", resume_from_checkpoint=True)
    shutil.copytree(tmp_path / "A" / "out", tmp_path / "R" / "out")
    shutil.rmtree(tmp_path / "R" / "out" / "step_2")
    run_in_process(resumed)
    run_tune(_config(tmp_path / "C", batch_size=2, micro_batch_size=8, max_tokens_per_micro_batch=96), nproc=2,
             cwd=tmp_path / "C")
    results["C"] = read_jsonl(tmp_path / "C" / "out" / "metrics.jsonl")
    a = [weights(tmp_path / "A" / "out" / f"step_{k}") for k in (1, 2)]
    # Resumed: the reference is rebuilt from the initial checkpoint, quantised the same way: the same bits.
    for key, value in a[1].items():
        assert torch.equal(weights(tmp_path / "R" / "out" / "step_2")[key], value), key
    # B and C compute each step's gradient as the same per-token terms regrouped (micro-batches, gloo's all-reduce;
    # the reference's logprobs come from forwards of other shapes, a few ulp of the tiny asset's |logit| <~ 2, ulp
    # 2.4e-7). A regrouped sum of n terms differs by ~sqrt(n) ulp of its magnitude; SGD moves the weights by lr (0.5)
    # x that, ~1e-7, plus one rounding of each weight (|w| <~ 0.1: 7.5e-9), over 2 steps. Bound 1e-5 (> 50x), and
    # 1e-5 on the logged means (regrouped fp32 sums of O(1): ~1e-6).
    for other in ("B", "C"):
        for k in (1, 2):
            for key, value in a[k - 1].items():
                got = weights(tmp_path / other / "out" / f"step_{k}")[key]
                torch.testing.assert_close(got, value, atol=1e-5, rtol=0, msg=lambda m: f"{other} step {k} {key}: {m}")
        for ma, mo in zip(results["A"], results[other]):
            for key in ("loss", "kl", "policy_loss"):
                assert mo[key] == pytest.approx(ma[key], abs=1e-5), (other, key)
    # The NF4 reference is not the full one: at step 1 the policy is the initial model, so the full reference's KL is
    # 0 to rounding while the NF4 reference's is its quantisation error's.
    assert results["F"][0]["kl"] < 1e-9 < 1e-6 < results["A"][0]["kl"]
    # bf16 rounds each weight by at most 2^-9 relative, NF4 to one of 16 levels per block: a smaller, non-zero KL.
    assert 1e-9 < results["H"][0]["kl"] < results["A"][0]["kl"]
    card = (tmp_path / "H" / "out" / "algorithm_card.md").read_text()
    assert "| reference model | loaded (frozen copy of the initial policy, in bfloat16) |" in card
    assert all(math.isfinite(m["loss"]) for m in results["A"])


def test_bad_reference_settings_name_the_key(tmp_path, clean_env, one_thread):
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

    cfg = OmegaConf.load(write_config(tmp_path, **{"reference.precision": "fp8"}))
    with pytest.raises(ValueError, match=r"reference.precision.*fp8"):
        GRPOFullFinetuneRecipeDistributed(cfg)
    cfg = OmegaConf.load(write_config(tmp_path, **{"reference.device": "cpu"}))
    with pytest.raises(ValueError, match=r"Unknown reference key\(s\): \['device'\]"):
        GRPOFullFinetuneRecipeDistributed(cfg)
    lora = write_config(tmp_path, base=REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", kl_coef=0.1,
                        **{"reference.precision": "nf4"})
    with pytest.raises(ValueError, match=r"reference.precision: nf4 .* apply to the full recipe only"):
        with recipe_in_process(OmegaConf.load(lora), lora=True):
            pass


def test_nf4_names_a_weight_that_does_not_fit(tiny):
    cfg = OmegaConf.create({"_component_": "torchtune.models.qwen2.qwen2", **{**MODEL, "embed_dim": 100,
                                                                              "num_heads": 2, "num_kv_heads": 2}})
    torch.manual_seed(0)
    state = qwen2(**{**MODEL, "embed_dim": 100, "num_heads": 2, "num_kv_heads": 2}).state_dict()
    with pytest.raises(ValueError, match=r"multiple of 64; layers.0.attn.q_proj.weight has shape \(100, 100\)"):
        build_reference(cfg, state, CPU, ReferenceOptions("nf4"), source="test", max_len=32)


def test_a_transformers_policy_reference_is_quantised_and_offloaded_too(tmp_path):
    # model.backend transformers: the decoder layers are transformers' own modules, named as the checkpoint
    # names them. Every linear layer of them is NF4; offloading streams them and computes the same logits.
    from tests.hf_families import make_family_dir
    from torchtune_grpo.models import HFCheckpointer

    directory = make_family_dir("mistral", tmp_path / "mistral")
    state = HFCheckpointer(str(directory), str(tmp_path / "scratch")).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(directory)})

    def build(precision, offload=False):
        options = ReferenceOptions(precision, offload)
        return build_reference(cfg, dict(state), CPU, options, source=str(directory), max_len=32)

    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    full, nf4, nf4_offloaded, offloaded = build("compute"), build("nf4"), build("nf4", True), build("compute", True)
    linears = [m for m in nf4.layers.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m.weight).__name__ == "NF4Tensor" for m in linears)
    with torch.no_grad():
        assert torch.equal(offloaded(tokens), full(tokens))
        assert torch.equal(nf4_offloaded(tokens), nf4(tokens))
        assert not torch.equal(nf4(tokens), full(tokens))
    assert nf4_offloaded.offloaded_layers.copies == len(nf4_offloaded.layers)  # one forward: each layer once
