"""The progress line a newcomer reads (issue 24): what says training works (the reward averaged over the
last rollouts against the first, the gradient norm, the entropy) instead of ppo_kl and pg_loss, which are
exactly 0 on every step of an on-policy GRPO run that learns; eval says that it samples greedily."""

from __future__ import annotations

from hpc_rl.telemetry.scalars import eval_sampling_note, progress_line


def test_the_line_shows_the_reward_trend_and_no_always_zero_losses() -> None:
    metrics = {"rollout/reward_mean": 0.5, "rollout/response_len_mean": 3.8, "train/ppo_kl": 0.0,
               "train/pg_loss": 0.0, "train/grad_norm": 0.532, "train/entropy_loss": 1.234, "time/rollout": 0.3,
               "eval/tiny_copy/reward_mean": 1.0}
    rewards = [0.1] * 10 + [0.2] * 10 + [0.45] * 9 + [0.5]
    line = progress_line(29, 100, metrics, rewards_so_far=rewards, eval_sampling=eval_sampling_note(0.0, 1))
    assert line == ("rollout 30/100 | reward 0.500 | avg10 0.455 (first 10: 0.100) | resp len 3.8 | grad_norm 0.532 "
                    "| entropy 1.23 | gen 0.30s | eval tiny_copy 1.000 (greedy)")
    assert "ppo_kl" not in line and "pg_loss" not in line
    assert "avg10" not in progress_line(3, 100, metrics, rewards_so_far=rewards[:4])  # too few rollouts yet


def test_eval_sampling_note() -> None:
    assert eval_sampling_note(0.0, 1) == "greedy"
    assert eval_sampling_note(0.6, 4) == "temperature 0.6, 4 samples per prompt"
