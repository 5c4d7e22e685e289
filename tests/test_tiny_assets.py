"""The shipped tiny Qwen2 model and tokenizer: torchtune and Hugging Face must agree on them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.models.qwen2 import qwen2
from torchtune.models.qwen2_5 import qwen2_5_tokenizer
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS
from torchtune.training import FullModelHFCheckpointer

from tests.tolerances import ulps
from torchtune_grpo.assets import asset_path, register_resolvers
from torchtune_grpo.data import R1Prompt

transformers = pytest.importorskip("transformers")

TINY = Path(asset_path("tiny_qwen2"))
REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 512

TEXTS = [
    R1Prompt().format("What is 37 + 58?"),
    "<answer>42</answer>",
    "<think>\n37 + 58 = 95\n</think>\n<answer> 95 </answer>",
    "0123456789 12,345.67 -46",
    "Tom has 12 apples. He buys 7 more apples at the store. How many apples does Tom have now?",
    "café ☕ 数学 naïve Ünïcödé 🙂",
    "  spaces   and\n\n\ttabs\r\n",
    "It's they'll I'M",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call><|endoftext|>",
]

# The exact YAML snippets reported for recipes that use the tiny model.
TINY_YAML = """
output_dir: {output_dir}
tokenizer:
  _component_: torchtune.models.qwen2_5.qwen2_5_tokenizer
  path: ${{grpo_asset:tiny_qwen2/vocab.json}}
  merges_file: ${{grpo_asset:tiny_qwen2/merges.txt}}
  special_tokens_path: ${{grpo_asset:tiny_qwen2/tokenizer.json}}
  max_seq_len: 1024
model:
  _component_: torchtune.models.qwen2.qwen2
  vocab_size: 512
  num_layers: 2
  num_heads: 4
  num_kv_heads: 4
  embed_dim: 128
  intermediate_dim: 256
  max_seq_len: 1024
  norm_eps: 1e-6
  rope_base: 1000000.0
  tie_word_embeddings: true
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: ${{grpo_asset:tiny_qwen2}}
  checkpoint_files: [model.safetensors]
  model_type: QWEN2
  output_dir: ${{output_dir}}
"""


@pytest.fixture(scope="module")
def tt_tokenizer():
    return qwen2_5_tokenizer(
        path=str(TINY / "vocab.json"),
        merges_file=str(TINY / "merges.txt"),
        special_tokens_path=str(TINY / "tokenizer.json"),
    )


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TINY))


def _tiny_model():
    return qwen2(
        vocab_size=VOCAB_SIZE, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
        intermediate_dim=256, max_seq_len=1024, norm_eps=1e-6, rope_base=1_000_000.0,
        tie_word_embeddings=True,
    )


def test_shipped_files_are_small():
    total = sum(p.stat().st_size for p in TINY.iterdir())
    assert total < 3 * 1024 * 1024


@pytest.mark.parametrize("text", TEXTS)
def test_torchtune_and_hf_tokenizers_agree(tt_tokenizer, hf_tokenizer, text):
    tt_ids = tt_tokenizer.encode(text, add_bos=False, add_eos=False)
    hf_ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tt_ids == hf_ids
    assert tt_tokenizer.decode(tt_ids) == text
    assert hf_tokenizer.decode(hf_ids) == text


def test_digits_are_single_tokens(tt_tokenizer):
    # Qwen2 pre-tokenisation isolates every digit, so 12345 is five tokens, one per digit.
    ids = tt_tokenizer.encode("12345", add_bos=False, add_eos=False)
    assert [tt_tokenizer.decode([i]) for i in ids] == list("12345")


def test_special_tokens(tt_tokenizer, hf_tokenizer):
    specials = tt_tokenizer.special_tokens
    # Same names and order as torchtune's Qwen2.5 list, right after the 480-token base vocab.
    assert list(specials) == list(QWEN2_5_SPECIAL_TOKENS)
    assert list(specials.values()) == list(range(480, 480 + len(QWEN2_5_SPECIAL_TOKENS)))
    assert max(specials.values()) < VOCAB_SIZE
    assert len(hf_tokenizer) <= VOCAB_SIZE
    for content, token_id in specials.items():
        assert hf_tokenizer.convert_tokens_to_ids(content) == token_id
    endoftext = specials["<|endoftext|>"]
    assert endoftext in tt_tokenizer.stop_tokens
    assert hf_tokenizer.eos_token_id == endoftext
    assert hf_tokenizer.pad_token_id == endoftext
    assert tt_tokenizer.pad_id == endoftext


def test_hf_chat_template_matches_torchtune(tt_tokenizer, hf_tokenizer):
    from torchtune.data import Message

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tt_messages = [Message(role=m["role"], content=m["content"]) for m in messages]
    tt_messages.append(Message(role="assistant", content=""))
    tt_ids, _ = tt_tokenizer.tokenize_messages(tt_messages, add_eos=False)
    assert tt_ids == hf_tokenizer.encode(text, add_special_tokens=False)


def test_checkpointer_and_hf_logits_match(tmp_path):
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(TINY),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(tmp_path / "out"),
    )
    state_dict = checkpointer.load_checkpoint()["model"]
    tt_model = _tiny_model()
    tt_model.load_state_dict(state_dict, strict=True)
    tt_model.eval()

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    hf_model.eval()

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 502, (3, 37), generator=generator)  # [B, T]
    with torch.no_grad():
        tt_logits = tt_model(tokens)  # [B, T, V]
        hf_logits = hf_model(input_ids=tokens).logits  # [B, T, V]
    assert tt_logits.shape == hf_logits.shape == (3, 37, VOCAB_SIZE)
    # Not a vacuous check: logits vary across positions and vocab.
    assert tt_logits.std() > 0.05
    # transformers against torchtune on the same weights (as tests/test_models.py): other op orders in ~15 matmuls, the
    # norms, attention and the RoPE tables (37 positions: angles <= 37 rad, 1 ulp 3.8e-6), on logits |z| <~ 2 (1 ulp
    # 2.4e-7): a few ulp, <~ 1e-5 from the rope angles. Bound: 1e-4 (measured: bitwise equal with AVX-512 and AVX2
    # kernels).
    torch.testing.assert_close(tt_logits, hf_logits, atol=1e-4, rtol=0)


def test_yaml_snippets_instantiate(tmp_path):
    register_resolvers()
    cfg = OmegaConf.create(TINY_YAML.format(output_dir=tmp_path / "out"))
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    assert tokenizer.special_tokens["<|endoftext|>"] == 480
    model = tt_config.instantiate(cfg.model)
    checkpointer = tt_config.instantiate(cfg.checkpointer)
    model.load_state_dict(checkpointer.load_checkpoint()["model"], strict=True)
    assert model.tok_embeddings.weight.shape == (VOCAB_SIZE, 128)


def test_asset_path_errors_name_the_path():
    with pytest.raises(FileNotFoundError, match="tiny_qwen2.*nope.json"):
        asset_path("tiny_qwen2", "nope.json")
    assert asset_path("tiny_qwen2/vocab.json") == str(TINY / "vocab.json")


def test_regeneration_is_byte_identical(tmp_path):
    # The shipped files must be exactly what the script writes. If this fails after an intended
    # change (e.g. to R1_SYSTEM_PROMPT, which the tokenizer is trained on), rerun
    # `python scripts/make_tiny_assets.py` and commit the new files.
    from tokenizers import Tokenizer

    from tests.recipe_utils import forked_python

    out = tmp_path / "tiny"
    # The script runs as __main__ in a child forked from this pytest process's fork server (tests/_tune_server.py),
    # which imported torch and torchtune already: the same script and seeds, without ~2 s of imports. Nothing it
    # draws depends on those imports (its seeds are set before each draw), and the files are compared byte for
    # byte below, so a difference the fork made would fail here.
    env = dict(os.environ)
    subprocess.run(
        forked_python([str(REPO_ROOT / "scripts" / "make_tiny_assets.py"), "--out", str(out)], env),
        check=True,
        capture_output=True,
        env=env,
    )
    # The weights are drawn by torch's normal_, whose CPU kernel is vectorised on x86 with AVX2 or AVX-512
    # (Box-Muller with SLEEF's log, sqrt and cos: the same bytes with both) and other code otherwise (libm's
    # under ATEN_CPU_CAPABILITY=default or on a CPU without AVX2; another ISA's off x86). They round
    # differently: with the scalar kernel 37% of the weights are a few ulp away (sqrt(-2 ln u) cos(2 pi v) x
    # 0.02: ~4 roundings of ~1 ulp at the draw's radius, an absolute error scaled to the tensor's largest |w|).
    # Measured: up to 4.3 ulp of each tensor's largest |w|. So the file is byte-identical where the shipped one
    # was made (vectorised kernels), and equal to 8 ulp of each tensor's largest value elsewhere; every other
    # file is byte-identical everywhere.
    vectorised_normal = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    for shipped in sorted(TINY.iterdir()):
        if shipped.name in ("README.md", "tokenizer.json"):
            continue
        if shipped.name == "model.safetensors" and not vectorised_normal:
            from safetensors.torch import load_file

            made, want = load_file(out / shipped.name), load_file(shipped)
            assert made.keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(made[key], value, atol=ulps(value, 8), rtol=0, msg=key)
            continue
        assert (out / shipped.name).read_bytes() == shipped.read_bytes(), shipped.name
    # tokenizer.json is serialised by the `tokenizers` library, whose JSON layout may change between
    # versions: compare what it means, not its bytes.
    new = Tokenizer.from_file(str(out / "tokenizer.json"))
    old = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert new.get_vocab(with_added_tokens=True) == old.get_vocab(with_added_tokens=True)
    for text in TEXTS:
        assert new.encode(text).ids == old.encode(text).ids
