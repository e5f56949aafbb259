"""A run whose rewards are all 0 for ZERO_REWARD_ROLLOUTS rollouts in a row warns once, loudly: a log warning
(on stderr too, in a run) and status's warnings (issue 37 case 5: such a run trained on zeros and ended
"run finished" without a word)."""

from __future__ import annotations

import logging
from pathlib import Path

from hpc_rl.data.samples import Sample
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.zero_rewards import ZERO_REWARD_ROLLOUTS, ZeroRewardWatch


class NoScalarsFake:
    """A fake ScalarLog: the recorder's TensorBoard side is not under test here."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def groups_with(*rewards: float | None) -> list[list[Sample]]:
    return [[Sample(group_index=0, index=i, prompt="p", prompt_token_ids=[1], reward=r)
             for i, r in enumerate(rewards)]]


def test_all_zero_rollouts_in_a_row_warn_once_through_the_log_and_status(tmp_path: Path, caplog) -> None:
    recorder = RunRecorder(tmp_path, NoScalarsFake(), num_rollout=100,  # type: ignore[arg-type]
                           print_fn=lambda line: None)
    metrics = {"rollout/reward_mean": 0.0}
    with caplog.at_level(logging.WARNING):
        for rollout_id in range(ZERO_REWARD_ROLLOUTS - 1):
            recorder.rollout(rollout_id, metrics, groups_with(0.0, 0.0))
        assert recorder.warnings == []
        recorder.rollout(ZERO_REWARD_ROLLOUTS - 1, metrics, groups_with(0.0, 0.0))
        for rollout_id in range(ZERO_REWARD_ROLLOUTS, 3 * ZERO_REWARD_ROLLOUTS):
            recorder.rollout(rollout_id, metrics, groups_with(0.0, 0.0))
    assert len(recorder.warnings) == 1
    assert recorder.warnings[0].startswith(f"every reward was 0 in rollouts 0-{ZERO_REWARD_ROLLOUTS - 1}")
    assert "label" in recorder.warnings[0] and "rm_type" in recorder.warnings[0]
    assert [r.getMessage() for r in caplog.records].count(recorder.warnings[0]) == 1


def test_a_rollout_with_any_reward_restarts_the_count_and_sft_is_not_counted() -> None:
    watch = ZeroRewardWatch(after=3)
    for rollout_id, rewards in enumerate([(0.0,), (0.0,), (0.0, 1.0), (0.0,), (0.0,), (-1.0,)]):
        watch.see(rollout_id, {"rollout/reward_mean": 0.0}, groups_with(*rewards))
    assert watch.warning == ""
    sft = ZeroRewardWatch(after=1)
    sft.see(0, {"rollout/samples": 4.0}, groups_with(0.0))  # no reward metric: SFT
    assert sft.warning == ""
