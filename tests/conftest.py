"""Shared fixtures: a tiny torchtune decoder built in code, and paths to the shipped tiny config."""

from pathlib import Path

import pytest
import torch
from torchtune.models.qwen2 import qwen2

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny" / "full_grpo_cpu.yaml"


def make_tiny_decoder(seed: int = 0, vocab_size: int = 97, scale: float = 4.0):
    """A 2-layer Qwen2-shaped decoder with weights scaled up so greedy outputs vary by prompt."""
    torch.manual_seed(seed)
    model = qwen2(
        vocab_size=vocab_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=256,
        tie_word_embeddings=True,
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model.eval()


@pytest.fixture
def tiny_decoder():
    return make_tiny_decoder()
