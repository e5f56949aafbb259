"""The retained-rollouts journal (controller/retention.py): written whole and read back equal, a crash mid-write
leaves a readable prefix, and a resume keeps only the records that continue its checkpoint (session, rollout ids,
scheduler state, weight versions within the run's staleness)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpc_rl.controller.retention import (JOURNAL, MAX_RECORDS, RetainedBatch, Retention, RolloutJournal, allowed_lag,
                                         state_digest)
from hpc_rl.data.samples import Sample, SampleStatus


def group(first_index: int, n: int = 2, response_len: int = 4) -> list[Sample]:
    samples = []
    for i in range(n):
        sample = Sample(index=first_index + i, group_index=first_index // n, prompt=[{"role": "user", "content": "7"}],
                        prompt_token_ids=[1, 2, 3], label="7", metadata={"data_row": first_index, "start_rollout_id": 0},
                        response_token_ids=list(range(response_len)), response_logprobs=[-0.1 * (k + 1) / 3 for k in
                                                                                         range(response_len)],
                        weight_versions=[2] * response_len, response_text="7", status=SampleStatus.COMPLETED,
                        reward=1.0 if i else 0.0, rid=f"r{first_index + i}")
        samples.append(sample)
    samples[0].remove_sample = True  # type: ignore[attr-defined]
    return samples


def state(cursor: int, buffered: int = 1) -> dict[str, Any]:
    """A scheduler state (RolloutScheduler.state_dict's shape) at data cursor `cursor`."""
    return {"version": 1, "next_group_index": cursor, "next_sample_index": 2 * cursor, "weight_version": 0,
            "buffer": {"version": 1, "groups": [[s.to_dict() for s in group(1000 + 2 * i)] for i in range(buffered)]},
            "prompt_source": {"cursor": cursor, "epoch": 0}}


def batch(rollout_id: int, version: int, *, session: str | None = "s1") -> RetainedBatch:
    return RetainedBatch(rollout_id=rollout_id, weight_version=version, session_id=session,
                         state_before=state_digest(state(rollout_id)), state_after=state(rollout_id + 1),
                         groups=[group(4 * rollout_id), group(4 * rollout_id + 2)], metrics={"rollout/reward": 0.5})


def test_a_record_reads_back_equal(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / "j.jsonl")
    written = batch(3, 2)
    written.groups[0][1].routed_experts = None
    written.groups[1][0].top_logprob_ids = np.array([[1, 2]] * 4, dtype=np.int32)
    written.groups[1][0].top_logprobs = np.array([[-0.5, -np.inf]] * 4, dtype=np.float32)
    journal.append(written.to_line())
    (read,), skipped = journal.read()
    assert skipped == []
    assert (read.rollout_id, read.weight_version, read.session_id, read.state_before, read.state_after,
            read.metrics) == (3, 2, "s1", written.state_before, written.state_after, {"rollout/reward": 0.5})
    assert read.groups == written.groups  # every field, log-probs exactly (JSON floats round-trip)
    assert read.groups[0][0].remove_sample and not hasattr(read.groups[0][1], "remove_sample")
    np.testing.assert_array_equal(read.groups[1][0].top_logprobs, written.groups[1][0].top_logprobs)


def test_a_crash_mid_write_leaves_a_readable_prefix_and_the_next_append_cuts_it(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / "j.jsonl")
    journal.append(batch(0, 0).to_line())
    journal.append(batch(1, 1).to_line())
    whole = journal.path.read_bytes()
    torn = batch(2, 2).to_line()
    journal.path.write_bytes(whole + torn[: len(torn) // 2])  # the process died inside the third write
    records, skipped = journal.read()
    assert [r.rollout_id for r in records] == [0, 1]
    assert len(skipped) == 1 and "cut short" in skipped[0]
    journal.append(batch(3, 3).to_line())
    records, skipped = journal.read()
    assert [r.rollout_id for r in records] == [0, 1, 3] and skipped == []


def resumed(tmp_path: Path, records: list[RetainedBatch], *, session: str | None = "s1", lag: int = 0,
            next_rollout_id: int = 2, version: int = 2, scheduler: dict[str, Any] | None = None) -> tuple[Retention, list[str]]:
    journal = RolloutJournal(tmp_path / JOURNAL)
    for record in records:
        journal.append(record.to_line())
    said: list[str] = []
    retention = Retention(tmp_path, session_id=session, allowed_lag=lag, print_fn=said.append)
    retention.attach(next_rollout_id=next_rollout_id, weight_version=version,
                     scheduler_state=scheduler if scheduler is not None else state(next_rollout_id))
    return retention, said


def test_a_resume_trains_the_records_that_continue_its_checkpoint(tmp_path: Path) -> None:
    # rollout 1 was checkpointed (skipped); 2 generated with the checkpoint's weights v2, 3 with v2 as well (async)
    retention, said = resumed(tmp_path, [batch(1, 1), batch(2, 2), batch(3, 2)])
    assert "re-attached to session 's1': 2 retained rollout(s) [2, 3] (8 samples)" in said[-1]
    assert retention.take(2, state(2)) is not None
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
    journal.append(batch(2, 2).to_line())
    said = []
    retention = Retention(tmp_path / "fresh", session_id="s1", allowed_lag=0, print_fn=said.append)
    retention.attach(next_rollout_id=0, weight_version=0, scheduler_state=None)
    assert "starts fresh" in said[0] and not journal.path.exists()


def test_keep_writes_checkpointed_drops_and_the_file_stays_bounded(tmp_path: Path) -> None:
    retention = Retention(tmp_path, session_id=None, allowed_lag=0, print_fn=lambda line: None)

    async def run() -> None:
        for rollout_id in range(MAX_RECORDS + 3):
            b = batch(rollout_id, rollout_id, session=None)
            await retention.keep(rollout_id, rollout_id, b.state_before, b.groups, b.metrics, b.state_after)
        assert [r.rollout_id for r in retention.journal.read()[0]] == list(range(3, MAX_RECORDS + 3))
        await retention.checkpointed(MAX_RECORDS)
        assert [r.rollout_id for r in retention.journal.read()[0]] == [MAX_RECORDS + 1, MAX_RECORDS + 2]

    asyncio.run(run())
    off = Retention(tmp_path / "off", session_id=None, allowed_lag=0, enabled=False)
    b = batch(0, 0)
    asyncio.run(off.keep(0, 0, b.state_before, b.groups, b.metrics, b.state_after))
    assert not (tmp_path / "off" / JOURNAL).exists()


@pytest.mark.parametrize("response_len", [4, 1024])
def test_the_cost_per_sample_is_printed(tmp_path: Path, response_len: int) -> None:
    """Measured (docs/faults.md quotes it): journaling a rollout of 256 samples, per sample, and the bytes."""
    retention = Retention(tmp_path, session_id="s", allowed_lag=0, print_fn=lambda line: None)
    groups = [group(2 * i, response_len=response_len) for i in range(128)]
    start = time.perf_counter()
    asyncio.run(retention.keep(0, 0, "d", groups, {}, state(1)))
    seconds = time.perf_counter() - start
    size = (tmp_path / JOURNAL).stat().st_size
    print(f"\n{response_len} response tokens: {seconds / 256 * 1e6:.0f} us and {size / 256:.0f} bytes per sample")
    assert size > 256 * response_len * 2
