#!/usr/bin/env python
"""Writes the tiny Qwen2-architecture model and tokenizer shipped in ``torchtune_grpo/assets/tiny_qwen2/``.

Usage (from the repository root)::

    python scripts/make_tiny_assets.py                # writes torchtune_grpo/assets/tiny_qwen2/
    python scripts/make_tiny_assets.py --out /tmp/x   # writes elsewhere

Everything is generated here, with fixed seeds, so re-running gives the same files:

- a byte-level BPE tokenizer trained with the ``tokenizers`` library on a small corpus written below
  (the R1 prompt, ``<think>``/``<answer>`` completions, arithmetic questions and GSM8K-style word
  problems). Pre-tokenisation is Qwen2's (same regex, NFC, byte-to-unicode table as
  ``torchtune.models.qwen2._tokenizer``), so torchtune's ``qwen2_5_tokenizer`` and Hugging Face's
  tokenizer give the same ids. Qwen2's regex sends every digit to its own pre-token, so digits are
  never merged: each digit is one token, which keeps arithmetic learnable. The Qwen2.5 special tokens
  follow the base vocabulary (small ids, all below the model's vocab_size of 512).
- a 2-layer Qwen2 model built with torchtune's ``qwen2`` builder, saved in Hugging Face format
  (``model.safetensors`` + ``config.json``) so both ``FullModelHFCheckpointer(model_type="QWEN2")``
  and ``transformers.AutoModelForCausalLM`` load it.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Dict, List, Tuple

# One worker thread for the BPE trainer, set before tokenizers starts its pool, so that training does
# not depend on the machine's core count.
os.environ.setdefault("RAYON_RS_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Regex, Tokenizer, trainers
from torchtune.models.qwen2 import qwen2
from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf
from torchtune.models.qwen2._tokenizer import bytes_to_unicode, PRETOKENIZE_REGEX
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from torchtune_grpo.data._templates import R1_SYSTEM_PROMPT  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "torchtune_grpo" / "assets" / "tiny_qwen2"

# Model sizes. embed 128 / intermediate 256 / 4 heads keep every weight's element count a multiple of
# 64 * 256, which NF4 (QLoRA) quantisation needs.
VOCAB_SIZE = 512
EMBED_DIM = 128
INTERMEDIATE_DIM = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 4
MAX_SEQ_LEN = 1024
NORM_EPS = 1e-6
ROPE_BASE = 1_000_000.0
INIT_STD = 0.02  # Hugging Face's initializer_range for Qwen2

BASE_VOCAB_SIZE = 480  # 256 byte tokens + merges
ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
# Qwen2.5 marks the tool-call tags as added but not "special" (they survive skip_special_tokens).
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}

# Qwen-style chat template (ChatML), written to match what torchtune's Qwen2.5 tokenize_messages
# produces: no default system message is inserted, so HF and torchtune prompts are identical.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMES = ["Tom", "Anna", "Maria", "James", "Lily", "Ben", "Sara", "John", "Emma", "Jack", "Mia", "Sam"]
ITEMS = ["apples", "books", "cookies", "pencils", "marbles", "cards", "stickers", "eggs",
         "flowers", "toys", "candies", "shells", "cupcakes", "balls", "boxes", "dollars"]
PLACES = ["store", "market", "school", "park", "bakery", "farm", "library"]
WORD_PROBLEMS = [
    "{n} has {a} {item}. {p} buys {b} more {item} at the {place}. How many {item} does {n} have now?",
    "{n} had {a} {item} and gave {b} of them to a friend. How many {item} are left?",
    "There are {a} {item} in each box. How many {item} are in {b} boxes?",
    "{n} earns {a} dollars every week. How much money does {p2} earn in {b} weeks?",
    "A baker made {a} {item} in the morning and {b} {item} in the afternoon. "
    "How many did the baker make in total?",
    "{n} reads {a} pages a day. How many pages will {p2} read in {b} days?",
    "{n} wants to share {a} {item} equally among {b} friends. How many {item} does each friend get?",
    "If one ticket costs {a} dollars, what is the total cost of {b} tickets?",
    "{n} walked {a} miles on Monday and {b} miles on Tuesday. How many miles did {p2} walk altogether?",
    "The {place} sold {a} {item} today and {b} {item} yesterday. How many more {item} were sold today?",
    "{n} is {a} years old. {p} is {b} years older than a cousin. How old is the cousin?",
    "A class has {a} students. Half of them like {item}. How many students like {item}?",
    "{n} saves {a} dollars each month for {b} months and then spends half of it. How much money is left?",
    "Each of the {a} tables at the {place} has {b} chairs. How many chairs are there?",
    "{n} picked {a} {item} and {n2} picked {b} {item}. How many {item} did they pick together?",
]
SOLUTION_LINES = [
    "First, we add the two numbers: {a} + {b} = {s}.",
    "So the total is {s}.",
    "We subtract to find the difference: {a} - {b} = {d}.",
    "Then we multiply: {a} * {b} = {m}.",
    "The answer is {s}.",
    "Let me think step by step.",
    "Each friend gets the same number of {item}.",
    "That means {n} has {s} {item} now.",
]


def build_corpus(seed: int = 0) -> List[str]:
    """Returns the training text: prompts, completions and word problems, deterministically."""
    rng = random.Random(seed)
    lines: List[str] = []
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        c = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}?"
        lines.append(f"{R1_SYSTEM_PROMPT}\nUser: {question}\nAssistant: <think>")
        lines.append(f" {a} {op} {b} = {c} </think> <answer>{c}</answer>")
        lines.append(f"<think>\nWe compute {a} {op} {b}, which is {c}.\n</think>\n<answer>{c}</answer>")
        lines.append(
            f"user\n{question}\nassistant\n<think> {a} {op} {b} = {c} </think>\n<answer> {c} </answer>"
        )
    for _ in range(600):
        n, n2 = rng.sample(NAMES, 2)
        a, b = rng.randint(2, 99), rng.randint(2, 20)
        fields = dict(
            n=n, n2=n2, a=a, b=b, s=a + b, d=a - b, m=a * b,
            p=rng.choice(["He", "She"]), p2=rng.choice(["he", "she"]),
            item=rng.choice(ITEMS), place=rng.choice(PLACES),
        )
        lines.append(rng.choice(WORD_PROBLEMS).format(**fields))
        lines.append(rng.choice(SOLUTION_LINES).format(**fields))
    lines.append("system\nYou are a helpful assistant.\nuser\nassistant\n")
    return lines


def train_bpe(corpus: List[str]) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """Trains byte-level BPE with Qwen2 pre-tokenisation; returns (vocab, merges) in Qwen2 layout.

    ids 0..255 are the 256 byte symbols in GPT-2/Qwen2 order; merge ``i`` creates token ``256 + i``.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _qwen2_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    trained = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    vocab: Dict[str, int] = {}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    kept: List[Tuple[str, str]] = []
    for left, right in merges:
        if left + right in vocab:  # a second merge path to an existing token adds no id
            continue
        vocab[left + right] = len(vocab)
        kept.append((left, right))
    return vocab, kept


def _qwen2_pre_tokenizer():
    # Same as Qwen2's tokenizer.json: split with torchtune's PRETOKENIZE_REGEX, then map bytes to
    # unicode symbols without a second (GPT-2) regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def build_hf_tokenizer(vocab: Dict[str, int], merges: List[Tuple[str, str]]) -> Tokenizer:
    """Returns the full tokenizer: BPE + Qwen2.5 special tokens appended after the base vocab."""
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _qwen2_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    # One at a time, in QWEN2_5_SPECIAL_TOKENS order, so ids are base_vocab_size + position.
    for content in QWEN2_5_SPECIAL_TOKENS:
        token = AddedToken(content, special=content not in NOT_SPECIAL, normalized=False)
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> Dict[str, int]:
    return {content: tokenizer.token_to_id(content) for content in QWEN2_5_SPECIAL_TOKENS}


def write_json(path: Path, obj, **kwargs) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, **kwargs) + "\n", encoding="utf-8")


def write_tokenizer(out: Path, seed: int) -> Dict[str, int]:
    vocab, merges = train_bpe(build_corpus(seed))
    tokenizer = build_hf_tokenizer(vocab, merges)
    specials = special_token_ids(tokenizer)
    assert max(specials.values()) < VOCAB_SIZE, "special tokens must fit in the model vocab"

    write_json(out / "vocab.json", vocab)
    with open(out / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for left, right in merges:
            f.write(f"{left} {right}\n")
    # tokenizers' own serialisation; pretty=True makes diffs readable.
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    added_tokens_decoder = {
        str(i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in NOT_SPECIAL,
        }
        for content, i in specials.items()
    }
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens_decoder,
            "additional_special_tokens": [c for c in QWEN2_5_SPECIAL_TOKENS if c not in NOT_SPECIAL
                                          and c not in (ENDOFTEXT,)],
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": ENDOFTEXT,
            "errors": "replace",
            "model_max_length": MAX_SEQ_LEN,
            "pad_token": ENDOFTEXT,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    return specials


def build_model(seed: int) -> torch.nn.Module:
    """Builds the torchtune model with Hugging Face-style initialisation.

    torchtune's default init (N(0, 1) embeddings, tied to the output) gives logits with a standard
    deviation near sqrt(embed_dim), i.e. an almost one-hot next-token distribution: sampled groups
    would all be identical and GRPO advantages zero. N(0, 0.02) weights start the model near uniform.
    Biases are random too (not zero) so that the HF-vs-torchtune logits test exercises them.
    """
    torch.manual_seed(seed)
    model = qwen2(
        vocab_size=VOCAB_SIZE,
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        embed_dim=EMBED_DIM,
        intermediate_dim=INTERMEDIATE_DIM,
        max_seq_len=MAX_SEQ_LEN,
        norm_eps=NORM_EPS,
        rope_base=ROPE_BASE,
        tie_word_embeddings=True,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".scale"):  # RMSNorm
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    return model


def write_model(out: Path, seed: int, specials: Dict[str, int]) -> None:
    model = build_model(seed)
    hf_state = qwen2_tune_to_hf(
        model.state_dict(),
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        dim=EMBED_DIM,
        tie_word_embeddings=True,
    )
    hf_state = {k: v.detach().to(torch.float32).contiguous() for k, v in sorted(hf_state.items())}
    save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file owner-only (0600); shipped files must be world-readable.
    os.chmod(out / "model.safetensors", 0o644)

    eos = specials[ENDOFTEXT]
    write_json(
        out / "config.json",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "hidden_size": EMBED_DIM,
            "initializer_range": INIT_STD,
            "intermediate_size": INTERMEDIATE_DIM,
            "max_position_embeddings": MAX_SEQ_LEN,
            "max_window_layers": NUM_LAYERS,
            "model_type": "qwen2",
            "num_attention_heads": NUM_HEADS,
            "num_hidden_layers": NUM_LAYERS,
            "num_key_value_heads": NUM_KV_HEADS,
            "rms_norm_eps": NORM_EPS,
            "rope_theta": ROPE_BASE,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": VOCAB_SIZE,
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": eos,
            # torchtune's Qwen2.5 tokenizer stops on both; HF generation should too.
            "eos_token_id": [eos, specials[IM_END]],
            "pad_token_id": eos,
            "do_sample": False,
            "max_new_tokens": 256,
        },
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed for corpus and weights")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    specials = write_tokenizer(args.out, args.seed)
    write_model(args.out, args.seed, specials)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    print(f"wrote {args.out}: " + ", ".join(f"{k} ({v} B)" for k, v in sizes.items()))
    first, last = min(specials.values()), max(specials.values())
    print(f"base vocab {first} tokens, special ids {first}..{last}")


if __name__ == "__main__":
    main()
