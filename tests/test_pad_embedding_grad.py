"""``drop_pad_embedding_grad: true``: transformers' ``padding_idx`` on the input embedding (TRL's behaviour)."""

import pytest
import torch
from torch import nn

from tests.conftest import make_tiny_decoder
from tests.tolerances import ulps
from torchtune_grpo.models import drop_pad_input_embedding_grad

PAD = 5


def _grads(model, tokens, weights):
    """The embedding's gradient and the gradient reaching the embedding's output, for one weighted loss."""
    model.zero_grad()
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen["out"] = out

    handle = model.tok_embeddings.register_forward_hook(keep)
    (model(tokens) * weights).sum().backward()
    handle.remove()
    return model.tok_embeddings.weight.grad.clone(), seen["out"].grad


def test_tied_pad_row_loses_exactly_its_input_positions_gradient():
    # Tied (Qwen2-shaped) model, the pad id in the input three times. The embedding weight's gradient is
    # output side + input side; with padding_idx only the pad row loses its input side, which is the sum
    # of the gradients reaching the embedding output at the pad positions. Every other row is unchanged.
    model = make_tiny_decoder().train()
    tokens = torch.tensor([[3, PAD, 7, 9, PAD], [PAD, 11, 12, 13, 14]])
    weights = torch.randn(2, 5, 97, generator=torch.Generator().manual_seed(0))
    exact, out_grad = _grads(model, tokens, weights)
    weight_before = model.tok_embeddings.weight.detach().clone()
    drop_pad_input_embedding_grad(model, PAD)
    assert torch.equal(model.tok_embeddings.weight, weight_before)  # the weights are not touched
    dropped, _ = _grads(model, tokens, weights)
    input_side = out_grad[tokens == PAD].sum(0)  # [D]
    assert input_side.norm() > 0.1 * exact[PAD].norm()  # a real part of the row's gradient
    # The output side (the tied head's gradient) is the same computation in both runs. exact[PAD] adds the
    # embedding backward's sum of the 3 pad positions' gradients to it (one rounding at |exact[PAD]|); the
    # reference then subtracts this test's own sum of the same 3 rows (their order may differ: 2 roundings at
    # |input_side|) and rounds once more. The operands reach ~170 here (x4 weights; 1 ulp = 1.5e-5) and
    # largely cancel (the difference is ~21): a few roundings of at most half an ulp of the operands, ~2 ulp
    # worst case, for elements near 0 too, where the former 1e-6 + 1e-5 relative allowed 0.07 ulp of them.
    # Bound: 8 ulp of the largest operand (measured: 3.3e-6 with AVX-512 and AVX2 kernels, 2.7e-6 with scalar
    # ones: ~0.2 ulp).
    atol = ulps(torch.stack([exact[PAD], input_side, dropped[PAD]]), 8)
    torch.testing.assert_close(dropped[PAD], exact[PAD] - input_side, rtol=0, atol=atol)
    others = torch.arange(97) != PAD
    assert torch.equal(dropped[others], exact[others])
    assert dropped[PAD].norm() > 0  # still trained as the output weight of the pad token


def test_untied_pad_row_gets_no_gradient():
    model = make_tiny_decoder()
    model.output = nn.Linear(64, 97, bias=False)  # untie
    tokens = torch.tensor([[3, PAD, 7, PAD]])
    weights = torch.randn(1, 4, 97)
    exact, _ = _grads(model, tokens, weights)
    assert exact[PAD].abs().sum() > 0
    drop_pad_input_embedding_grad(model, PAD)
    dropped, _ = _grads(model, tokens, weights)
    assert dropped[PAD].abs().sum() == 0
    assert torch.equal(dropped[3], exact[3])


def test_errors_name_the_key_and_the_problem():
    with pytest.raises(ValueError, match=r"drop_pad_embedding_grad: true needs a torchtune decoder whose "
                                         r"`tok_embeddings` is an nn.Embedding; Linear.tok_embeddings is NoneType"):
        drop_pad_input_embedding_grad(nn.Linear(2, 2), 0)
    with pytest.raises(ValueError, match=r"pad id 97 is not a row of the model's embedding \(vocabulary 97\)"):
        drop_pad_input_embedding_grad(make_tiny_decoder(), 97)


def test_the_recipe_sets_it_from_the_config(tmp_path, caplog, clean_env, one_thread):
    import logging

    from tests.recipe_utils import run_in_process, write_config

    cfg = write_config(tmp_path, max_steps=1, drop_pad_embedding_grad=True)
    with caplog.at_level(logging.INFO):
        recipe = run_in_process(cfg)
    pad = recipe.tokenizer.pad_id
    assert recipe.model.tok_embeddings.padding_idx == pad
    assert f"drop_pad_embedding_grad: the pad token's (id {pad}) input embedding gets no gradient" in caplog.text
