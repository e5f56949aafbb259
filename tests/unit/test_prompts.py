"""Prompt data: JSONL/parquet rows, errors with file:line, opt-in skipping, exact cursor resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.data.prompts import (DataError, DataKeys, PromptDataset, PromptSource, make_group,
                                 make_prompt_encoder)
from tests.conftest import TEST_DATA


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_dapo_sample_loads_with_chat_prompts() -> None:
    dataset = PromptDataset.load(TEST_DATA / "dapo_math_17k_sample.jsonl", DataKeys())
    assert len(dataset) == 55
    assert dataset.records[0].prompt[0]["role"] == "user"
    assert dataset.records[0].label == "34"


def test_string_prompts_and_metadata(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"question": "q1", "label": 1, "meta": {"level": 3}}])
    keys = DataKeys(input_key="question", label_key="label", metadata_key="meta")
    record = PromptDataset.load(path, keys).records[0]
    assert (record.prompt, record.label, record.metadata) == ("q1", 1, {"level": 3})


def test_bad_line_is_an_error_with_line_number(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "label": 1}, "{not json", {"prompt": "b", "label": 2}])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        PromptDataset.load(path, DataKeys())


def test_bad_lines_skipped_on_request_are_counted(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "label": 1}, "{not json", {"prompt": 5, "label": 2},
                                            {"prompt": "c", "label": 3}])
    dataset = PromptDataset.load(path, DataKeys(), skip_bad_lines=True)
    assert len(dataset) == 2 and dataset.skipped_lines == 2
    listed = dataset.describe_skipped().splitlines()  # old code: only a count
    assert listed[0].startswith(f"  {path}:2: not valid JSON") and listed[1].startswith(f"  {path}:3: ")


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p0", "label": "0"}, {"prompt": "p1", "label": "1"}]), path)
    assert [r.prompt for r in PromptDataset.load(path, DataKeys()).records] == ["p0", "p1"]


def test_cursor_round_trip_across_epochs(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "label": i} for i in range(10)])
    dataset = PromptDataset.load(path, DataKeys())
    uninterrupted = PromptSource(dataset, shuffle=True, seed=7)
    expected = [r.row for r in uninterrupted.next_records(37)]
    first = PromptSource(dataset, shuffle=True, seed=7)
    head = [r.row for r in first.next_records(13)]
    state = json.loads(json.dumps(first.state_dict()))  # it must survive JSON (checkpoints)
    resumed = PromptSource(dataset, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert head + [r.row for r in resumed.next_records(24)] == expected
    # each epoch is a permutation, and epochs differ
    assert sorted(expected[:10]) == list(range(10)) and expected[:10] != expected[10:20]


def test_cursor_refuses_other_data(tmp_path: Path) -> None:
    small = PromptDataset.load(write_rows(tmp_path / "a.jsonl", [{"prompt": "x", "label": 0}] * 3), DataKeys())
    large = PromptDataset.load(write_rows(tmp_path / "b.jsonl", [{"prompt": "x", "label": 0}] * 4), DataKeys())
    state = PromptSource(small, shuffle=False, seed=0).state_dict()
    with pytest.raises(DataError, match="cursor is for 3 rows but the file has 4"):
        PromptSource(large, shuffle=False, seed=0).load_state_dict(state)


def test_chat_template_and_groups(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encode = make_prompt_encoder(tokenizer, apply_chat_template=True)
    ids = encode([{"role": "user", "content": "copy 7"}], {})
    assert tokenizer.decode(ids) == "<|im_start|> user copy 7 <|im_end|> <|im_start|> assistant"
    dataset = PromptDataset.load(TEST_DATA / "aime_2024_head5.jsonl", DataKeys())
    group = make_group(dataset.records[3], group_index=5, first_sample_index=40, n_samples=4, prompt_token_ids=ids)
    assert [s.index for s in group] == [40, 41, 42, 43]
    assert all(s.group_index == 5 and s.label == dataset.records[3].label for s in group)
    assert group[0].metadata["data_row"] == 3


def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path) -> None:
    from hpc_rl.data.prompts import DataError, DataKeys, PromptDataset

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": 1}\n{"prompt": "caf\xe9", "label": 2}\n{"prompt": "c", "label": 3}\n')
    try:
        PromptDataset.load(path, DataKeys())
    except DataError as error:  # the old code: UnicodeDecodeError with no line
        assert f"{path}:2: not UTF-8 (byte 0xe9 at column 16)" in str(error)
    else:
        raise AssertionError("a non-UTF-8 line was accepted")
    dataset = PromptDataset.load(path, DataKeys(), skip_bad_lines=True)
    assert [r.label for r in dataset.records] == [1, 3] and dataset.skipped_lines == 1
