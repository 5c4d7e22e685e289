"""The policy's forward with images in the prompt equals transformers' own image-text class on the same pixels."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.hf_vision import shape_image, VISION_FAMILIES
from torchtune_grpo.data import image_dataset
from torchtune_grpo.models import attach_images, batch_image_inputs, HFCheckpointer, image_inputs, image_parameters
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.runtime.model_setup import build_model, Placement
from torchtune_grpo.runtime.precision import Precision

FP32 = Placement(device=torch.device("cpu"), world_size=1, precision=Precision.from_name("fp32"))


def vision_policy(directory: Path, scratch: Path, train: str = "none") -> torch.nn.Module:
    """The policy as the recipe builds it (meta init, weights by HFCheckpointer), with the image side attached."""
    state = HFCheckpointer(str(directory), str(scratch)).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(directory)})
    policy = build_model(cfg, state, FP32, trainable=False, source=str(directory), max_len=256)
    attach_images(policy, str(directory), train=train)
    return policy


def image_rows(directory: Path, folder: Path):
    """Two prompts (one image; two images of another size) as image_dataset gives them, plus a sampled-looking
    continuation of a few tokens each."""
    import json

    (folder / "img").mkdir(parents=True, exist_ok=True)
    shape_image("circle").save(folder / "img" / "c.png")
    shape_image("square", size=(16, 24), color=(30, 30, 200)).save(folder / "img" / "s.png")
    shape_image("triangle", color=(20, 160, 20)).save(folder / "img" / "t.png")
    rows = [{"image": "img/c.png", "question": "Which shape is this?", "answer": "circle"},
            {"image": ["img/s.png", "img/t.png"], "question": "And these two?", "answer": "square triangle"}]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return image_dataset(SimpleNamespace(path=str(directory)), "json", data_files=str(folder / "rows.jsonl"))


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "qwen3_5_moe"])
def test_logprobs_with_images_equal_the_image_text_class(vision_dir, tmp_path, family):
    from transformers import AutoModelForImageTextToText

    directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    assert image_parameters(policy) == [] and not any("vision" in k or "visual" in k for k in policy.state_dict())
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = [s["tokens"] + torch.randint(0, 480, (5 + 3 * i,), generator=gen).tolist() for i, s in enumerate(data)]
    width = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    images = batch_image_inputs([s["image_inputs"] for s in data], width)
    with torch.no_grad(), image_inputs(policy, images):
        ours = sequence_logprobs(policy, tokens, chunk_size=16).logprobs
    for i, (sample, row) in enumerate(zip(data, rows)):
        # transformers' class on each row alone, unpadded, with that row's images.
        one = {k: (v[None] if k.endswith("token_type_ids") else v) for k, v in sample["image_inputs"].items()}
        if "token_type_ids" in one or "mm_token_type_ids" in one:
            key = "token_type_ids" if "token_type_ids" in one else "mm_token_type_ids"
            one[key] = torch.nn.functional.pad(one[key], (0, len(row) - one[key].size(1)))
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([row]), **one).logits.float()[0]
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(row)[1:, None]).squeeze(-1)
        # Same modules, same weights, same image features: what differs is the head (the chunked logsumexp
        # against torch's fused log_softmax over V = 512) and the matmul blocking of [2, L] rows against one
        # row: a few ulp of the logits' logsumexp. 10 ulp of the largest logit magnitude (at least 16).
        bound = 10 * torch.finfo(torch.float32).eps * max(16.0, logits.abs().max().item())
        diff = (ours[i, : len(row) - 1] - expected).abs().max().item()
        assert diff <= bound, (diff, bound)
        # The images matter: without them (image tokens as plain tokens) the prompt's logprobs differ.
        with torch.no_grad():
            plain = sequence_logprobs(policy, torch.tensor([row])).logprobs[0]
        assert (plain - expected).abs().max() > 100 * bound


def test_the_projector_or_tower_can_be_unfrozen(vision_dir, tmp_path):
    directory = vision_dir("gemma3")
    projector = vision_policy(directory, tmp_path / "p", train="projector")
    tower = vision_policy(directory, tmp_path / "t", train="tower")
    n_projector, n_tower = (sum(p.numel() for p in image_parameters(m)) for m in (projector, tower))
    assert 0 < n_projector < n_tower
    assert n_projector == sum(p.numel() for p in projector.image_model.multi_modal_projector.parameters())
    # The language model is the policy's own module: one set of weights.
    assert projector.image_model.language_model is projector.base
    with pytest.raises(ValueError, match="train must be one of"):
        attach_images(projector, str(directory), train="all")
