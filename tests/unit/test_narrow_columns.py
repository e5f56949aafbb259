"""Narrow columns (data/column_forms.py): the answer worker sends token ids as int32 and log-probs as float32 only
when exact; a sample holds either form with the same values for every reader; packing, the journal and the state
digest give the same bytes for both forms."""

from __future__ import annotations

import copy
import math
import pickle
import struct
from array import array

import orjson
import pytest

from hpc_rl.controller.retained_journal import RetainedBatch
from hpc_rl.controller.state_digest import state_digest
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.column_forms import narrowed, widened
from hpc_rl.data.samples import Sample
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.rollout.buffer_snapshot import BufferSnapshot
from hpc_rl.rollout.answer_workers import (array_targets, compact_answers, encode_frame, join_arrays, place_arrays,
                                           split_arrays)

IDS, LOGPROBS = "response_token_ids", "response_logprobs"


def answer(ids: list[int], logprobs: list[float]) -> dict:
    return {"text": "x", "output_ids": ids,
            "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


def parsed(ids: list[int], logprobs: list[float]) -> tuple[array, array]:
    ok, body = compact_answers(orjson.dumps(answer(ids, logprobs)))
    assert ok
    return body["output_ids"], body["meta_info"]["output_token_logprobs"]


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def test_the_worker_narrows_ids_and_float32_logprobs_and_keeps_the_values() -> None:
    f32 = struct.unpack("<f", struct.pack("<f", -1.2345678))[0]  # a float32 value, as SGLang's .tolist() gives
    ids, logprobs = parsed([0, 7, 2**31 - 1, -2**31], [-0.5, -0.0, f32, 0.0])
    assert (ids.typecode, logprobs.typecode) == ("i", "f")
    assert ids.tolist() == [0, 7, 2**31 - 1, -2**31]
    assert bits(logprobs.tolist()) == bits([-0.5, -0.0, f32, 0.0])  # -0.0 kept


def test_the_worker_keeps_int64_and_float64_when_narrowing_is_not_exact() -> None:
    ids, logprobs = parsed([1, 2**31], [-0.5, 0.1])  # an id beyond int32; 0.1 is no float32 value
    assert (ids.typecode, logprobs.typecode) == ("q", "d")
    assert ids.tolist() == [1, 2**31] and logprobs.tolist() == [-0.5, 0.1]
    ids, _ = parsed([-2**31 - 1], [0.0])
    assert ids.typecode == "q" and ids.tolist() == [-2**31 - 1]


def test_nan_narrows_when_its_bits_come_back_and_not_otherwise() -> None:
    quiet = array("d", [float("nan"), -0.5])
    assert narrowed(quiet).typecode == "f" and math.isnan(narrowed(quiet)[0])
    assert widened(narrowed(quiet)).tobytes() == quiet.tobytes()
    payload = array("d")
    payload.frombytes(struct.pack("<Q", 0x7FF8000000000001))  # a NaN whose low payload bit float32 loses
    assert narrowed(payload) is payload
    big = array("d", [1e300])  # beyond float32's range
    assert narrowed(big) is big
    assert narrowed(array("d")).typecode == "f" and narrowed(array("q")).typecode == "i"


def test_frame_specs_carry_the_typecode_and_both_readers_use_it() -> None:
    _, body = compact_answers(orjson.dumps([answer([1, 2], [-0.5, -1.0]), answer([2**40], [0.1])]))
    stripped, specs, buffers = split_arrays(body)
    assert specs == [[0, "ids", 2, "i"], [0, "logprobs", 2, "f"], [1, "ids", 1, "q"], [1, "logprobs", 1, "d"]]
    payload = b"".join(bytes(memoryview(b)) for b in buffers)
    assert len(payload) == 2 * 4 + 2 * 4 + 8 + 8
    header = orjson.loads(encode_frame({"body": stripped, "arrays": specs}, buffers)[1])
    joined = join_arrays(copy.deepcopy(header["body"]), specs, payload)
    targets = array_targets(specs, len(payload))
    assert [t.typecode for t in targets] == ["i", "f", "q", "d"]
    view = memoryview(payload)
    offset = 0
    for target in targets:  # as the frame reader fills them
        size = len(target) * target.itemsize
        memoryview(target).cast("B")[:] = view[offset:offset + size]
        offset += size
    placed = place_arrays(header["body"], specs, targets)
    for got in (joined, placed):
        assert [(a["output_ids"].typecode, a["output_ids"].tolist()) for a in got] == [("i", [1, 2]), ("q", [2**40])]
        assert [a["meta_info"]["output_token_logprobs"].tolist() for a in got] == [[-0.5, -1.0], [0.1]]
    # a spec of three (before the typecode) is int64 / float64; an unknown typecode is refused
    old = join_arrays([{"output_ids": None, "meta_info": {}}], [[0, "ids", 1]], array("q", [9]).tobytes())
    assert old[0]["output_ids"].typecode == "q" and old[0]["output_ids"].tolist() == [9]
    assert array_targets([[0, "ids", 1, "d"]], 8) is None
    with pytest.raises(ValueError, match="typecode 'd'"):
        join_arrays([{"output_ids": None}], [[0, "ids", 1, "d"]], b"\0" * 8)


def narrow_sample(index: int = 1) -> Sample:
    sample = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    sample.extend_response(array("i", [10, 11]), array("f", [-0.5, -0.25]), UniformColumn(2, 2), adopt=True)
    sample.extend_response([12], [-1.0], [3])
    return sample


def wide_sample(index: int = 1) -> Sample:
    sample = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    sample.extend_response(array("q", [10, 11]), array("d", [-0.5, -0.25]), array("q", [2, 2]))
    sample.extend_response([12], [-1.0], [3])
    return sample


def test_a_narrow_sample_reads_as_the_wide_one() -> None:
    narrow, wide = narrow_sample(), wide_sample()
    assert (narrow.column(IDS).typecode, narrow.column(LOGPROBS).typecode) == ("i", "f")  # exact appends stay narrow
    for clone in (copy.deepcopy(narrow), pickle.loads(pickle.dumps(narrow))):
        assert clone.column(IDS).typecode == "i" and clone.column(LOGPROBS).typecode == "f" and clone == wide
    assert narrow.to_dict() == wide.to_dict() and narrow == wide  # (equality reads the fields: lists after it)
    assert narrow.response_token_ids == [10, 11, 12] and narrow.response_logprobs == [-0.5, -0.25, -1.0]


def test_a_later_turn_appending_wider_numbers_widens_the_column_first() -> None:
    sample = narrow_sample()
    sample.extend_response(array("q", [2**40]), array("d", [0.1]), UniformColumn(3, 1))
    assert (sample.column(IDS).typecode, sample.column(LOGPROBS).typecode) == ("q", "d")
    assert sample.response_token_ids == [10, 11, 12, 2**40] and sample.response_logprobs == [-0.5, -0.25, -1.0, 0.1]
    listed = narrow_sample()
    listed.extend_response([2**35], [0.1], [3])  # lists of numbers that do not fit: widened too
    assert listed.column(IDS).typecode == "q" and listed.column(IDS).tolist() == [10, 11, 12, 2**35]
    assert listed.column(LOGPROBS).typecode == "d" and listed.column(LOGPROBS)[-1] == 0.1
    wide = wide_sample()  # narrow appended to wide: the wide column takes the numbers
    wide.extend_response(array("i", [13]), array("f", [-2.0]), [3])
    assert (wide.column(IDS).typecode, wide.column(IDS).tolist()) == ("q", [10, 11, 12, 13])
    assert (wide.column(LOGPROBS).typecode, wide.column(LOGPROBS).tolist()) == ("d", [-0.5, -0.25, -1.0, -2.0])
    fresh = Sample(index=1, group_index=0, prompt="p", prompt_token_ids=[5])  # not adopted: copied, narrow
    given = array("i", [4])
    fresh.extend_response(given, array("f", [-0.5]), [1])
    assert fresh.column(IDS).typecode == "i" and fresh.column(IDS) is not given


def test_hold_columns_takes_either_form_and_refuses_others() -> None:
    sample = wide_sample()
    sample.hold_columns({IDS: array("i", [1]), LOGPROBS: array("f", [-0.5])})
    assert sample.response_token_ids == [1] and sample.response_logprobs == [-0.5]
    with pytest.raises(ValueError, match="response_logprobs: a compact column is an array of typecode 'd' or 'f'"):
        sample.hold_columns({LOGPROBS: array("i", [1])})
    with pytest.raises(ValueError, match="weight_versions"):
        sample.hold_columns({"weight_versions": array("i", [1])})


def test_narrow_and_wide_samples_pack_to_the_same_trainer_bytes() -> None:
    narrow = [narrow_sample(1), narrow_sample(2)]
    wide = [wide_sample(1), wide_sample(2)]
    before, after = pack_samples(wide, [0.5, -0.5]), pack_samples(narrow, [0.5, -0.5])
    assert sorted(before) == sorted(after)
    for name, values in before.items():
        assert (values.dtype, values.shape, values.tobytes()) == (after[name].dtype, after[name].shape,
                                                                  after[name].tobytes()), name


def test_the_journal_writes_a_narrow_column_as_it_is_and_reads_it_back_narrow() -> None:
    batch = RetainedBatch(rollout_id=1, weight_version=4, session_id=None, state_before="x", state_after={},
                          groups=[[narrow_sample(1), wide_sample(2)]])
    line, buffers = batch.encode()
    back = RetainedBatch.decode(line + b"".join(bytes(b) for b in buffers))
    narrow_back = back.groups[0][0]
    assert (narrow_back.column(IDS).typecode, narrow_back.column(LOGPROBS).typecode) == ("i", "f")
    assert back.groups[0][1].column(LOGPROBS).typecode == "f"  # a wide column of float32 values is stored narrow
    assert back.groups == [[wide_sample(1), wide_sample(2)]]
    raw = orjson.loads(line.split(b"\n", 1)[0])["groups"][0][0]["raw"]
    assert raw[:2] == [[IDS, "<i4", [3]], [LOGPROBS, "<f4", [3]]]


def test_the_state_digest_is_the_same_for_either_form() -> None:
    def state(samples: list[Sample]) -> dict:
        return {"version": 1, "buffer": BufferSnapshot.of([samples])}  # (copy_sample keeps each form)

    narrow, wide = narrow_sample(), wide_sample()
    assert state([narrow])["buffer"].groups[0][0].column(IDS).typecode == "i"
    assert state_digest(state([narrow])) == state_digest(state([wide]))
    assert state_digest(state([wide_sample()])) != state_digest(state([Sample(index=1, group_index=0, prompt="p",
                                                                              prompt_token_ids=[5, 6])]))
    nan_narrow, nan_wide = narrow_sample(), wide_sample()
    nan_narrow.hold_columns({LOGPROBS: array("f", [float("nan"), -0.0, 1.5])})
    nan_wide.hold_columns({LOGPROBS: array("d", [float("nan"), -0.0, 1.5])})
    assert state_digest(state([nan_narrow])) == state_digest(state([nan_wide]))
