"""Issue 32: slime's multimodal data (--multimodal-keys): image references per row (paths relative to the data file,
base64, data URLs, parquet bytes; one or many per prompt), read back lazily, checked at submit (missing, corrupt,
oversized images refused naming the file and the row), and the prompt ids with each image's pad run expanded."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from hpc_rl.config import load_config
from hpc_rl.config.file_checks import data_file_problems, multimodal_config_problems
from hpc_rl.data.images import ImageLimits, image_bytes, image_data_url
from hpc_rl.data.prompts import DataError, DataKeys, PromptDataset, encode_record, make_prompt_encoder
from hpc_rl.data.vision_prompts import ImageGrid, VisionTokenIds, expand_image_pads, vision_messages

KEYS = DataKeys(input_key="prompt", label_key="label", multimodal_keys={"image": "images"})


def png(size: tuple[int, int] = (16, 16), colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_hold_references_and_images_read_back_lazily(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(colour=(0, 255, 0)))
    blue, red = png(colour=(0, 0, 255)), png()
    rows = [
        {"prompt": "<image> what colour ?", "label": "green", "images": ["img/a.png"]},
        {"prompt": "<image> and <image>", "label": "2", "images": [base64.b64encode(blue).decode(),
                                                                       "data:image/png;base64," + base64.b64encode(red).decode()]},
        {"prompt": [{"role": "user", "content": "<image> ?"}], "label": "x", "images": [{"bytes": None, "path": "img/a.png"}]},
    ]
    dataset = PromptDataset.load(write_jsonl(tmp_path / "data.jsonl", rows), KEYS)
    first, second, third = dataset.records
    assert first.images == [str(tmp_path / "img" / "a.png")]
    assert third.images == first.images
    assert all(ref.startswith("inline:") for ref in second.images)  # not held: re-read from the file when drawn
    assert [image_bytes(ref) for ref in second.images] == [blue, red]
    assert image_data_url(first.images[0]) == "data:image/png;base64," + base64.b64encode(png(colour=(0, 255, 0))).decode()


def test_parquet_bytes_column_reads_back(tmp_path: Path) -> None:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    images = [[{"bytes": png(colour=(i * 40, 0, 0)), "path": None}] for i in range(5)]
    table = pa.table({"prompt": ["<image> how many ?"] * 5, "label": [str(i) for i in range(5)], "images": images})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path, row_group_size=2)
    records = PromptDataset.load(path, KEYS).records
    assert [image_bytes(r.images[0]) for r in records] == [i[0]["bytes"] for i in images]


def test_placeholder_and_image_counts_must_agree_naming_the_row(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png())
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>", "label": "1", "images": ["a.png"]},
                                             {"prompt": "<image> <image>", "label": "1", "images": ["a.png"]}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the prompt has 2 '<image>' placeholder\(s\) but the row has 1"):
        PromptDataset.load(path, KEYS)


def test_missing_corrupt_and_oversized_images_are_refused_at_submit_with_the_row(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "corrupt.png").write_bytes(png()[:40])
    (tmp_path / "big.png").write_bytes(png((300, 300)))
    rows = [{"prompt": "<image>", "label": "1", "images": ["ok.png"]},
            {"prompt": "<image>", "label": "1", "images": ["gone.png"]},
            {"prompt": "<image>", "label": "1", "images": ["corrupt.png"]},
            {"prompt": "<image>", "label": "1", "images": ["big.png"]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    limits = ImageLimits(max_bytes=1 << 20, max_pixels=200 * 200)
    problems = data_file_problems(str(path), KEYS, "rollout.prompt_data", skip_bad_lines=True, image_limits=limits)
    assert len(problems) == 1 and problems[0].field == "rollout.prompt_data"
    message = problems[0].message
    assert "3 image(s) cannot be used" in message
    assert f"{path}:2: image file {tmp_path / 'gone.png'} does not exist" in message
    assert f"{path}:3: image {tmp_path / 'corrupt.png'} cannot be decoded" in message
    assert f"{path}:4: image {tmp_path / 'big.png'} is 300x300 pixels, over rollout.max_image_pixels=40000" in message
    few_bytes = data_file_problems(str(write_jsonl(tmp_path / "e.jsonl", rows[:1])), KEYS, "f", skip_bad_lines=False,
                                   image_limits=ImageLimits(max_bytes=10, max_pixels=1 << 30))
    assert "over rollout.max_image_bytes=10" in few_bytes[0].message and "e.jsonl:1" in few_bytes[0].message
    assert data_file_problems(str(write_jsonl(tmp_path / "f.jsonl", rows[:1])), KEYS, "f", skip_bad_lines=False,
                              image_limits=limits) == []


def test_urls_and_per_image_sizes_are_refused(tmp_path: Path) -> None:
    url = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "<image>", "label": "1", "images": ["https://x/y.png"]}])
    with pytest.raises(DataError, match=r"u\.jsonl:1: images\[0\]: image URLs are not fetched"):
        PromptDataset.load(url, KEYS)
    rich = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "<image>", "label": "1",
                                               "images": [{"type": "image", "image": "a.png", "max_pixels": 9}]}])
    with pytest.raises(DataError, match="per-image 'max_pixels' is not offered"):
        PromptDataset.load(rich, KEYS)


@pytest.mark.parametrize("size", [(16, 16), (13, 40), (100, 7), (64, 64), (90, 120), (33, 17)])
def test_image_token_count_is_transformers_processors(size: tuple[int, int]) -> None:
    from hpc_rl.models.qwen3_vl.tiny import MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE, make_image_processor

    grid = ImageGrid(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2, min_pixels=MIN_PIXELS,
                     max_pixels=MAX_PIXELS)
    out = make_image_processor()([Image.new("RGB", size)], return_tensors="np")
    assert grid.image_tokens(*size) == int(out["image_grid_thw"].prod()) // MERGE_SIZE ** 2


def test_prompt_ids_expand_each_image_to_its_tokens(tmp_path: Path) -> None:
    from hpc_rl.models.qwen3_vl.tiny import build_vl_tokenizer, make_image_processor

    tokenizer = build_vl_tokenizer()
    make_image_processor().save_pretrained(tmp_path)
    (tmp_path / "a.png").write_bytes(png((16, 16)))
    (tmp_path / "b.png").write_bytes(png((64, 32)))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image> how many shapes ? <image>", "label": "2",
                                               "images": ["a.png", "b.png"]}])
    record = PromptDataset.load(path, KEYS).records[0]
    encoder = make_prompt_encoder(tokenizer, apply_chat_template=True, image_grid=ImageGrid.from_checkpoint(tmp_path))
    ids = encode_record(encoder, record)
    tokens = VisionTokenIds.from_tokenizer(tokenizer)
    assert ids.count(tokens.image_pad) == 1 + 8  # 16x16: 2x2 patches / 4; 64x32: 8x4 / 4
    assert ids.count(tokens.vision_start) == 2
    assert expand_image_pads(ids, [1, 8], tokens) == ids  # already expanded runs stay (SGLang's rule)
    assert vision_messages("<image> hi")[0]["content"] == [{"type": "image"}, {"type": "text", "text": " hi"}]


def test_slime_flag_is_accepted_and_needs_the_chat_template() -> None:
    config = load_config([], ["--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    assert config.rollout.multimodal_keys == {"image": "images"}
    assert multimodal_config_problems(config) == []
    bare = load_config([], ["--multimodal-keys", '{"image": "images"}'])
    assert "set apply_chat_template" in multimodal_config_problems(bare)[0].message
    video = load_config([], ["--multimodal-keys", '{"video": "videos"}', "--apply-chat-template"])
    assert "video are not served" in multimodal_config_problems(video)[0].message


def test_image_references_reach_the_trainer_and_its_pixels_match_the_prompt(tmp_path: Path) -> None:
    """The controller packs each sample's image references (JSON text as uint8, no pickle: it loads no torch); the
    trainer turns them into the processed images TrainBatch reads (image_counts, image_grid_thw, pixel_values),
    one patch grid per image whose merged size is the prompt's pad count."""
    from hpc_rl.controller.train_batches import pack_samples
    from hpc_rl.data.images import image_refs_from_array
    from hpc_rl.data.samples import Sample
    from hpc_rl.data.vision_prompts import image_processor, processed_images, with_processed_images
    from hpc_rl.models.qwen3_vl.tiny import build_vl_tokenizer, make_image_processor

    make_image_processor().save_pretrained(tmp_path)
    (tmp_path / "a.png").write_bytes(png((16, 16)))
    (tmp_path / "b.png").write_bytes(png((64, 32), (0, 0, 255)))
    refs = [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    tokenizer = build_vl_tokenizer()
    encoder = make_prompt_encoder(tokenizer, apply_chat_template=True, image_grid=ImageGrid.from_checkpoint(tmp_path))
    ids = encoder("<image> <image> how many ?", {}, refs)
    samples = [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=ids if i else [3, 4], images=refs if i else [],
                      response_token_ids=[10, 11], response_logprobs=[-1.0, -2.0], weight_versions=[0, 0])
               for i in range(3)]
    arrays = pack_samples(samples, [0.5, -0.5, 0.0])
    assert arrays["image_refs"].dtype.name == "uint8"
    assert image_refs_from_array(arrays["image_refs"]) == [[], refs, refs]
    assert "image_refs" not in pack_samples(samples[:1], [0.0])  # text-only batches carry nothing new
    trainer_side = with_processed_images(arrays, image_processor(tmp_path))
    assert "image_refs" not in trainer_side and trainer_side["tokens"] is arrays["tokens"]
    assert trainer_side["image_counts"].tolist() == [0, 2, 2]
    assert trainer_side["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 8]] * 2  # 16x16, 64x32 in 8-pixel patches
    assert trainer_side["pixel_values"].shape == (2 * (4 + 32), 3 * 2 * 8 * 8)
    one = processed_images(refs, image_processor(tmp_path))
    assert (trainer_side["pixel_values"][:36] == one["pixel_values"]).all()
    assert int(one["image_grid_thw"].prod(axis=1).sum()) // 4 == ids.count(VisionTokenIds.from_tokenizer(tokenizer).image_pad)
