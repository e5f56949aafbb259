"""The retained-rollouts journal (controller/retention.py): written whole and read back equal, a crash mid-write
leaves a readable prefix, and a resume keeps only the records that continue its checkpoint (session, rollout ids,
scheduler state, weight versions within the run's staleness)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from hpc_rl.controller.retention import (JOURNAL, MAX_RECORDS, RetainedBatch, Retention, RolloutJournal, allowed_lag,
                                         state_digest)
from hpc_rl.config import load_config
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry, TrainerInfo
from hpc_rl.controller.rollout_stack import assemble_loop
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.column_forms import COLUMN_FORMS, widened
from hpc_rl.data.samples import COLUMN_TYPECODES, Sample, SampleStatus
from hpc_rl.protocol.messages import SaveCommand
from hpc_rl.rollout.scheduler import RolloutResult
from hpc_rl.status import format_status
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.scalars import ScalarLog
from tests.unit.test_run_loop_order import FakeFleet, FakeScheduler, answer_command, describe


def group(first_index: int, n: int = 2, response_len: int = 4, *, as_lists: bool = False,
          float32_logprobs: bool = False) -> list[Sample]:
    """Two scored samples of one prompt; their tokens, log-probs and versions held as generation holds them
    (compact columns, `Sample.extend_response`), or as lists (`as_lists`: a plug-in assigned them).
    `float32_logprobs`: each log-prob a float32 value, as an engine's are (else float64 values no float32 holds)."""
    samples = []
    for i in range(n):
        sample = Sample(index=first_index + i, group_index=first_index // n,
                        prompt=[{"role": "user", "content": "7"}], prompt_token_ids=[1, 2, 3], label="7",
                        metadata={"data_row": first_index, "start_rollout_id": 0},
                        response_text="7", status=SampleStatus.COMPLETED,
                        reward=1.0 if i else 0.0, rid=f"r{first_index + i}")
        tokens = [first_index + k for k in range(response_len)]
        logprobs = [-0.1 * (k + 1) / 3 for k in range(response_len)]  # (not short decimals: exact bits matter)
        if float32_logprobs:
            logprobs = np.asarray(logprobs, dtype=np.float32).tolist()
        if as_lists:
            sample.response_token_ids, sample.response_logprobs = tokens, logprobs
            sample.weight_versions = [2] * response_len
        else:
            sample.extend_response(tokens, logprobs, [2] * response_len)
        samples.append(sample)
    samples[0].remove_sample = True  # type: ignore[attr-defined]
    return samples


def state(cursor: int, buffered: int = 1) -> dict[str, Any]:
    """A scheduler state (RolloutScheduler.state_dict's shape) at data cursor `cursor`."""
    return {"version": 1, "next_group_index": cursor, "next_sample_index": 2 * cursor, "weight_version": 0,
            "buffer": {"version": 1, "groups": [[s.to_dict() for s in group(1000 + 2 * i)] for i in range(buffered)]},
            "prompt_source": {"cursor": cursor, "epoch": 0}}


def batch(rollout_id: int, version: int, *, session: str | None = "s1", response_len: int = 4) -> RetainedBatch:
    return RetainedBatch(rollout_id=rollout_id, weight_version=version, session_id=session,
                         state_before=state_digest(state(rollout_id)), state_after=state(rollout_id + 1),
                         groups=[group(4 * rollout_id, response_len=response_len),
                                 group(4 * rollout_id + 2, response_len=response_len)],
                         metrics={"rollout/reward": 0.5})


def held(samples: list[Sample]) -> list[dict[str, tuple[str, bytes]]]:
    """Each sample's compact columns: typecode and bytes."""
    return [{name: (values.typecode, values.tobytes()) for name, values in s.compact_columns().items()}
            for s in samples]


def held_wide(samples: list[Sample]) -> list[dict[str, tuple[str, bytes]]]:
    """Each sample's compact columns in their wide form (data/column_forms.py): typecode and bytes."""
    return [{name: (widened(values).typecode, widened(values).tobytes())
             for name, values in s.compact_columns().items()} for s in samples]


def read_forms(header: dict) -> list[dict[str, str]]:
    """The typecode each stored column is read back as: its stored form when one of the column's, else wide."""
    forms = {"<i4": "i", "<f4": "f"}
    return [{name: forms[dtype] if forms.get(dtype) in COLUMN_FORMS[name] else COLUMN_TYPECODES[name]
             for name, dtype, *_ in s.get("raw", []) if name in COLUMN_FORMS} for g in header["groups"] for s in g]


def test_a_record_reads_back_equal_with_its_columns_compact(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / JOURNAL)
    written = batch(3, 2)
    written.groups[0][1].routed_experts = None
    written.groups[1][1].routed_experts = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    written.groups[1][1].response_logprobs = [-1.0, -2.0, -3.0, -4.0]  # assigned: a list (tokens stay compact)
    written.groups[0][0].compact_columns()["response_token_ids"][1] = 2**40  # beyond int32: stored as int64
    written.groups[0][1].compact_columns()["weight_versions"][2] = 3  # a sample spanning a weight update
    written.groups[1][0] = group(12, float32_logprobs=True)[0]  # an engine's log-probs (float32 values)
    written.groups[1][0].top_logprob_ids = np.array([[1, 2]] * 4, dtype=np.int32)
    written.groups[1][0].top_logprobs = np.array([[-0.5, -np.inf]] * 4, dtype=np.float32)
    columns_in = held([s for g in written.groups for s in g])
    journal.write(written)
    assert held([s for g in written.groups for s in g]) == columns_in  # writing made no list of a column
    assert set(columns_in[0]) == set(COLUMN_TYPECODES) and set(columns_in[-1]) == {"response_token_ids",
                                                                                 "weight_versions"}
    header = json.loads(journal.record_path(3).read_bytes().split(b"\n", 1)[0])
    stored = [{name: (dtype, rest) for name, dtype, *rest in s.get("raw", [])} for g in header["groups"] for s in g]
    assert stored[0] == {"response_token_ids": ("<i8", [[4]]), "response_logprobs": ("<f8", [[4]]),
                         "weight_versions": ("<i8", [[4], 2])}  # one version throughout: no bytes
    assert stored[1]["weight_versions"] == ("<i4", [[4]]) and stored[1]["response_token_ids"] == ("<i4", [[4]])
    assert stored[2]["response_logprobs"] == ("<f4", [[4]]) and stored[2]["top_logprobs"] == ("<f4", [[4, 2]])
    assert stored[3] == {"response_token_ids": ("<i4", [[4]]), "weight_versions": ("<i8", [[4], 2]),
                         "routed_experts": ("|u1", [[2, 3, 2]])}
    (read,), skipped = journal.read()
    assert skipped == []
    assert (read.rollout_id, read.weight_version, read.session_id, read.state_before, read.state_after,
            read.metrics) == (3, 2, "s1", written.state_before, written.state_after, {"rollout/reward": 0.5})
    # the same columns, compact, bit for bit in the wide form; each in the form stored (narrow where that is exact)
    assert held_wide([s for g in read.groups for s in g]) == held_wide([s for g in written.groups for s in g])
    assert [{name: code for name, (code, _) in h.items()} for h in held([s for g in read.groups for s in g])] == \
        read_forms(header)
    assert read.groups[1][1].__dict__["response_logprobs"] == [-1.0, -2.0, -3.0, -4.0]  # the list, as a list
    assert read.groups == written.groups  # every field
    assert read.groups[0][0].remove_sample and not hasattr(read.groups[0][1], "remove_sample")
    np.testing.assert_array_equal(read.groups[1][0].top_logprobs, written.groups[1][0].top_logprobs)
    np.testing.assert_array_equal(read.groups[1][0].top_logprob_ids, written.groups[1][0].top_logprob_ids)
    assert read.groups[1][1].routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(read.groups[1][1].routed_experts, written.groups[1][1].routed_experts)
    assert read.groups[0][0].routed_experts is None and read.groups[0][0].top_logprobs is None


def test_the_trainer_gets_the_same_bytes_from_a_retained_batch(tmp_path: Path) -> None:
    """pack_samples (what a trainer rank receives) of a rollout and of its record read back: identical arrays."""
    journal = RolloutJournal(tmp_path / JOURNAL)
    written = batch(0, 0, response_len=300)
    written.groups[0][1] = group(1, response_len=300, float32_logprobs=True)[1]
    written.groups[1][0].weight_versions = [1] * 100 + [2] * 200  # a sample spanning versions, as a list
    journal.write(written)
    (read,), _ = journal.read()
    before = pack_samples([s for g in written.groups for s in g], [0.5, -0.5, 1.0, 0.0])
    after = pack_samples([s for g in read.groups for s in g], [0.5, -0.5, 1.0, 0.0])
    assert sorted(before) == sorted(after)
    for name, array in before.items():
        assert (array.dtype, array.shape, array.tobytes()) == (after[name].dtype, after[name].shape,
                                                               after[name].tobytes()), name
    assert len(before["tokens"]) == 4 * (3 + 300)


def test_a_record_of_more_buffers_than_one_writev_takes_reads_back_whole(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / JOURNAL)
    written = batch(0, 0)
    written.groups = [group(2 * i, response_len=3 + i % 5, float32_logprobs=i % 2 == 0) for i in range(400)]
    line, buffers = written.encode()
    assert len(buffers) > 1024  # (IOV_MAX: os.writev is called more than once)
    journal.write(written, (line, buffers))
    (read,), skipped = journal.read()
    assert skipped == [] and held_wide([s for g in read.groups for s in g]) == \
        held_wide([s for g in written.groups for s in g])


def test_a_crash_mid_write_leaves_the_records_before_it_and_a_torn_one_is_ignored(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / JOURNAL)
    journal.write(batch(0, 0))
    journal.write(batch(1, 1))
    line, buffers = batch(2, 2).encode()
    whole = line + b"".join(bytes(b) for b in buffers)
    tmp = journal.record_path(2).with_name(journal.record_path(2).name + ".tmp")
    tmp.write_bytes(whole[: len(whole) // 2])  # the process died inside the third write (before its rename)
    damaged = journal.record_path(5)
    damaged.write_bytes(whole[:-8])  # a record file cut short some other way (a copy): named, skipped
    records, skipped = journal.read()
    assert [r.rollout_id for r in records] == [0, 1]
    assert len(skipped) == 2 and "rollout-00000002.rec.tmp: cut short" in skipped[0]
    assert "rollout-00000005.rec" in skipped[1] and f"it says {len(whole) - len(line)}" in skipped[1]
    journal.write(batch(2, 2))  # the same rollout written again replaces the torn one
    records, skipped = journal.read()
    assert [r.rollout_id for r in records] == [0, 1, 2] and len(skipped) == 1 and not tmp.exists()
    journal.keep_only(records[1:])
    assert sorted(p.name for p in journal.path.iterdir()) == ["rollout-00000001.rec", "rollout-00000002.rec"]


def legacy_line(record: RetainedBatch) -> bytes:
    """A FORMAT-1 journal line (hpc_rl before Nov 29: samples as `Sample.to_dict`, per-token data as JSON lists)."""
    samples = [[s.to_dict() | ({"remove_sample": True} if getattr(s, "remove_sample", False) else {})
                for s in g] for g in record.groups]
    return json.dumps({"format": 1, "rollout_id": record.rollout_id, "weight_version": record.weight_version,
                       "session_id": record.session_id, "state_before": record.state_before,
                       "state_after": record.state_after, "metrics": record.metrics,
                       "groups": samples}).encode() + b"\n"


def test_a_format_1_journal_is_read_trained_and_rewritten_as_records(tmp_path: Path) -> None:
    old = [batch(2, 2), batch(3, 2)]
    for record in old:  # FORMAT 1's digest of the state each started from (the json module's)
        record.state_before = state_digest(state(record.rollout_id), legacy=True)
    assert old[0].state_before != state_digest(state(2))
    expected = [[s.to_dict() for g in b.groups for s in g] for b in old]
    legacy = tmp_path / JOURNAL / "rollouts.jsonl"
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(legacy_line(old[0]) + legacy_line(old[1]) + legacy_line(batch(4, 2))[:50])  # torn last
    said: list[str] = []
    retention = Retention(tmp_path, session_id="s1", allowed_lag=0, print_fn=said.append)
    retention.attach(next_rollout_id=2, weight_version=2, scheduler_state=state(2))
    assert "2 retained rollout(s) [2, 3] (8 samples)" in said[-1]
    assert not legacy.exists()  # rewritten as FORMAT 2 records
    records, skipped = RolloutJournal(tmp_path / JOURNAL).read()
    assert [r.rollout_id for r in records] == [2, 3] and skipped == []
    assert [[s.to_dict() for g in r.groups for s in g] for r in records] == expected
    taken = retention.take(2, state(2))
    assert taken is not None and [s.to_dict() for g in taken.groups for s in g] == expected[0]
    assert taken.groups[0][0].remove_sample
    again = Retention(tmp_path, session_id="s1", allowed_lag=0, print_fn=said.append)  # the resume dies: again
    again.attach(next_rollout_id=2, weight_version=2, scheduler_state=state(2))
    assert "2 retained rollout(s) [2, 3] (8 samples)" in said[-1]  # the rewritten records carry today's digest


def test_the_state_digest_is_the_same_after_a_json_round_trip() -> None:
    """The state in memory and as a checkpoint gives it back (the protocol's JSON: keys as strings, tuples as lists,
    NaN kept) or the journal (orjson: NaN as null) have one digest; another cursor has another."""
    memory = state(3) | {"counters": {1: (2, 3)}, "mean": float("nan"), "weight_version": 5}
    checkpoint = json.loads(json.dumps(memory, allow_nan=True))
    assert checkpoint["counters"] == {"1": [2, 3]}
    journal = orjson.loads(orjson.dumps(checkpoint))
    assert state_digest(memory) == state_digest(checkpoint) == state_digest(journal)
    assert state_digest(memory) == state_digest(memory | {"weight_version": 6})  # the version aside
    assert state_digest(memory) != state_digest(memory | {"next_group_index": 4})


def resumed(tmp_path: Path, records: list[RetainedBatch], *, session: str | None = "s1", lag: int = 0,
            next_rollout_id: int = 2, version: int = 2,
            scheduler: dict[str, Any] | None = None) -> tuple[Retention, list[str]]:
    """A resume at `next_rollout_id` with weights v`version` over a journal of `records`: what it kept, and said."""
    journal = RolloutJournal(tmp_path / JOURNAL)
    for record in records:
        journal.write(record)
    said: list[str] = []
    retention = Retention(tmp_path, session_id=session, allowed_lag=lag, print_fn=said.append)
    retention.attach(next_rollout_id=next_rollout_id, weight_version=version,
                     scheduler_state=scheduler if scheduler is not None else state(next_rollout_id))
    return retention, said


def test_a_resume_trains_the_records_that_continue_its_checkpoint(tmp_path: Path) -> None:
    # rollout 1 was checkpointed (skipped); 2 generated with the checkpoint's weights v2, 3 with v2 as well (async)
    retention, said = resumed(tmp_path, [batch(1, 1), batch(2, 2), batch(3, 2)])
    assert "re-attached to session 's1': 2 retained rollout(s) [2, 3] (8 samples)" in said[-1]
    assert retention.summary() == {"journaled": [2, 3], "to_train": [2, 3], "generations_saved": 0}
    assert retention.take(2, state(2)) is not None
    assert retention.summary() == {"journaled": [2, 3], "to_train": [3], "generations_saved": 4}  # (status.json)
    assert "retained rollouts: 2 journaled [2, 3], 1 to train first; 4 generation(s) saved" in format_status(
        {"source": "test", "retained": retention.summary()})
    assert retention.take(2, state(2)) is None  # once
    third = retention.take(3, state(3))  # from the state rollout 2 left (its partial buffer)
    assert third is not None and third.num_samples == 4 and retention.trained_samples == 8
    assert [r.rollout_id for r in RolloutJournal(tmp_path / JOURNAL).read()[0]] == [2, 3]  # the trained one gone


def test_version_filtering_newer_than_the_checkpoint_or_staler_than_allowed_is_generated_again(tmp_path: Path) -> None:
    retention, said = resumed(tmp_path / "newer", [batch(2, 3)])  # from weights trained after the checkpoint
    assert retention.take(2, state(2)) is None and "newer than the checkpoint's v2" in said[-1]
    retention, said = resumed(tmp_path / "stale", [batch(2, 1)], lag=0)  # sync mode: none behind
    assert retention.take(2, state(2)) is None
    assert "1 versions behind the checkpoint's v2; the run allows 0" in said[-1]
    retention, said = resumed(tmp_path / "async", [batch(2, 1)], lag=allowed_lag(max_staleness=None,
                                                                                async_rollout=True))
    assert retention.take(2, state(2)) is not None
    retention, _ = resumed(tmp_path / "bound", [batch(2, 0)], lag=allowed_lag(max_staleness=2, async_rollout=True))
    assert retention.take(2, state(2)) is not None


def test_a_gap_or_another_data_cursor_ends_what_is_kept(tmp_path: Path) -> None:
    retention, said = resumed(tmp_path / "gap", [batch(2, 2), batch(4, 2)])
    assert retention.take(2, state(2)) is not None and retention.take(4, state(4)) is None
    assert "rollout 3 is not retained" in said[0]
    retention, said = resumed(tmp_path / "cursor", [batch(2, 2)], scheduler=state(7))
    assert retention.take(2, state(7)) is None and "another data cursor" in said[0]


def test_another_session_or_a_fresh_start_drops_the_journal_and_says_so(tmp_path: Path) -> None:
    retention, said = resumed(tmp_path / "other", [batch(2, 2, session="old")], session="new")
    assert retention.take(2, state(2)) is None
    assert "belong to session 'old', this run's rollout_session_id is 'new'" in said[0]
    assert not (tmp_path / "other" / JOURNAL).exists()
    journal = RolloutJournal(tmp_path / "fresh" / JOURNAL)
    journal.write(batch(2, 2))
    said = []
    retention = Retention(tmp_path / "fresh", session_id="s1", allowed_lag=0, print_fn=said.append)
    retention.attach(next_rollout_id=0, weight_version=0, scheduler_state=None)
    assert "starts fresh" in said[0] and not journal.path.exists()


def test_keep_writes_checkpointed_drops_and_the_file_stays_bounded(tmp_path: Path) -> None:
    retention = Retention(tmp_path, session_id=None, allowed_lag=0, print_fn=lambda line: None)

    async def run() -> None:
        for rollout_id in range(MAX_RECORDS + 3):
            b = batch(rollout_id, rollout_id, session=None)
            await retention.keep(rollout_id, rollout_id, state(rollout_id), b.groups, b.metrics, b.state_after)
        assert [r.rollout_id for r in retention.journal.read()[0]] == list(range(3, MAX_RECORDS + 3))
        await retention.checkpointed(MAX_RECORDS)
        assert [r.rollout_id for r in retention.journal.read()[0]] == [MAX_RECORDS + 1, MAX_RECORDS + 2]

    asyncio.run(run())
    off = Retention(tmp_path / "off", session_id=None, allowed_lag=0, enabled=False)
    b = batch(0, 0)
    asyncio.run(off.keep(0, 0, state(0), b.groups, b.metrics, b.state_after))
    assert not (tmp_path / "off" / JOURNAL).exists()


@pytest.mark.parametrize("response_len", [4, 2500])
def test_the_cost_per_sample_is_printed_and_no_column_becomes_a_list(tmp_path: Path, response_len: int) -> None:
    """Measured: journaling a rollout of 256 samples, wall and CPU (all threads) per sample, and the bytes; the
    samples' columns stay compact (the trainer's packing copies them as memory)."""
    retention = Retention(tmp_path, session_id="s", allowed_lag=0, print_fn=lambda line: None)
    groups = [group(2 * i, response_len=response_len, float32_logprobs=True) for i in range(128)]
    start, cpu = time.perf_counter(), time.process_time()
    asyncio.run(retention.keep(0, 0, state(0), groups, {}, state(1)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    size = sum(p.stat().st_size for p in (tmp_path / JOURNAL).iterdir())
    print(f"\n{response_len} response tokens: {seconds / 256 * 1e6:.0f} us wall, {cpu / 256 * 1e6:.0f} us CPU and "
          f"{size / 256:.0f} bytes per sample")
    assert all(set(s.compact_columns()) == set(COLUMN_TYPECODES) for g in groups for s in g)
    # the numbers raw (tokens int32, log-probs float32, one weight version throughout: none) and a JSON line
    assert 256 * response_len * 8 < size < 256 * (response_len * 8 + 1000)


# -- through the real loop (as the controller assembles it), with the fakes of test_run_loop_order.py ----------------

class CursorScheduler(FakeScheduler):
    """A fake scheduler whose state is a data cursor: each generated rollout moves it on."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(events)
        self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "weight_version": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])

    async def run(self, rollout_id: int, weight_version: int) -> RolloutResult:
        self.cursor += 1
        return await super().run(rollout_id, weight_version)


def attempt(run_dir: Path, *, async_rollout: bool, num_rollout: int, fail_at_save: int | None = None,
            resume: dict[str, Any] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """One controller attempt of the loop: its events and the controller states it saved; `fail_at_save`: the
    trainer dies when asked to save that rollout (the job then requeues)."""
    config = load_config(["configs/tiny_cpu.yaml"], ["--set", f"run_dir={run_dir}", "--rollout-session-id", "s"])
    config.rollout.async_rollout, config.rollout.n_samples_per_prompt = async_rollout, 2
    config.checkpoint.save_interval = 1
    events: list[str] = []
    saved: list[dict[str, Any]] = []

    async def trainer_rank(channel: TrainerChannel) -> None:
        while True:
            command = await channel.next_command(0)
            events.append(describe(command))
            if isinstance(command, SaveCommand):
                if command.rollout_id == fail_at_save:
                    raise RuntimeError("trainer died")
                saved.append(json.loads(json.dumps(command.controller_state)))
            await answer_command(channel, command)

    async def main() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        registry.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1, info={"dp_rank": 0, "dp_size": 1}))
        registry.add_engine(EngineInfo(engine_index=0, url="http://e0", state=EngineState.SERVING))
        channel = TrainerChannel(1)
        recorder = RunRecorder(run_dir, ScalarLog(None), num_rollout=num_rollout, print_fn=events.append)
        loop = assemble_loop(config, scheduler=CursorScheduler(events), registry=registry,  # type: ignore[arg-type]
                             channel=channel, fleet=FakeFleet(events), recorder=recorder,  # type: ignore[arg-type]
                             evaluate=None, num_rollout=num_rollout)
        if resume is not None:
            loop.restore(resume)
        trainer = asyncio.create_task(trainer_rank(channel))
        run = asyncio.create_task(loop.run(resumed=resume is not None))
        await asyncio.wait({trainer, run}, return_when=asyncio.FIRST_COMPLETED)
        for task in (trainer, run):
            task.cancel()
        await asyncio.gather(trainer, run, return_exceptions=True)
        if fail_at_save is None:
            run.result()  # the attempt that is not failed runs to its end

    asyncio.run(main())
    return events, saved


@pytest.mark.parametrize("async_rollout", [True, False])
def test_a_requeued_loop_trains_the_retained_rollouts_first(tmp_path: Path, in_repo: Path,
                                                             async_rollout: bool) -> None:
    """The trainer dies at rollout 1's save. Async: rollout 1 (generated with v0 while 0 trained) and rollout 2
    (v1, generated while 1 trained) are journaled; the checkpoint of rollout 0 holds v1, so both are within the
    one version async mode trains anyway: trained, not generated. Sync: rollout 1 (v1) is retained; nothing was
    generated ahead."""
    events, saved = attempt(tmp_path, async_rollout=async_rollout, num_rollout=4, fail_at_save=1)
    assert [e for e in events if e.startswith("generate")] == (["generate 0", "generate 1", "generate 2"]
                                                               if async_rollout else ["generate 0", "generate 1"])
    checkpoint = saved[-1]
    assert (checkpoint["next_rollout_id"], checkpoint["weight_version"]) == (1, 1)
    events, _ = attempt(tmp_path, async_rollout=async_rollout, num_rollout=4, resume=checkpoint)
    retained = [1, 2] if async_rollout else [1]
    assert any(f"re-attached to session 's': {len(retained)} retained rollout(s) {retained}" in e for e in events)
    assert [e for e in events if e.startswith("generate")] == [f"generate {k}" for k in range(1 + len(retained), 4)]
    assert [e for e in events if e.startswith("trainer train")] == [f"trainer train {k}" for k in range(1, 4)]
    assert events.index("trainer broadcast v1") < events.index("trainer train 1")  # the checkpoint's weights first
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    trained = {r["rollout_id"]: r for r in rows}
    assert sorted(trained) == [0, 1, 2, 3]
    assert [trained[k]["metrics"].get("rollout/retained_samples_trained") for k in range(4)] == [
        2.0 if k in retained else None for k in range(4)]
    assert trained[1]["metrics"]["rollout/retained_weight_lag"] == (1.0 if async_rollout else 0.0)
