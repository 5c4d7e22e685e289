"""image_dataset: rows with images become prompts built by the model directory's processor; bad images are
dropped and counted, or refused naming the row and the file."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.hf_vision import processor_inputs, shape_image, VISION_FAMILIES
from torchtune_grpo.data import image_dataset


def _write_rows(folder, rows):
    (folder / "img").mkdir(exist_ok=True)
    for name, image in rows.get("images", {}).items():
        if isinstance(image, bytes):
            (folder / "img" / name).write_bytes(image)
        else:
            image.save(folder / "img" / name)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows["rows"]), encoding="utf-8")
    return path


def _good_rows():
    return {"images": {"c.png": shape_image("circle"), "s.png": shape_image("square", size=(16, 24)),
                       "t.png": shape_image("triangle")},
            "rows": [{"image": "img/c.png", "question": "Which shape?", "answer": "circle", "id": 0},
                     {"image": ["img/s.png", "img/t.png"], "question": "Which shapes?", "answer": "square triangle",
                      "id": 1}]}


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_prompts_are_the_processors(vision_dir, tmp_path, family):
    """The sample's tokens and image tensors are those of the family's processor on the same chat prompt."""
    directory = vision_dir(family)
    path = _write_rows(tmp_path, _good_rows())
    data = image_dataset(SimpleNamespace(path=str(directory)), "json", data_files=str(path))
    assert len(data) == 2
    for sample, names in zip(data, (["c.png"], ["s.png", "t.png"])):
        from PIL import Image

        images = [Image.open(tmp_path / "img" / n).convert("RGB") for n in names]
        expected = processor_inputs(family, directory, sample["prompt"], images)
        assert sample["tokens"] == expected["input_ids"][0].tolist()
        assert sample["num_images"] == len(names) and "image" not in sample and sample["id"] in (0, 1)
        for key, value in sample["image_inputs"].items():
            want = expected[key][0] if key.endswith("token_type_ids") else expected[key]
            assert torch.equal(value, want), key
        assert set(sample["image_inputs"]) == set(expected) - {"input_ids"}


def test_bad_images_are_dropped_and_counted(vision_dir, tmp_path, caplog):
    rows = _good_rows()
    rows["images"]["broken.png"] = b"not a png"
    # Qwen's image processor refuses an aspect ratio over 200 (smart_resize).
    rows["images"]["thin.png"] = shape_image("square", size=(1, 300))
    rows["rows"] += [{"image": "img/nowhere.png", "question": "q", "answer": "a"},
                     {"image": "img/broken.png", "question": "q", "answer": "a"},
                     {"image": "img/thin.png", "question": "q", "answer": "a"},
                     {"image": None, "question": "q", "answer": "a"}]
    path = _write_rows(tmp_path, rows)
    tok = SimpleNamespace(path=str(vision_dir("qwen3_5")))
    with caplog.at_level(logging.WARNING):
        data = image_dataset(tok, "json", data_files=str(path))
    assert len(data) == 2 and data.bad_images == {"missing": 1, "unreadable": 1, "refused": 1}
    assert data.num_invalid == 1  # the null image: the text builders' blank-value rule
    assert "missing: 1, refused: 1, unreadable: 1" in caplog.text
    with pytest.raises(ValueError, match=r"row 2 \(0-based\) of 'json'.*nowhere\.png is missing.*on_invalid_row"):
        image_dataset(tok, "json", data_files=str(path), on_invalid_row="error")


def test_datasets_image_column(vision_dir, tmp_path):
    """A Hugging Face dataset with an image column (here written to parquet); an undecodable image is dropped."""
    import io

    from datasets import Dataset, Features, Image, Value

    def png(image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    features = Features({"picture": Image(), "q": Value("string"), "a": Value("string")})
    rows = Dataset.from_dict({"picture": [png(shape_image("circle")), {"bytes": b"junk", "path": "junk.png"}],
                              "q": ["Which shape?", "?"], "a": ["circle", "x"]}, features=features)
    rows.to_parquet(str(tmp_path / "train.parquet"))
    data = image_dataset(SimpleNamespace(path=str(vision_dir("gemma3"))), "parquet",
                         data_files=str(tmp_path / "train.parquet"), image_column="picture", question_column="q",
                         answer_column="a")
    assert len(data) == 1 and data.bad_images == {"unreadable": 1}
    assert data[0]["image_inputs"]["pixel_values"].shape == (1, 3, 16, 16)


def test_image_placeholders_place_the_images_in_the_question(vision_dir, tmp_path, caplog):
    """``image_placeholder``: each marker becomes the row's next image, where it stood, and leaves the text; a row
    whose markers and images differ in number is dropped and counted, or refused naming the row."""
    from PIL import Image

    from torchtune_grpo.data._image_processor import load_image_processor

    rows = _good_rows()
    rows["rows"] = [{"image": "img/c.png", "question": "<image>Which shape?", "answer": "circle"},
                    {"image": ["img/s.png", "img/t.png"], "question": "Is <image> bigger than <image>?",
                     "answer": "yes"},
                    {"image": "img/c.png", "question": "No marker here.", "answer": "a"}]
    path = _write_rows(tmp_path, rows)
    directory = vision_dir("qwen3_5")
    tok = SimpleNamespace(path=str(directory))
    with caplog.at_level(logging.WARNING):
        data = image_dataset(tok, "json", data_files=str(path), image_placeholder="<image>")
    assert len(data) == 2 and data.bad_images == {"mismatched": 1} and "mismatched: 1" in caplog.text
    processor = load_image_processor(str(directory))
    contents = ([{"type": "image"}, {"type": "text", "text": "Which shape?"}],
                [{"type": "text", "text": "Is"}, {"type": "image"}, {"type": "text", "text": "bigger than"},
                 {"type": "image"}, {"type": "text", "text": "?"}])
    for sample, content, names in zip(data, contents, (["c.png"], ["s.png", "t.png"])):
        want = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        assert sample["prompt"] == want and "<image>" not in sample["prompt"]
        images = [Image.open(tmp_path / "img" / n).convert("RGB") for n in names]
        assert sample["tokens"] == processor_inputs("qwen3_5", directory, want, images)["input_ids"][0].tolist()
    # The first image's tokens come after "Is" and before "bigger than": the image sits where its marker stood.
    prompt = data[1]["prompt"]
    assert prompt.index("Is") < prompt.index("<|vision_start|>") < prompt.index("bigger than")
    with pytest.raises(ValueError, match=r"row 2 \(0-based\).*is mismatched \(the question has 0 '<image>' "
                                         r"marker\(s\) for 1 image\(s\)\)"):
        image_dataset(tok, "json", data_files=str(path), image_placeholder="<image>", on_invalid_row="error")
