"""Pictures of 1 to 4 shapes, drawn with PIL, for the image demo (scripts/demo_images.sh): "How many shapes are in
the picture?".

A picture is a white square split into a 2 x 2 grid of cells; each shape (a square, circle or triangle in one of
four colours, of random size and place) sits in its own cell, so shapes never overlap and the count is what
anyone sees. The tiny vision model of the demo turns a picture into 4 image tokens, one per cell.

Train and held-out pictures are disjoint for every seed: a picture belongs to a split by a fixed hash of its
description (cells, kinds, colours, sizes, places), as the arithmetic problems are split.

The careless teacher of the SFT warm start (the ``teacher`` column) overlooks one shape in a share
``miss_rate`` of the pictures with 3 or 4 shapes: trained on its answers, a model says "2" for most
3-shape pictures and "3" for most 4-shape ones, and the right count only sometimes; GRPO, rewarded by the true
count (the ``answer`` column), has that to reinforce.
"""

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["SHAPE_COUNT_QUESTION", "draw_shapes", "shape_count_rows", "write_shape_count_data"]

SHAPE_COUNT_QUESTION = "How many shapes are in the picture?"
KINDS = ("square", "circle", "triangle")
COLORS = {"red": (220, 40, 40), "blue": (40, 40, 220), "green": (30, 150, 60), "orange": (230, 160, 20)}
#: Side of a picture in pixels (the demo's processor resizes it to 32 x 32).
SIZE = 64
_CELL = SIZE // 2
_HELD_OUT_FRACTION = 0.2

# One shape: (cell 0-3, kind, colour name, side, x, y), (x, y) its box's top-left corner in the picture.
Shape = Tuple[int, str, str, int, int, int]


def _split_of(picture: Tuple[Shape, ...]) -> str:
    """``"validation"`` for a fixed fifth of all pictures (by a hash of the description), else ``"train"``.
    ``hashlib``, not ``hash()``: Python salts string hashes per process."""
    digest = hashlib.blake2b(repr(picture).encode(), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "big") / 2**64 < _HELD_OUT_FRACTION else "train"


def _random_picture(count: int, rng: random.Random) -> Tuple[Shape, ...]:
    shapes = []
    for cell in sorted(rng.sample(range(4), count)):
        side = rng.randint(_CELL // 2, _CELL - 6)
        x = (cell % 2) * _CELL + rng.randint(2, _CELL - side - 2)
        y = (cell // 2) * _CELL + rng.randint(2, _CELL - side - 2)
        shapes.append((cell, rng.choice(KINDS), rng.choice(sorted(COLORS)), side, x, y))
    return tuple(shapes)


def draw_shapes(picture: Tuple[Shape, ...]):
    """The PIL image (RGB, ``SIZE`` x ``SIZE``, white) of a picture's description.

    Args:
        picture (Tuple[Shape, ...]): the shapes, each ``(cell, kind, colour, side, x, y)``.

    Returns:
        PIL.Image.Image: the picture.
    """
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _, kind, color, side, x, y in picture:
        fill = COLORS[color]
        if kind == "square":
            draw.rectangle((x, y, x + side, y + side), fill=fill)
        elif kind == "circle":
            draw.ellipse((x, y, x + side, y + side), fill=fill)
        else:
            draw.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def shape_count_rows(num_pictures: int, *, seed: int = 0, split: str = "train",
                     miss_rate: Optional[float] = None) -> List[Dict[str, Any]]:
    """Descriptions and answers of ``num_pictures`` pictures of ``split``, 1 to 4 shapes each (uniform).

    Args:
        num_pictures (int): how many.
        seed (int): seed of the draw (and of the teacher's slips). Default is 0.
        split (str): ``"train"`` or ``"validation"`` (disjoint, see the module docstring). Default is ``"train"``.
        miss_rate (Optional[float]): with a value, each row also has ``teacher``: the careless teacher's count,
            one short in this share of the pictures with 3 or 4 shapes. Default is None (no ``teacher``).

    Returns:
        List[Dict[str, Any]]: rows ``{"picture", "question", "answer"[, "teacher"]}``, ``answer`` the true count
        as a string (``"3"``), ``picture`` the description :func:`draw_shapes` draws.

    Raises:
        ValueError: an unknown split or a ``miss_rate`` outside [0, 1].
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if miss_rate is not None and not 0.0 <= miss_rate <= 1.0:
        raise ValueError(f"miss_rate must be in [0, 1], got {miss_rate}")
    rng = random.Random(f"shapes-{seed}")
    teacher = random.Random(f"careless-teacher-{seed}")  # its own stream: the pictures do not depend on it
    rows = []
    while len(rows) < num_pictures:
        count = rng.randint(1, 4)
        picture = _random_picture(count, rng)
        if _split_of(picture) != split:
            continue
        row = {"picture": picture, "question": SHAPE_COUNT_QUESTION, "answer": str(count)}
        if miss_rate is not None:
            row["teacher"] = str(count - 1 if count >= 3 and teacher.random() < miss_rate else count)
        rows.append(row)
    return rows


def write_shape_count_data(folder, name: str, num_pictures: int, *, seed: int = 0, split: str = "train",
                           miss_rate: Optional[float] = None) -> Path:
    """Draw :func:`shape_count_rows`' pictures to ``folder/name/<i>.png`` and write ``folder/name.jsonl``, one row
    per picture in :func:`~torchtune_grpo.data.image_dataset`'s format:
    ``{"image": "name/0.png", "question": "How many shapes are in the picture?", "answer": "3"[, "teacher": "2"]}``.

    Args:
        folder: the output folder (created if needed).
        name (str): the file's and the image folder's name, e.g. ``"train"``.
        num_pictures (int), seed (int), split (str), miss_rate (Optional[float]): as :func:`shape_count_rows`.

    Returns:
        Path: the JSONL file.
    """
    folder = Path(folder)
    (folder / name).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, row in enumerate(shape_count_rows(num_pictures, seed=seed, split=split, miss_rate=miss_rate)):
        draw_shapes(row.pop("picture")).save(folder / name / f"{i}.png")
        lines.append(json.dumps({"image": f"{name}/{i}.png", **row}) + "\n")
    path = folder / f"{name}.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path
