"""Benchmark: hpc_rl's embedded default vs TRL's GRPOTrainer on the same task, side by side (issue 11).

    pip install -e ".[trl]"                  # TRL pinned so it keeps this torch
    python benchmarks/bench_vs_trl.py [--pairs 3] [--steps 100]

Both learn the tiny task of `configs/tiny_cpu.yaml` with the same model, tokenizer, chat template,
prompts (`data/tiny_copy_train.jsonl`) and reward (`hpc_rl.data.tiny_task.tiny_task_reward`):
16 prompts x 8 samples per step, 4 new tokens, temperature 1, clip 0.2/0.28, no KL, lr 5e-4
constant, grad-norm clip 1.0, AdamW (weight decay 0), per-sample mean loss, one torch thread.
hpc_rl runs as `python -m hpc_rl.submit configs/tiny_cpu.yaml --executor local` (its own config,
eval every 25 rollouts included); TRL runs in a child process of this script. Runs are interleaved
(hpc_rl, TRL, hpc_rl, TRL, ...). For each run, from the moment its process is spawned:
  start-up   until the first step's reward is reported
  per step   median seconds between reported steps
  to +0.3    until the 20-step rolling mean reward is >= the first window's mean + 0.3 (and that step)
  exit       from the last reported step to the process's exit (hpc_rl: final checkpoint and shutdown)
hpc_rl's per-step split (generation, train, weight sync) is read from its rollouts.jsonl, its start-up
split (controller listening, engine 0 registered, every trainer rank registered, first rollout) from
its controller.log.
Prints each run, then per measure the paired median and the ratio hpc_rl / TRL.

Measured (2 cores, 5 interleaved pairs, load 0.7-1.2, Nov 24 2026): time to +0.3 hpc_rl 18.1 s vs TRL
20.8 s, paired median ratio 0.86 (issue 11 started at 2.62); start-up 8.5 vs 9.4 s; per step 0.117
vs 0.136 s (generation 0.049, train 0.057, weight sync 0.008); +0.3 reached at step 80 vs 83.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
WINDOW, GAIN = 20, 0.3
STEP_MARK = "bench_vs_trl step "
"""Prefix of the TRL child's per-step lines (TRL prints its own dicts on stdout too)."""
PROGRESS = re.compile(r"^rollout (\d+)/\d+ \| reward ([-0-9.]+)")


def time_to_gain(rewards: list[float], times: list[float]) -> tuple[float | None, int | None]:
    """(seconds, step) when the WINDOW-step rolling mean first reaches the first window's mean + GAIN."""
    if len(rewards) < WINDOW:
        return None, None
    start = statistics.fmean(rewards[:WINDOW])
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW:end]) >= start + GAIN:
            return times[end - 1], end
    return None, None


def summarize(name: str, rewards: list[float], times: list[float], exited: float) -> dict[str, object]:
    seconds, step = time_to_gain(rewards, times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"name": name, "steps": len(rewards), "startup_s": times[0] if times else None,
            "per_step_s": statistics.median(gaps) if gaps else None, "to_gain_s": seconds, "to_gain_step": step,
            "first_window_reward": statistics.fmean(rewards[:WINDOW]) if len(rewards) >= WINDOW else None,
            "exit_after_last_step_s": exited - times[-1] if times else None}


STARTUP_MARKS = {"controller_up_s": "controller listening on", "engine_up_s": "engine 0 registered",
                 "trainer_up_s": "all components registered", "first_rollout_s": "rollout 0 generated"}
"""hpc_rl's start-up split: seconds after the spawn of `hpc_rl.submit` at which controller.log says these."""


def startup_split(controller_log: Path, spawned_at: float) -> dict[str, float]:
    """When (s after the spawn) the controller listened, engine 0 registered, every trainer rank had
    registered, and the first rollout was generated (the log's wall-clock stamps)."""
    found: dict[str, float] = {}
    for line in controller_log.read_text().splitlines():
        for key, mark in STARTUP_MARKS.items():
            if key not in found and mark in line:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[key] = stamp - spawned_at
    return found


def step_split(rollouts_jsonl: Path) -> dict[str, float]:
    """hpc_rl's per-step medians (s) from its rollouts.jsonl: generation, train, weight sync."""
    rows = [json.loads(line)["metrics"] for line in rollouts_jsonl.read_text().splitlines()]
    return {f"{name}_s": statistics.median(row.get(key, 0.0) for row in rows)
            for name, key in (("gen", "time/rollout"), ("train", "time/train"), ("sync", "time/weight_sync"))}


def run_hpc_rl(steps: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "hpc_rl.submit", str(CONFIG), "--executor", "local",
                "--run-dir", str(Path(tmp) / "run"), "--num-rollout", str(steps)]
        start, spawned_at = time.perf_counter(), time.time()
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        rewards, times = [], []
        for line in process.stdout:
            match = PROGRESS.match(line.strip())
            if match:
                rewards.append(float(match.group(2)))
                times.append(time.perf_counter() - start)
        code = process.wait()
        exited = time.perf_counter() - start
        if code != 0:
            raise RuntimeError(f"hpc_rl run failed with exit code {code}")
        split = {**startup_split(Path(tmp) / "run" / "logs" / "controller.log", spawned_at),
                 **step_split(Path(tmp) / "run" / "rollouts.jsonl")}
    return {**summarize("hpc_rl", rewards, times, exited), **split}


def run_trl(steps: int) -> dict[str, object]:
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, __file__, "--trl-child", "--steps", str(steps)], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    rewards, times = [], []
    for line in process.stdout:
        if line.startswith(STEP_MARK):
            rewards.append(float(json.loads(line[len(STEP_MARK):])["reward"]))
            times.append(time.perf_counter() - start)
    if process.wait() != 0:
        raise RuntimeError("the TRL run failed (see its output above)")
    return summarize("trl", rewards, times, time.perf_counter() - start)


def trl_child(steps: int) -> None:
    """TRL's GRPOTrainer set up like configs/tiny_cpu.yaml; prints one JSON line per step."""
    import torch

    torch.set_num_threads(1)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_rl.config import load_config
    from hpc_rl.data.tiny_task import tiny_task_reward

    config = load_config([CONFIG])
    rollout, algorithm, optimizer = config.rollout, config.algorithm, config.optimizer
    model_dir = str(REPO / config.checkpoint.hf_checkpoint)
    dataset = load_dataset("json", data_files=str(REPO / rollout.prompt_data), split="train")

    def reward(completions: list, label: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [tiny_task_reward(text, lab) for text, lab in zip(texts, label)]

    class PrintReward(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 -- TRL's signature
            if logs and "reward" in logs:
                print(STEP_MARK + json.dumps({"step": state.global_step, "reward": logs["reward"]}), flush=True)

    batch = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            num_generations=rollout.n_samples_per_prompt, max_completion_length=rollout.rollout_max_response_len,
            temperature=rollout.rollout_temperature, top_p=1.0, epsilon=algorithm.eps_clip,
            epsilon_high=algorithm.eps_clip_high, beta=0.0, loss_type="grpo", num_iterations=1,
            learning_rate=optimizer.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=optimizer.clip_grad,
            optim="adamw_torch", weight_decay=optimizer.weight_decay, adam_beta1=0.9, adam_beta2=0.999,
            adam_epsilon=1e-8, use_cpu=True, bf16=False, fp16=False, logging_steps=1, report_to="none",
            save_strategy="no", seed=rollout.rollout_seed, dataloader_num_workers=0, shuffle_dataset=True)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=args,
                              train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir),
                              callbacks=[PrintReward()])
        trainer.train()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(args.steps)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install -e '.[trl]'", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONPATH", str(REPO))
    pairs = []
    print(f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    for index in range(args.pairs):
        pair = (run_hpc_rl(args.steps), run_trl(args.steps))
        for result in pair:
            print(f"pair {index + 1} {result['name']:6s}: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                                                 f"{k}={v}" for k, v in result.items() if k != "name"),
                  flush=True)
        pairs.append(pair)
    print(f"paired medians over {len(pairs)} pair(s) (hpc_rl / TRL):")
    for key in ("to_gain_s", "to_gain_step", "startup_s", "per_step_s", "exit_after_last_step_s"):
        ratios = [float(h[key]) / float(t[key]) for h, t in pairs if h[key] and t[key]]  # type: ignore[arg-type]
        ours = [float(h[key]) for h, _ in pairs if h[key] is not None]  # type: ignore[arg-type]
        theirs = [float(t[key]) for _, t in pairs if t[key] is not None]  # type: ignore[arg-type]
        print(f"  {key:14s} hpc_rl {statistics.median(ours) if ours else float('nan'):8.3f}  "
              f"TRL {statistics.median(theirs) if theirs else float('nan'):8.3f}  "
              f"ratio {statistics.median(ratios) if ratios else float('nan'):6.2f}")
    ours_split = {key: statistics.median(float(h[key]) for h, _ in pairs) for key in ("gen_s", "train_s", "sync_s")}
    print("  hpc_rl per step (median of the runs' medians): " + "  ".join(f"{k[:-2]} {v:.3f} s"
                                                                         for k, v in ours_split.items()))
    ups = {key: statistics.median(float(h[key]) for h, _ in pairs if key in h) for key in STARTUP_MARKS}
    print("  hpc_rl start-up (median s after the spawn): " + "  ".join(f"{k[:-2]} {v:.1f}" for k, v in ups.items()))
    print(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main(sys.argv[1:]))
