"""The partial buffer's snapshot (rollout/buffer_snapshot.py), its digest (controller/state_digest.py) and its raw
form in the retained-rollouts journal (FORMAT 3): a copy nobody's later generation changes, one digest for the
state in memory, as a checkpoint gives it back and as the journal gives it back, and a resume that restores the
same buffer as before; FORMAT-2 records (orjson digest, JSON buffer) are still attached."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import orjson

from hpc_rl.controller.retention import JOURNAL, RetainedBatch, Retention, RolloutJournal, state_digest
from hpc_rl.data.samples import COLUMN_TYPECODES, Sample, SampleStatus
from hpc_rl.rollout.buffer_snapshot import BufferSnapshot, copy_sample, json_state
from hpc_rl.rollout.partial_buffer import PartialRolloutBuffer
from tests.unit.test_retention import group


def partial(index: int, tokens: int, *, versions: list[int] | None = None) -> Sample:
    """A partial sample as generation leaves it in the buffer: compact columns, metadata, a chat prompt."""
    sample = Sample(index=index, group_index=index // 2, prompt=[{"role": "user", "content": f"q{index}"}],
                    prompt_token_ids=[5, 6, 7], label={"answer": "7"}, metadata={"start_rollout_id": 1, "row": index},
                    status=SampleStatus.ABORTED, rid=f"r{index}")
    sample.extend_response([100 + k for k in range(tokens)], [-0.25 * (k % 7) for k in range(tokens)],
                           versions if versions is not None else [3] * tokens)
    return sample


def buffer_of(groups: int, tokens: int = 6) -> PartialRolloutBuffer:
    buffer = PartialRolloutBuffer()
    buffer.add([[partial(2 * g, tokens), partial(2 * g + 1, tokens // 2, versions=[2] * (tokens // 2 - 1) + [3])]
                for g in range(groups)], rollout_id=1)
    return buffer


def scheduler_state(buffer: PartialRolloutBuffer | BufferSnapshot | dict[str, Any], cursor: int = 4) -> dict[str, Any]:
    """RolloutScheduler.state_dict()/snapshot()'s shape around `buffer`."""
    held = buffer.snapshot() if isinstance(buffer, PartialRolloutBuffer) else buffer
    return {"version": 1, "next_group_index": cursor, "next_sample_index": 2 * cursor, "weight_version": 3,
            "buffer": held, "prompt_source": {"cursor": cursor, "epoch": 0}}


def test_a_snapshot_is_a_copy_that_later_generation_does_not_change() -> None:
    buffer = buffer_of(2)
    expected = buffer.state_dict()
    snapshot = buffer.snapshot()
    live = buffer.groups[0][0]
    live.extend_response([1, 2], [-0.5, -0.5], [4, 4])  # the next rollout resumes it
    live.metadata["start_rollout_id"] = 9
    live.prompt[0]["content"] = "changed"
    live.label["answer"] = "8"
    buffer.groups[0][1].response_logprobs.append(-1.0)  # (read as a list, then changed)
    assert snapshot.state_dict() == expected != buffer.state_dict()
    assert all(set(s.compact_columns()) == set(COLUMN_TYPECODES) for g in snapshot.groups for s in g)
    copied = copy_sample(live)
    assert copied.compact_columns()["response_token_ids"] is not live.compact_columns()["response_token_ids"]
    assert copied.to_dict() == live.to_dict()
    restored = PartialRolloutBuffer()
    restored.load_state_dict(snapshot)
    restored.groups[0][0].extend_response([1], [-0.5], [4])
    assert snapshot.state_dict() == expected  # a buffer restored from it takes copies again
    assert json_state(scheduler_state(snapshot))["buffer"] == expected


def test_one_digest_in_memory_as_json_through_a_checkpoint_and_through_the_journal(tmp_path: Path) -> None:
    buffer = buffer_of(3)
    buffer.groups[1][0].compact_columns()["response_logprobs"][2] = float("-inf")  # (orjson writes it null)
    memory = scheduler_state(buffer)
    as_json = json_state(memory)
    checkpoint = json.loads(json.dumps(as_json, allow_nan=True))  # the protocol's JSON
    journal = RolloutJournal(tmp_path / JOURNAL)
    journal.write(RetainedBatch(rollout_id=0, weight_version=3, session_id="s", state_before="-", state_after=memory,
                                groups=[group(0)]))
    (read,), _ = journal.read()
    assert isinstance(read.state_after["buffer"], BufferSnapshot) and read.state_after == memory
    digests = {state_digest(s) for s in (memory, as_json, checkpoint, read.state_after)}
    assert len(digests) == 1
    assert state_digest(memory | {"weight_version": 7}) in digests  # the engines' version aside
    buffer.groups[2][1].compact_columns()["response_token_ids"][0] += 1  # one buffered token
    assert state_digest(scheduler_state(buffer)) not in digests
    assert state_digest(scheduler_state(buffer_of(3), cursor=5)) not in digests
    # the older kinds, of either form
    assert state_digest(memory, kind="orjson") == state_digest(checkpoint, kind="orjson")
    assert state_digest(memory, legacy=True) == state_digest(checkpoint, legacy=True)


def test_the_buffer_is_written_raw_and_a_resume_restores_it_exactly(tmp_path: Path) -> None:
    """Rollout 2 is journaled with the buffer it left; a resume from the checkpoint of rollout 1 takes rollout 2 and
    restores the buffer the first attempt had, every field and column (the next rollout resumes those samples)."""
    before, after = buffer_of(2, tokens=40), buffer_of(3, tokens=2500)
    retention = Retention(tmp_path, session_id="s", allowed_lag=1, print_fn=lambda line: None)
    state_before, state_after = scheduler_state(before, cursor=4), scheduler_state(after, cursor=6)
    retention._write(2, 3, state_before, [group(0), group(2)], {"rollout/x": 1.0}, state_after)
    line = (tmp_path / JOURNAL / "rollout-00000002.rec").read_bytes().split(b"\n", 1)[0]
    header = orjson.loads(line)
    raw = header["state_after"]["buffer"]["raw_groups"]
    assert header["format"] == 3 and header["digest"] == "raw" and len(raw) == 3
    assert {name: dtype for name, dtype, *_ in raw[0][0]["raw"]} == {
        "response_token_ids": "<i4", "response_logprobs": "<f4", "weight_versions": "<i8"}
    assert len(line) < 3000 * len(raw) * 2  # no per-token JSON
    checkpoint = json.loads(json.dumps({"scheduler": json_state(state_before)}))["scheduler"]
    resumed = Retention(tmp_path, session_id="s", allowed_lag=1, print_fn=lambda line: None)
    resumed.attach(next_rollout_id=2, weight_version=3, scheduler_state=checkpoint)
    taken = resumed.take(2, checkpoint)
    assert taken is not None
    restored = PartialRolloutBuffer()
    restored.load_state_dict(taken.state_after["buffer"])
    assert restored.state_dict() == after.state_dict()
    assert all(set(s.compact_columns()) == set(COLUMN_TYPECODES) for g in restored.groups for s in g)
    assert state_digest(taken.state_after) == state_digest(state_after)


def test_a_format_2_record_still_attaches(tmp_path: Path) -> None:
    """Written before FORMAT 3: its buffer as JSON lists in `state_after` and its `state_before` orjson's digest."""
    buffer = buffer_of(1)
    before = json_state(scheduler_state(buffer, cursor=4))
    old = RetainedBatch(rollout_id=2, weight_version=3, session_id="s", state_before=state_digest(before, kind="orjson"),
                        state_after=json_state(scheduler_state(buffer_of(2), cursor=6)), groups=[group(0)])
    line, buffers = old.encode()
    header = orjson.loads(line)
    header["format"] = 2
    del header["digest"]
    journal = RolloutJournal(tmp_path / JOURNAL)
    journal.path.mkdir(parents=True)
    journal.record_path(2).write_bytes(orjson.dumps(header) + b"\n" + b"".join(bytes(b) for b in buffers))
    retention = Retention(tmp_path, session_id="s", allowed_lag=0, print_fn=lambda line: None)
    retention.attach(next_rollout_id=2, weight_version=3, scheduler_state=json.loads(json.dumps(before)))
    taken = retention.take(2, scheduler_state(buffer, cursor=4))  # the live state: a snapshot, today's digest
    assert taken is not None and taken.state_after == old.state_after


def test_snapshots_and_their_record_cost_less_than_the_json_form() -> None:
    """Measured, printed: 64 buffered 2,500-token samples, the loop's snapshot and the journal's digest and
    encoding, against `state_dict()` and orjson's digest and line (what each rollout did before)."""
    buffer = buffer_of(32, tokens=2500)
    batch = RetainedBatch(rollout_id=0, weight_version=0, session_id="s", state_before="-", state_after={}, groups=[])

    def timed(work: Any) -> float:
        start = time.process_time()
        for _ in range(5):
            work()
        return (time.process_time() - start) / 5 / 64 * 1e6

    def record(state: dict[str, Any]) -> None:
        batch.state_after = state
        batch.encode()

    snapshot, as_json = scheduler_state(buffer), scheduler_state(buffer.state_dict())
    new = (timed(buffer.snapshot), timed(lambda: state_digest(snapshot)), timed(lambda: record(snapshot)))
    old = (timed(buffer.state_dict), timed(lambda: state_digest(as_json, kind="orjson")), timed(lambda: record(as_json)))
    print(f"\nper buffered sample, us CPU: snapshot {new[0]:.0f} (state_dict {old[0]:.0f}), digest {new[1]:.0f} "
          f"(orjson {old[1]:.0f}), record {new[2]:.0f} (JSON {old[2]:.0f})")
    assert sum(new) < sum(old) / 2
    assert np.isfinite(sum(new))


def test_a_real_schedulers_snapshot_outlives_the_next_rollout_and_restores_through_the_journal(tmp_path: Path) -> None:
    """A partial-rollout scheduler (fake engine): the snapshot taken after rollout 0 is still rollout 0's state once
    rollout 1 has resumed its samples; journaled and read back, it restores a scheduler to that state exactly."""
    from tests.unit.test_rollout_scheduler import Harness, run_with

    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        scheduler = h.scheduler()
        await scheduler.run(rollout_id=0)
        expected, snapshot = json.loads(json.dumps(scheduler.state_dict())), scheduler.snapshot()
        assert scheduler.snapshot() is snapshot  # taken once per state: the next rollout's start is the same
        scheduler.set_weight_version(1)  # (a weight sync between them)
        assert scheduler.snapshot()["buffer"] is snapshot["buffer"] and scheduler.snapshot()["weight_version"] == 1
        assert snapshot["buffer"].num_samples >= 8 and any(
            s.response_length for g in snapshot["buffer"].groups for s in g)  # partial tokens in it
        h.slow_rows = set()
        await scheduler.run(rollout_id=1, weight_version=1)  # resumes and extends the buffered samples
        after = scheduler.snapshot()
        assert after["buffer"] is not snapshot["buffer"] and json_state(after) == json.loads(json.dumps(
            scheduler.state_dict()))
        assert json_state(snapshot) == expected != json.loads(json.dumps(scheduler.state_dict()))
        journal = RolloutJournal(tmp_path / JOURNAL)
        journal.write(RetainedBatch(rollout_id=0, weight_version=0, session_id="s", state_before="-",
                                    state_after=snapshot, groups=[]))
        (read,), _ = journal.read()
        restored = h.scheduler()
        before_load = restored.snapshot()
        restored.load_state_dict(read.state_after)
        assert restored.state_dict() == expected and restored.snapshot() is not before_load
        assert state_digest(read.state_after) == state_digest(expected) == state_digest(restored.snapshot())

    run_with(body)


def test_narrowing_is_exact_for_negative_ids_nan_and_negative_zero(tmp_path: Path) -> None:
    """The journal's narrowest exact form (`_column_raw`): a negative id still fits int32 (the OR pass alone would
    refuse it); NaN and -0.0 log-probs come back with the same bits; a NaN whose payload float32 cannot hold keeps
    float64."""
    from hpc_rl.controller.retained_journal import _column_raw
    from array import array

    entry, _ = _column_raw("response_token_ids", array("q", [5, -3, 7]))
    assert entry[1] == "<i4"
    special = array("d", [float("nan"), -0.0, -1.5, float("-inf")])
    entry, _ = _column_raw("response_logprobs", special)
    assert entry[1] == "<f4"
    payload = array("d", special)
    payload.frombytes(np.array([0x7FF8000000000001], dtype=np.uint64).tobytes())  # a NaN with low payload bits
    entry, _ = _column_raw("response_logprobs", payload)
    assert entry[1] == "<f8"
    sample = partial(0, 4)
    sample.hold_columns({"response_logprobs": payload, "response_token_ids": array("q", [5, -3, 7, 2**40]),
                         "weight_versions": array("q", [1, 1, 1, 2])})
    journal = RolloutJournal(tmp_path / JOURNAL)
    journal.write(RetainedBatch(rollout_id=0, weight_version=0, session_id="s", state_before="-", state_after={},
                                groups=[[sample]]))
    (read,), _ = journal.read()
    assert {n: v.tobytes() for n, v in read.groups[0][0].compact_columns().items()} == {
        n: v.tobytes() for n, v in sample.compact_columns().items()}


def test_a_written_record_keeps_no_samples_in_memory(tmp_path: Path) -> None:
    """After its write a record is a stub (id and file): the rollout's samples are the trainer's, not held here
    until a checkpoint; the file still has everything, a checkpoint still drops it, and a stub whose file went is
    not rewritten empty."""
    import asyncio

    retention = Retention(tmp_path, session_id="s", allowed_lag=0, print_fn=lambda line: None)
    groups = [group(0), group(2)]
    for rollout_id in range(3):
        asyncio.run(retention.keep(rollout_id, 0, scheduler_state(buffer_of(1)), groups, {},
                                   scheduler_state(buffer_of(2))))
    assert all(r.file_only and r.groups == [] and r.state_after == {} for r in retention._records)
    records, _ = retention.journal.read()
    assert [r.num_samples for r in records] == [4, 4, 4] and records[0].groups == groups
    retention.journal.record_path(2).unlink()
    asyncio.run(retention.checkpointed(0))
    assert [p.name for p in sorted(retention.journal.path.iterdir())] == ["rollout-00000001.rec"]
    assert retention.summary()["journaled"] == [1, 2]  # (rollout 2's file went; it is said once it is looked for)
    with pytest.raises(ValueError, match="not written"):
        RetainedBatch(rollout_id=9, weight_version=0, session_id="s", state_before="-", state_after={},
                      groups=[]).stub()
    # a resume: the taken record becomes a stub, the next one stays whole until taken
    checkpoint = json_state(scheduler_state(buffer_of(1)))
    again = Retention(tmp_path / "again", session_id="s", allowed_lag=0, print_fn=lambda line: None)
    for rollout_id in (1, 2):
        asyncio.run(again.keep(rollout_id, 0, scheduler_state(buffer_of(rollout_id)), groups, {},
                               scheduler_state(buffer_of(rollout_id + 1))))
    resumed = Retention(tmp_path / "again", session_id="s", allowed_lag=0, print_fn=lambda line: None)
    resumed.attach(next_rollout_id=1, weight_version=0, scheduler_state=checkpoint)
    taken = resumed.take(1, checkpoint)
    assert taken is not None and taken.groups == groups
    assert [(r.rollout_id, r.file_only) for r in resumed._records] == [(1, True), (2, False)]
