"""Retained rollouts (issue 35), real processes: a CPU engine started outside the run (as an engine job would
serve) outlives a trainer checkpointing every 2 rollouts whose driver is SIGKILLed right after rollout 3 was
generated and journaled (rollout 2: generated, trained and synced, not checkpointed). The run resubmitted into its
run dir with another TP (2 ranks at TP 2 after 1 at TP 1; the torch_dist checkpoint reshards) resumes after rollout
1, re-attaches to the same engine and pushes it the checkpoint's weights v2 (it serves v3); it trains the retained
rollout 2 (generated with v2) instead of generating it, and generates rollout 3 again (its record was generated with
v3, weights the resume does not have): counted on the engine (SGLang's sglang:num_requests_total) and in the run's
records; nothing is lost or trained twice. The time from the resubmit to the first trained batch is printed
(docs/faults.md quotes it)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from hpc_rl.controller.fault_hooks import KILL_CONTROLLER_AFTER_RETAIN
from hpc_rl.controller.retention import JOURNAL, RolloutJournal
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.protocol.http_client import request_blocking
from tests.integration.run_helpers import processes_of_run, records, start_run, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS, SAMPLES = 5, 128  # tiny_cpu: 16 prompts x 8 samples per rollout
CHECKPOINTED, RETAINED, KILLED_AT = 1, 2, 3
"""The last rollout checkpointed, the one retained and trained after the resume, the one journaled at the kill."""


def requests_total(url: str) -> int:
    status, body = request_blocking("GET", f"{url}/metrics", None, timeout_s=10)
    assert status == 200
    match = re.search(rb"^sglang:num_requests_total\{[^}]*\} (\S+)$", body, re.MULTILINE)
    assert match is not None, body
    return int(float(match.group(1)))


def test_a_resumed_trainer_with_another_tp_trains_the_retained_rollout_instead_of_generating_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with CpuEngineProcess(REPO / "assets" / "tiny_qwen3", log_path=tmp_path / "external.log",
                          max_running_requests=256) as engine:
        engine.wait_healthy(120)
        run_dir = tmp_path / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        flags = ("--rollout-external-engine-addrs", f"127.0.0.1:{engine.port}", "--rollout-num-gpus", "0",
                 "--num-rollout", str(ROLLOUTS), "--save-interval", "2", "--set", "eval.eval_interval=null",
                 "--rollout-session-id", "retained-test")
        monkeypatch.setenv(KILL_CONTROLLER_AFTER_RETAIN, f"{KILLED_AT}:{tmp_path / 'killed'}")
        first = start_run(run_dir, *flags)
        try:
            assert first.wait(600) == -9, (run_dir.parent / "run.out").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
        monkeypatch.delenv(KILL_CONTROLLER_AFTER_RETAIN)
        wait_for(lambda: not processes_of_run(run_dir), 60, "the killed run's processes gone")
        assert engine.process.alive()
        before = records(run_dir)
        assert [r["rollout_id"] for r in before] == list(range(KILLED_AT))
        journaled, _ = RolloutJournal(run_dir / JOURNAL).read()  # checkpointed rollouts were dropped from it
        assert [(r.rollout_id, r.weight_version, r.num_samples) for r in journaled] == [
            (RETAINED, RETAINED, SAMPLES), (KILLED_AT, KILLED_AT, SAMPLES)]
        generated_before = requests_total(engine.url)
        assert generated_before == (KILLED_AT + 1) * SAMPLES

        started = time.monotonic()  # the trainer's job requeued: resubmitted into its run dir, at TP 2
        second = start_run(run_dir, *flags, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")
        try:
            wait_for(lambda: second.poll() is not None or any(
                "rollout/retained_samples_trained" in r["metrics"] for r in records(run_dir)), 600,
                "the retained rollout trained", interval_s=0.05)
            reattach_s = time.monotonic() - started
            assert second.wait(600) == 0, (run_dir.parent / "run.out").read_text()[-3000:]
        finally:
            if second.poll() is None:
                second.kill()
        output = (run_dir.parent / "run.out").read_text()
        assert (f"re-attached to session 'retained-test': 1 retained rollout(s) [{RETAINED}] ({SAMPLES} samples)"
                in output), output[-3000:]
        assert (f"retained rollouts from rollout {KILLED_AT} on are generated again: rollout {KILLED_AT} was "
                f"generated with weights v{KILLED_AT}, newer than the checkpoint's v{RETAINED}") in output
        log = (run_dir / "logs" / "controller.log").read_text()
        assert f"weights v{CHECKPOINTED + 1} pushed (resumed from a checkpoint)" in log
        rows = records(run_dir)
        assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
        every = [i for r in rows for i in r["sample_indices"]]
        assert sorted(every) == list(range(ROLLOUTS * SAMPLES)), "a sample lost or trained twice"
        resumed = rows[RETAINED]
        assert resumed["sample_indices"] == [s.index for g in journaled[0].groups for s in g]
        assert resumed["sample_indices"] == before[RETAINED]["sample_indices"]  # the very batch trained before
        assert resumed["metrics"]["rollout/retained_samples_trained"] == SAMPLES
        assert resumed["metrics"]["rollout/retained_weight_lag"] == 0
        # the engine served the checkpoint's weights (pushed at re-attach) and then each new version
        for row in rows[RETAINED:]:
            assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, row["metrics"]
        generated_after = requests_total(engine.url) - generated_before
        assert generated_after == (ROLLOUTS - RETAINED - 1) * SAMPLES  # rollout 2 was not generated again
        status, info = request_blocking("GET", f"{engine.url}/model_info", None, timeout_s=10)
        assert status == 200 and json.loads(info)["weight_version"] == str(ROLLOUTS)
        assert not (run_dir / JOURNAL).exists()  # the last checkpoint holds everything
        print(f"\nre-attach: resubmit to the retained rollout trained {reattach_s:.1f} s; generations saved "
              f"{SAMPLES} of {(ROLLOUTS - RETAINED) * SAMPLES} the resume trained")
