"""The tiny visual task (issue 32): coloured shapes on 16x16 canvases; the question asks for a colour or a count.

Owns: drawing the images (seeded, PIL), the prompt rows in slime's multimodal format (`{"prompt": "<image> what
colour is the shape ?", "label": "red", "images": ["images/train_0003.png"]}`, paths relative to the jsonl), the
files under `data/tiny_vl/` (`python -m hpc_rl.data.tiny_vl_task` rewrites them), the words its prompts and answers
use (`VL_TASK_WORDS`: a tiny tokenizer must have them, or they read as `<unk>`), and the rule reward (rm type
`tiny_vl_task`): 1.0 when the first colour word (a colour label) or the first digit (a count label) of the response
is the label, else 0.0. Only the image tells the answer: the colour question's text is always the same, as is the
count question's, so a policy that scores above chance reads the image.

The learning split (`data/tiny_vl_colour/`, `configs/tiny_vl_cpu.yaml`): colour questions only, each image a
32x32 canvas filled with one colour (4 image tokens), labels balanced over the 4 colours (so any constant answer
scores 0.25) and each pixel value jittered (held-out images are new pixels). The mixed split (`data/tiny_vl/`,
shapes and counts on 16x16, one image token) is not learned in a few CPU minutes; it stays for the data-path tests.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220),
                                            "yellow": (230, 210, 30)}
CANVAS = 16
MAX_COUNT = 4
LEARN_CANVAS = 32
"""The learning split's canvas: 32x32 is 4 image tokens (patch 8, merge 2)."""
COLOUR_JITTER = 20
COLOUR_TRAIN_ROWS, COLOUR_EVAL_ROWS = 128, 32
COLOUR_QUESTION = "<image> what colour is the shape ?"
COUNT_QUESTION = "<image> how many shapes are there ?"
VL_TASK_WORDS = ["what", "colour", "is", "the", "shape", "how", "many", "shapes", "are", "there", "?",
                 *COLOURS]
"""Every word of the prompts and labels (digits 1-4 are in the tiny vocabulary already)."""
_WORD = re.compile(r"[a-z]+|\d")


def draw_colour_image(rng: random.Random) -> tuple[Any, str]:
    """One square (6 to 9 pixels a side) of a random colour on a white canvas; (image, colour name)."""
    from PIL import Image, ImageDraw

    name = rng.choice(sorted(COLOURS))
    side = rng.randint(6, 9)
    x, y = rng.randint(0, CANVAS - side), rng.randint(0, CANVAS - side)
    image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[name])
    return image, name


def draw_count_image(rng: random.Random) -> tuple[Any, int]:
    """1 to MAX_COUNT separate 3x3 squares (one colour each) in distinct cells of a 4x4 grid; (image, count)."""
    from PIL import Image, ImageDraw

    count = rng.randint(1, MAX_COUNT)
    image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(16), count):
        x, y = (cell % 4) * 4, (cell // 4) * 4
        draw.rectangle([x, y, x + 2, y + 2], fill=COLOURS[rng.choice(sorted(COLOURS))])
    return image, count


def write_tiny_vl_task(directory: str | Path, split: str, count: int, seed: int) -> Path:
    """`count` rows (half colour, half count questions) and their PNGs: `<directory>/<split>.jsonl`,
    `<directory>/images/<split>_NNNN.png`."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        if index % 2 == 0:
            image, label = draw_colour_image(rng)
            prompt = COLOUR_QUESTION
        else:
            image, number = draw_count_image(rng)
            prompt, label = COUNT_QUESTION, str(number)
        name = f"images/{split}_{index:04d}.png"
        image.save(directory / name, format="PNG", optimize=True)
        rows.append({"prompt": prompt, "label": label, "images": [name]})
    path = directory / f"{split}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def draw_colour_canvas(rng: random.Random, colours: list[str], index: int) -> tuple[Any, str]:
    """A LEARN_CANVAS-square canvas filled with `colours[index % len(colours)]` (balanced labels), each channel
    shifted by up to +-COLOUR_JITTER (so held-out images are new pixels); (image, colour name)."""
    from PIL import Image

    name = colours[index % len(colours)]
    fill = tuple(max(0, min(255, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in COLOURS[name])
    return Image.new("RGB", (LEARN_CANVAS, LEARN_CANVAS), fill), name


def write_tiny_vl_colour_task(directory: str | Path, split: str, count: int, seed: int,
                              colours: list[str] | None = None) -> Path:
    """The learning split: `count` colour questions over whole-canvas colours (`draw_colour_canvas`), rows
    `<directory>/<split>.jsonl`, images `<directory>/images/<split>_NNNN.png`."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = sorted(colours or COLOURS)
    rows = []
    for index in range(count):
        image, label = draw_colour_canvas(rng, colours, index)
        name = f"images/{split}_{index:04d}.png"
        image.save(directory / name, format="PNG", optimize=True)
        rows.append({"prompt": COLOUR_QUESTION, "label": label, "images": [name]})
    path = directory / f"{split}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_vl_task_reward(response: str, label: object) -> float:
    """1.0 if the response's first colour word (colour label) or first digit (count label) is the label."""
    truth = str(label).strip().lower()
    wanted = (lambda word: word.isdigit()) if truth.isdigit() else (lambda word: word in COLOURS)
    first = next((word for word in _WORD.findall(response.lower()) if wanted(word)), None)
    return 1.0 if first == truth else 0.0


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2] / "data" / "tiny_vl"
    print(write_tiny_vl_task(root, "train", 128, seed=0))
    print(write_tiny_vl_task(root, "eval", 32, seed=1))
    colour_root = root.parent / "tiny_vl_colour"
    print(write_tiny_vl_colour_task(colour_root, "train", COLOUR_TRAIN_ROWS, seed=0))
    print(write_tiny_vl_colour_task(colour_root, "eval", COLOUR_EVAL_ROWS, seed=1))
