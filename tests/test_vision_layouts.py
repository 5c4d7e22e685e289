"""Image prompts in the packed and shared-prompt training layouts equal one row per sequence (tiny Qwen3.5, Gemma 3
and Gemma 4 image-text directories).

Two prompts with images (one image; two images of another size), each with three completions of different
lengths, in two micro-batches that split the second group (its prompt, images included, in two rows). Per-token
logprobs, entropies, a loss of both signs and every trained parameter's gradient in each layout are compared with
one row per sequence (the image-text class's own masks and positions), with the bound of
tests/test_transformers_layouts.py (4x the fp32 one-row result's own error, measured against fp64; at least 8 ulp
of the largest value). What the layouts do with images is shown to matter: zeroed pixels, an image not attending to
itself both ways (Gemma 3; Gemma 4 with ``use_bidirectional_attention: vision``, in its sliding layers), or
Qwen3.5's text positions in place of its M-RoPE ones each move the logprobs far past that bound.
"""

import pytest
import torch
from transformers import AutoConfig

from tests.hf_vision import make_vision_dir, VISION_FAMILIES
from tests.test_transformers_layouts import _bound
from tests.test_vision_policy import image_rows, vision_policy
from torchtune_grpo.models import _vision_layouts
from torchtune_grpo.models._vision_layouts import bidirectional_layers
from torchtune_grpo.training.batch import TrainingBatch

pytestmark = pytest.mark.usefixtures("one_thread")
MICRO_BATCHES = [slice(0, 4), slice(4, 6)]
TEMPERATURE = 0.7


def _batch(data, layout: str) -> TrainingBatch:
    gen = torch.Generator().manual_seed(0)
    prompts, responses, images = [], [], []
    for sample in data:
        for n in (9, 4, 3):
            prompts.append(list(sample["tokens"]))
            responses.append(torch.randint(0, 480, (n,), generator=gen).tolist())
            images.append(sample["image_inputs"])
    kw = dict(share_prompt=layout == "shared", pack=layout == "packed")
    return TrainingBatch(prompts, responses, 0, images=images, **kw)


def _run(model, batch: TrainingBatch):
    """Logprobs, entropies ``[N, T]``, the loss and the trained parameters' gradients, through the training path."""
    model.zero_grad(set_to_none=True)
    outs = [batch.logprobs(model, mb, temperature=TEMPERATURE, chunk_size=64, with_entropy=True)
            for mb in MICRO_BATCHES]
    lp, ent = torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs])
    w = torch.linspace(-1.0, 2.0, lp.numel(), dtype=lp.dtype).view_as(lp)
    loss = (lp * w).sum() + 0.3 * (ent * w).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach(), ent.detach(), loss.detach()], grads


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "gemma4:vision", "qwen3_5_moe"])
def test_image_rows_in_each_layout_equal_one_row_per_sequence(vision_dir, tmp_path, family, monkeypatch):
    if family == "gemma4:vision":  # Gemma 4's larger models: images bidirectional in the sliding layers only
        directory = make_vision_dir("gemma4", tmp_path / "gemma4", use_bidirectional_attention="vision")
        assert bidirectional_layers(AutoConfig.from_pretrained(directory)) == (False, True)
    else:
        directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    model = vision_policy(directory, tmp_path / "scratch").train()
    for p in model.parameters():  # the language model, trained (the tower stays frozen, as by default)
        p.requires_grad_(True)
    unshared = _run(model, _batch(data, "none"))
    lm = model.causal_lm
    experts = getattr(lm.config, "_experts_implementation", None)
    if experts is not None:  # grouped_mm (the MoE default) has no fp64 kernel; the eager loop computes the same
        lm.set_experts_implementation("eager")
    model.double()
    model.image_model.double()
    try:
        exact = _run(model, _batch(data, "none"))
    finally:
        model.float()
        model.image_model.float()
        if experts is not None:
            lm.set_experts_implementation(experts)
    assert unshared[1], "no gradient reached the language model"
    for layout in ("shared", "packed"):
        batch = _batch(data, layout)
        assert all(batch.layout_for(model, mb) is not None for mb in MICRO_BATCHES), layout
        got = _run(model, batch)
        for name, a, b, e in zip(("logprobs", "entropy", "loss"), got[0], unshared[0], exact[0]):
            diff, bound = (a.double() - b.double()).abs().max().item(), _bound(b, e)
            assert diff <= bound, f"{family} {layout} {name}: {diff:.3g} > {bound:.3g}"
        for pname, g in unshared[1].items():
            diff, bound = (got[1][pname].double() - g.double()).abs().max().item(), _bound(g, exact[1][pname])
            assert diff <= bound, f"{family} {layout} grad {pname}: {diff:.3g} > {bound:.3g}"
    # The pixels reach the layouts' image slots, and the family's own image rule matters (else the equality above
    # would not test them).
    bound = _bound(unshared[0][0], exact[0][0])
    original = _vision_layouts.layout_image_inputs

    def broken(change):
        def inputs(*args, **kwargs):
            return change(original(*args, **kwargs))

        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(_vision_layouts, "layout_image_inputs", inputs)
            if change is None:  # no image attends to itself both ways
                patch.setattr(_vision_layouts, "bidirectional_layers", lambda config: (False, False))
                patch.setattr(_vision_layouts, "layout_image_inputs", original)
            got = torch.cat([_batch(data, "shared").logprobs(model, mb, temperature=TEMPERATURE).logprobs
                             for mb in MICRO_BATCHES])
        return (got - unshared[0][0]).abs().max().item()

    def no_pixels(inputs):
        return {k: (torch.zeros_like(v) if k.startswith("pixel_values") else v) for k, v in inputs.items()}

    assert broken(no_pixels) > 100 * bound
    if any(bidirectional_layers(model.image_model.config)):
        assert broken(None) > 100 * bound
    if family.startswith("qwen3_5"):  # its text positions in place of the M-RoPE ones
        assert broken(lambda inputs: {k: v for k, v in inputs.items() if k != _vision_layouts.POSITIONS_KEY}) > 100 * bound
