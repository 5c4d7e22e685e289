"""The shipped warm-started tiny model (``tiny_qwen2_arith``): loads, writes the format, answers part-right.

The asset exists so that the tiny GRPO demo has something to learn: GRPO needs groups whose samples get
different rewards. These checks fail if the asset regresses to "never right" (all rewards equal, GRPO
idle) or to "always right" (nothing left to learn), or stops writing the ``</think> <answer>`` format.
The bands are wide around the values measured when the asset was made (see its README).
"""

from pathlib import Path

import pytest
import torch
from torchtune.models.qwen2 import qwen2
from torchtune.models.qwen2_5 import qwen2_5_tokenizer
from torchtune.training import FullModelHFCheckpointer

from torchtune_grpo.assets import asset_path
from torchtune_grpo.data import arithmetic_dataset
from torchtune_grpo.generation import NativeGenerator, decode_responses
from torchtune_grpo.rewards import FormatReward, MathAnswerReward, RewardBatch

ARITH = Path(asset_path("tiny_qwen2_arith"))
BASE = Path(asset_path("tiny_qwen2"))
MAX_VALUE = 20  # the tiny demo config's problem space (configs/tiny/full_grpo_cpu.yaml)
MAX_NEW_TOKENS = 24  # the demo config's max_response_length


@pytest.fixture(scope="module")
def tokenizer():
    return qwen2_5_tokenizer(
        path=str(ARITH / "vocab.json"),
        merges_file=str(ARITH / "merges.txt"),
        special_tokens_path=str(ARITH / "tokenizer.json"),
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(ARITH),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(tmp_path_factory.mktemp("ckpt_out")),
    )
    m = qwen2(
        vocab_size=512, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
        intermediate_dim=256, max_seq_len=1024, norm_eps=1e-6, rope_base=1_000_000.0,
        tie_word_embeddings=True,
    )
    m.load_state_dict(checkpointer.load_checkpoint()["model"], strict=True)
    return m.eval()


def _score(model, tokenizer, rows, *, group_size, temperature, seed=0):
    """(format scores, correctness scores) of generated completions, as the recipe's rewards give them."""
    rollout = NativeGenerator(temperature=temperature).generate(
        model,
        [r["tokens"] for r in rows],
        group_size=group_size,
        max_new_tokens=MAX_NEW_TOKENS,
        pad_id=tokenizer.pad_id,
        stop_tokens=tokenizer.stop_tokens,
        generator=torch.Generator().manual_seed(seed),
    )
    batch = RewardBatch(
        prompts=[r["prompt"] for r in rows for _ in range(group_size)],
        completions=decode_responses(tokenizer, rollout.response_ids),
        completion_ids=rollout.response_ids,
        fields=[{"answer": r["answer"]} for r in rows for _ in range(group_size)],
    )
    return FormatReward(think_in_prompt=True)(batch), MathAnswerReward()(batch), batch.completions


def test_files_are_small_and_tokenizer_is_tiny_qwen2s():
    assert sum(p.stat().st_size for p in ARITH.iterdir()) < 3 * 1024 * 1024
    # Same tokenizer and config as the base asset, so configs can point either at either.
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert (ARITH / name).read_bytes() == (BASE / name).read_bytes(), name
    # And the weights are really different from the random init.
    assert (ARITH / "model.safetensors").read_bytes() != (BASE / "model.safetensors").read_bytes()


def test_greedy_completions_follow_the_format(model, tokenizer):
    validation = arithmetic_dataset(tokenizer, num_samples=64, max_value=MAX_VALUE, split="validation")
    rows = [validation[i] for i in range(len(validation))]
    fmt, correct, texts = _score(model, tokenizer, rows, group_size=1, temperature=0.0)
    # Every one of the first 8 (measured: 64 of 64 at the time of writing), and nearly all overall.
    assert fmt[:8] == [1.0] * 8, texts[:8]
    assert sum(fmt) / len(fmt) >= 0.9
    # Held-out greedy accuracy: clearly above chance, clearly below 100 % (room for GRPO).
    accuracy = sum(correct) / len(correct)
    assert 0.05 <= accuracy <= 0.8, (accuracy, texts[:8])


def test_sampled_accuracy_leaves_room_for_grpo(model, tokenizer):
    # The demo's own prompts (train split), sampled as the demo samples them: T = 1, groups of 4.
    demo = arithmetic_dataset(tokenizer, num_samples=256, max_value=MAX_VALUE)
    rows = [demo[i] for i in range(32)]
    group_size = 4
    fmt, correct, texts = _score(model, tokenizer, rows, group_size=group_size, temperature=1.0)
    assert sum(fmt) / len(fmt) >= 0.9, texts[:8]
    accuracy = sum(correct) / len(correct)
    assert 0.1 <= accuracy <= 0.8, (accuracy, texts[:8])
    # Groups with both right and wrong samples: these give GRPO a non-zero advantage.
    groups = [correct[i : i + group_size] for i in range(0, len(correct), group_size)]
    mixed = sum(0 < sum(g) < group_size for g in groups) / len(groups)
    assert mixed >= 0.2, (mixed, groups)
