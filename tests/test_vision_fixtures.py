"""The tiny image-prompt directories of :mod:`tests.hf_vision` load offline as transformers loads real ones."""

import pytest
import torch

from tests.hf_vision import IMAGE_MARKER, processor_inputs, shape_image, VISION_FAMILIES


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_vision_dir_loads_offline(vision_dir, family):
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from tests import family_templates as T

    directory = vision_dir(family)
    tok = AutoTokenizer.from_pretrained(directory)
    assert AutoImageProcessor.from_pretrained(directory) is not None
    # A string content renders exactly as the text family's template (the package's text prompts unchanged).
    text_only = AutoTokenizer.from_pretrained(directory)
    text_only.chat_template = {"qwen3_5": T.QWEN3_5, "gemma3": T.GEMMA3, "gemma4": T.GEMMA4}[family]
    messages = [{"role": "user", "content": "  What is 2+2? "}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        text_only.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which shape?"}]}]
    rendered = tok.apply_chat_template(image_messages, tokenize=False, add_generation_prompt=True)
    assert IMAGE_MARKER[family] + "Which shape?" in rendered
    try:
        processor = AutoProcessor.from_pretrained(directory)
    except ImportError as err:  # Qwen3VLProcessor / Gemma4Processor: their video processor needs torchvision
        chain = f"{err} {err.__cause__}".lower()
        assert family != "gemma3" and "torchvision" in chain, chain
    else:
        assert processor.image_processor is not None


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_image_inputs_run_in_the_image_text_class(vision_dir, family):
    """Every image token gets one image feature: transformers' own class accepts the inputs (it checks the
    count of image tokens against the features)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    directory = vision_dir(family)
    tok = AutoTokenizer.from_pretrained(directory)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Shape?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    inputs = processor_inputs(family, directory, text, [shape_image("circle")])
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
