"""Issue 32: `--rm-type geo3k` (slime's Geometry3K grader: last \\boxed{} vs the label under sympy, numbers within 0.05
counting as equal, fractions as written, integer labels needing integers) and the tiny visual task's reward and
data (the committed files are what the generator writes; every image decodes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config.file_checks import data_file_problems
from hpc_rl.data.images import ImageLimits
from hpc_rl.data.prompts import DataKeys, PromptDataset
from hpc_rl.data.tiny_vl_task import (COLOUR_EVAL_ROWS, COLOUR_TRAIN_ROWS, COLOURS, tiny_vl_task_reward,
                                      write_tiny_vl_colour_task, write_tiny_vl_task)
from hpc_rl.rewards import score

REPO = Path(__file__).resolve().parents[2]


# Expected values: slime's own compute_score_geo3k (slime/rollout/rm_hub/geo3k.py at 20cabd5c^) run on each pair.
@pytest.mark.parametrize(("response", "label", "expected"), [
    ("so the area is \\boxed{12}", "12", 1.0),
    ("\\boxed{12.0}", "12", 1.0),            # normalised to 12
    ("\\boxed{12.03}", "12", 0.0),           # an integer label needs an integer answer (no tolerance then)
    ("\\boxed{12.5}", "12", 0.0),
    ("\\boxed{3.47}", "2\\sqrt{3}", 1.0),
    ("\\boxed{\\frac{8}{15}}", "\\frac{8}{16}", 0.0),
    ("\\boxed{13}", "12", 0.0),
    ("\\boxed{\\frac{8}{15}}", "0.53", 1.0),  # rounded label: |8/15 - 0.53| = 0.0033 <= 0.05
    ("\\boxed{0.6}", "0.53", 0.0),           # 0.07 off
    ("\\boxed{0.57}", "0.53", 1.0),          # within the tolerance
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),  # two fractions must match as written
    ("\\boxed{2\\sqrt{3}}", "3.46", 1.0),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{x}", "12", 0.0),
    ("the answer is 12", "12", 0.0),          # no box: nothing graded
    ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
    ("\\boxed{60^\\circ}", "60", 1.0),
])
def test_geo3k_grades_as_slimes_grader(response: str, label: str, expected: float) -> None:
    assert score("geo3k", response, label) == expected


def test_geo3k_is_a_config_rm_type() -> None:
    from hpc_rl.config import load_config

    assert load_config([], ["--rm-type", "geo3k"]).rollout.rm_type == "geo3k"


@pytest.mark.parametrize(("response", "label", "expected"), [
    ("red", "red", 1.0), ("it is blue , not red", "red", 0.0), ("3", "3", 1.0), ("blue 2 4", "4", 0.0),
    ("", "red", 0.0), ("Green", "green", 1.0), ("red", "2", 0.0),
])
def test_tiny_vl_task_reward(response: str, label: str, expected: float) -> None:
    assert tiny_vl_task_reward(response, label) == expected
    assert score("tiny_vl_task", response, label) == expected


def test_committed_tiny_vl_data_is_the_generators_and_checks_clean(tmp_path: Path) -> None:
    committed = REPO / "data" / "tiny_vl"
    for split, count, seed in (("train", 128, 0), ("eval", 32, 1)):
        written = write_tiny_vl_task(tmp_path, split, count, seed)
        assert written.read_text() == (committed / f"{split}.jsonl").read_text()
        for index in range(count):
            name = f"images/{split}_{index:04d}.png"
            assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
    keys = DataKeys(input_key="prompt", label_key="label", multimodal_keys={"image": "images"})
    records = PromptDataset.load(committed / "train.jsonl", keys).records
    assert len(records) == 128 and {r.label for r in records} == {"red", "green", "blue", "yellow", "1", "2", "3", "4"}
    assert data_file_problems(str(committed / "train.jsonl"), keys, "rollout.prompt_data", skip_bad_lines=False,
                              rm_type="tiny_vl_task", image_limits=ImageLimits(1 << 20, 64 * 64)) == []


def test_committed_colour_split_is_the_generators_balanced_and_held_out(tmp_path: Path) -> None:
    """The learning split: the committed files are the generator's, each colour a quarter of each split (a constant
    answer scores 0.25), the eval images are other pixels than the train images, every image is 32x32."""
    from PIL import Image

    committed = REPO / "data" / "tiny_vl_colour"
    pixels: dict[str, set[tuple[int, int, int]]] = {}
    for split, count, seed in (("train", COLOUR_TRAIN_ROWS, 0), ("eval", COLOUR_EVAL_ROWS, 1)):
        written = write_tiny_vl_colour_task(tmp_path, split, count, seed)
        assert written.read_text() == (committed / f"{split}.jsonl").read_text()
        keys = DataKeys(input_key="prompt", label_key="label", multimodal_keys={"image": "images"})
        records = PromptDataset.load(committed / f"{split}.jsonl", keys).records
        labels = [r.label for r in records]
        assert {label: labels.count(label) for label in COLOURS} == {label: count // 4 for label in COLOURS}
        pixels[split] = set()
        for index in range(count):
            name = f"images/{split}_{index:04d}.png"
            assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
            with Image.open(committed / name) as image:
                assert image.size == (32, 32) and len(image.getcolors()) == 1, name
                pixels[split].add(image.getpixel((0, 0)))
        assert data_file_problems(str(committed / f"{split}.jsonl"), keys, "rollout.prompt_data",
                                  skip_bad_lines=False, rm_type="tiny_vl_task",
                                  image_limits=ImageLimits(1 << 20, 64 * 64)) == []
    assert len(pixels["eval"] - pixels["train"]) >= COLOUR_EVAL_ROWS - 2  # held out: (nearly) all new colours
