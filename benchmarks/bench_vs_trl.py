"""Benchmark: hpc_rl's tiny run (sync, async, colocated) vs TRL's GRPOTrainer on the same work (issue 23).

    pip install -e ".[trl]"                     # TRL 1.16.0, which keeps torch 2.13
    python benchmarks/bench_vs_trl.py --pairs 5 # prints settings, every run, a table and a verdict
    python benchmarks/bench_vs_trl.py --pairs 5 --add-load 2   # the "load ~2" target on a quiet machine
    python benchmarks/bench_vs_trl.py --pairs 5 --bare-trl     # also a bare GRPOTrainer each round (issue 36)

Both sides learn `configs/tiny_cpu.yaml`'s task with the same model, tokenizer, chat template and prompt
tokens (checked), prompts, reward function, and every setting that changes the work done: the table of
effective settings printed first is read back from TRL's trainer and from hpc_rl's resolved config
(a row marked `DIFFERS` says why it cannot be equal). Notably TRL 1.16's GRPOConfig turns gradient
checkpointing on and bf16 on by default: both are off here (hpc_rl does not recompute on CPU, fp32).
hpc_rl runs eval-free (`--eval-interval null`: TRL has none) and both save one checkpoint after the last step.
TRL runs as a competent user runs it (issue 36): its own logging interval, no callback but a reward logger (one
line per step from `on_step_end`), hpc_rl's config read by this script, not by TRL's process; its settings are
read back after training. `--bare-trl` adds a plain `GRPOTrainer(...).train()` (the task's settings, TRL's defaults
for the rest, the same reward logger) to each round, and the report prints TRL's per-step time against it.

A round runs TRL and each hpc_rl mode once, in an order that rotates from round to round; round k's runs
form pair k. For each run, from the moment its process is spawned:
  start-up   until the first step's reward is reported
  per step   median seconds between reported steps
  to +0.3    until the 20-step rolling mean reward is >= the first window's mean + 0.3 (and that step)
  exit       from the last reported step to the process's exit
  cpu        CPU-seconds of the run's processes (every descendant, from /proc) to the first step and to
             +0.3, and per step (first to last step): the load-insensitive view of what each side spends
  load       runnable threads that are not the run's (the machine's load from others), averaged over the
             run, sampled from /proc every 0.2 s; and the 1-minute load average when the run started
Then the paired medians (hpc_rl mode / TRL, pair by pair), one table of learning per wall-second for
every mode against TRL, and each mode's verdict against issue 23's targets: <= 1.0x TRL's time to +0.3
on a quiet machine (others' load < 0.5), <= 1.2x at load ~2 (others' load 1.5-2.5). Between those it
prints the ratio without a verdict.

Measured: see the README's speed paragraph (date, load, and this script's output).
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
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
WINDOW, GAIN = 20, 0.3
QUIET_BELOW, LOAD2_RANGE = 0.5, (1.5, 2.5)
TARGETS = {"quiet": 1.0, "load ~2": 1.2}
STEP_MARK = "bench_vs_trl step "
SETTINGS_MARK = "bench_vs_trl settings "
OWN_MARK = "bench_vs_trl own "
"""Prefixes of the TRL child's lines (TRL prints its own dicts on stdout too)."""
PROGRESS = re.compile(r"^rollout (\d+)/\d+ \| reward ([-0-9.]+)")
MODES = {"sync": ["--set", "rollout.async_rollout=false", "--set", "cluster.colocate=false"],
         "async": ["--train-async", "--set", "cluster.colocate=false"],
         "colocated": ["--colocate", "--set", "rollout.async_rollout=false"]}
"""hpc_rl's modes of the tiny run (the command-line flags that select each)."""
COMMON = ["--eval-interval", "null"]
"""TRL evaluates nothing, so neither does hpc_rl here."""
SAMPLE_S = 0.2


# -- the machine, sampled while a run goes -----------------------------------------------------------------
def _proc_stats() -> dict[int, tuple[int, str, float]]:
    """pid -> (ppid, state, CPU-seconds) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                text = handle.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        stats[int(name)] = (int(fields[1]), fields[0], (int(fields[11]) + int(fields[12])) / tick)
    return stats


def _running_threads(pid: int) -> int:
    """Threads of `pid` in state R (the load average counts threads)."""
    count = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as handle:
                text = handle.read()
        except OSError:
            continue
        count += text[text.rfind(")") + 2] == "R"
    return count


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class RunSampler(threading.Thread):
    """Every SAMPLE_S: the CPU-seconds of `root` and its descendants (an exited one keeps its last value),
    and how many runnable threads are not theirs nor this script's (the load from others)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.stop_event = root, threading.Event()
        self.cpu_by_pid: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []  # (perf_counter, tree CPU-seconds)
        self.others: list[float] = []

    def run(self) -> None:
        me = os.getpid()
        while not self.stop_event.is_set():
            stats = _proc_stats()
            children: dict[int, list[int]] = {}
            for pid, (ppid, _, _) in stats.items():
                children.setdefault(ppid, []).append(pid)
            tree, todo = set(), [self.root]
            while todo:
                pid = todo.pop()
                tree.add(pid)
                todo.extend(children.get(pid, []))
            for pid in tree & stats.keys():
                self.cpu_by_pid[pid] = stats[pid][2]
            self.samples.append((time.perf_counter(), sum(self.cpu_by_pid.values())))
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            ours = sum(_running_threads(pid) for pid in tree | {me} if pid in stats)
            self.others.append(max(0, running - ours))
            self.stop_event.wait(SAMPLE_S)

    def cpu_at(self, when: float) -> float | None:
        """The tree's CPU-seconds at `when` (a perf_counter time), interpolated between samples."""
        before = [s for s in self.samples if s[0] <= when]
        after = [s for s in self.samples if s[0] >= when]
        if not before or not after:
            return None
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)

    def finish(self) -> None:
        self.stop_event.set()
        self.join()


# -- one run -----------------------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    rewards: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter when each step was reported
    spawned: float = 0.0
    exited: float = 0.0
    load_at_start: float = 0.0
    sampler: RunSampler | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def gain_index(self) -> int | None:
        """Index of the step at which the WINDOW-step rolling mean first reaches the first window's + GAIN."""
        if len(self.rewards) < WINDOW:
            return None
        start = statistics.fmean(self.rewards[:WINDOW])
        for end in range(WINDOW, len(self.rewards) + 1):
            if statistics.fmean(self.rewards[end - WINDOW:end]) >= start + GAIN:
                return end - 1
        return None

    def measures(self) -> dict[str, float | None]:
        gain = self.gain_index()
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        cpu_at = self.sampler.cpu_at if self.sampler else (lambda _: None)
        others = self.sampler.others if self.sampler else []
        return {
            "startup_s": self.times[0] - self.spawned if self.times else None,
            "per_step_s": statistics.median(gaps) if gaps else None,
            "to_gain_s": self.times[gain] - self.spawned if gain is not None else None,
            "to_gain_step": gain + 1 if gain is not None else None,
            "exit_s": self.exited - self.times[-1] if self.times else None,
            "cpu_startup_s": cpu_at(self.times[0]) if self.times else None,
            "cpu_to_gain_s": cpu_at(self.times[gain]) if gain is not None else None,
            "cpu_per_step_s": _per_step(cpu_at(self.times[0]) if self.times else None,
                                        cpu_at(self.times[-1]) if self.times else None, len(self.times) - 1),
            "first_window_reward": statistics.fmean(self.rewards[:WINDOW]) if len(self.rewards) >= WINDOW else None,
            "others_load": statistics.fmean(others) if others else None,
            "loadavg_at_start": self.load_at_start,
            **self.extra,
        }


def _per_step(first: float | None, last: float | None, steps: int) -> float | None:
    """CPU-seconds per step between the first and the last reported step (load-insensitive, unlike wall time)."""
    return (last - first) / steps if first is not None and last is not None and steps > 0 else None


def _watch(name: str, argv: list[str], parse: Any, **popen: Any) -> Run:
    """Spawn `argv`, feed each stdout line to `parse(run, line, now)`, sample the process tree until exit."""
    run = Run(name, load_at_start=load_average())
    run.spawned = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, **popen)
    run.sampler = RunSampler(process.pid)
    run.sampler.start()
    assert process.stdout is not None
    for line in process.stdout:
        parse(run, line, time.perf_counter())
    code = process.wait()
    run.exited = time.perf_counter()
    run.sampler.finish()
    if code != 0:
        raise RuntimeError(f"{name} failed with exit code {code}")
    return run


STARTUP_MARKS = {"controller_up_s": "controller listening on", "engine_up_s": "engine 0 registered",
                 "trainer_up_s": "all components registered", "first_rollout_s": "rollout 0 generated"}
"""hpc_rl's start-up split: seconds after the spawn of `hpc_rl.submit` at which controller.log says these."""


def startup_split(controller_log: Path, spawned_at: float) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in controller_log.read_text().splitlines():
        for key, mark in STARTUP_MARKS.items():
            if key not in found and mark in line:
                found[key] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - spawned_at
    return found


def step_split(rollouts_jsonl: Path) -> dict[str, float]:
    """hpc_rl's per-step medians (s) from its rollouts.jsonl: generation, train, weight sync (colocated: the
    memory moves around the train step, the sync among them)."""
    rows = [json.loads(line)["metrics"] for line in rollouts_jsonl.read_text().splitlines()]
    sync_keys = ("time/weight_sync", "time/colocated_before_train", "time/colocated_after_train")  # colocated: the moves
    return {"gen_s": statistics.median(row.get("time/rollout", 0.0) for row in rows),
            "train_s": statistics.median(row.get("time/train", 0.0) for row in rows),
            "sync_s": statistics.median(sum(row.get(key, 0.0) for key in sync_keys) for row in rows)}


def hpc_rl_argv(mode: str, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hpc_rl.submit", str(CONFIG), "--executor", "local", "--run-dir", str(run_dir),
            "--num-rollout", str(steps), *COMMON, *MODES[mode]]


def run_hpc_rl(mode: str, steps: int) -> tuple[Run, Any]:
    """One hpc_rl run in `mode`; also returns its resolved config (what every process of it read)."""
    def parse(run: Run, line: str, now: float) -> None:
        match = PROGRESS.match(line.strip())
        if match:
            run.rewards.append(float(match.group(2)))
            run.times.append(now)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        wall_spawn = time.time()
        run = _watch(f"hpc_rl {mode}", hpc_rl_argv(mode, steps, run_dir), parse, stderr=subprocess.STDOUT)
        run.extra = {**startup_split(run_dir / "logs" / "controller.log", wall_spawn),
                     **step_split(run_dir / "rollouts.jsonl")}
        from hpc_rl.config.loading import load_resolved_config

        resolved = load_resolved_config(run_dir)
    return run, resolved


def trl_task() -> dict[str, Any]:
    """What the TRL child needs of configs/tiny_cpu.yaml (read here, so TRL's start-up does not pay for loading
    hpc_rl's config: a TRL user has none)."""
    from hpc_rl.config import load_config

    config = load_config([CONFIG])
    rollout, algorithm, optimizer = config.rollout, config.algorithm, config.optimizer
    return {"model_dir": str(REPO / config.checkpoint.hf_checkpoint), "prompts": str(REPO / rollout.prompt_data),
            "prompts_per_step": rollout.rollout_batch_size, "samples_per_prompt": rollout.n_samples_per_prompt,
            "max_new_tokens": rollout.rollout_max_response_len, "temperature": rollout.rollout_temperature,
            "top_p": rollout.rollout_top_p, "eps_clip": algorithm.eps_clip, "eps_clip_high": algorithm.eps_clip_high,
            "lr": optimizer.lr, "clip_grad": optimizer.clip_grad, "weight_decay": optimizer.weight_decay,
            "adam_beta1": optimizer.adam_beta1, "adam_beta2": optimizer.adam_beta2, "adam_eps": optimizer.adam_eps,
            "seed": rollout.rollout_seed}


def run_trl(steps: int, *, bare: bool = False) -> tuple[Run, dict[str, Any]]:
    """One TRL run (a child process of this script); also returns the settings it reported. `bare`: a plain
    `GRPOTrainer(...).train()` with only the task's settings and the reward logger (`--bare-trl`)."""
    settings: dict[str, Any] = {}
    own: dict[str, float] = {}

    def parse(run: Run, line: str, now: float) -> None:
        if line.startswith(STEP_MARK):
            run.rewards.append(float(json.loads(line[len(STEP_MARK):])["reward"]))
            run.times.append(now)
        elif line.startswith(SETTINGS_MARK):
            settings.update(json.loads(line[len(SETTINGS_MARK):]))
        elif line.startswith(OWN_MARK):
            own.update(json.loads(line[len(OWN_MARK):]))

    argv = [sys.executable, __file__, "--trl-child", "--steps", str(steps), "--task", json.dumps(trl_task())]
    with tempfile.NamedTemporaryFile("w+", prefix="bench_vs_trl_", suffix=".log") as log:
        try:
            run = _watch("bare TRL" if bare else "TRL", argv + (["--bare"] if bare else []), parse, stderr=log)
        except RuntimeError:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
    run.extra = own
    return run, settings


def trl_child(steps: int, task: dict[str, Any], *, bare: bool) -> None:
    """TRL's GRPOTrainer on `task` (configs/tiny_cpu.yaml's, from `trl_task`), as a competent user runs it: no
    callback but a reward logger (the reward function keeps each step's mean, `on_step_end` prints it, one line),
    TRL's own logging interval, no checkpoint but one after the last step. Not `bare`: also prints its effective
    settings after training (step 1's forwards without grad recorded by a hook that removes itself at the first
    forward with grad) and TRL's own seconds per step (its `step_time`, from its log history)."""
    import torch

    torch.set_num_threads(1)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_rl.data.tiny_task import tiny_task_reward

    dataset = load_dataset("json", data_files=task["prompts"], split="train")
    last_reward: list[float] = []

    def reward(completions: list, label: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [tiny_task_reward(text, lab) for text, lab in zip(texts, label)]
        last_reward[:] = [sum(rewards) / len(rewards)]
        return rewards

    class RewardLogger(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 -- TRL's signature
            print(STEP_MARK + json.dumps({"step": state.global_step, "reward": last_reward[0]}), flush=True)

    batch = task["prompts_per_step"] * task["samples_per_prompt"]
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(  # the task: what changes the work done (the rest: TRL's defaults, unless said)
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch,
            num_generations=task["samples_per_prompt"], max_completion_length=task["max_new_tokens"],
            temperature=task["temperature"], beta=0.0, learning_rate=task["lr"], lr_scheduler_type="constant",
            use_cpu=True, report_to="none", disable_tqdm=True,
            bf16=False,                      # GRPOConfig's default is bf16=True
            gradient_checkpointing=False)    # GRPOConfig's default is True: it would recompute every activation
        if bare:
            args = GRPOConfig(**common, save_strategy="no")
        else:
            args = GRPOConfig(
                **common, gradient_accumulation_steps=1, steps_per_generation=1, top_p=task["top_p"], top_k=0,
                epsilon=task["eps_clip"], epsilon_high=task["eps_clip_high"], loss_type="grpo", scale_rewards="group",
                num_iterations=1, warmup_steps=0, max_grad_norm=task["clip_grad"], optim="adamw_torch",
                weight_decay=task["weight_decay"], adam_beta1=task["adam_beta1"], adam_beta2=task["adam_beta2"],
                adam_epsilon=task["adam_eps"], fp16=False, save_strategy="steps", save_steps=steps,
                seed=task["seed"], dataloader_num_workers=0, shuffle_dataset=True)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(task["model_dir"], dtype=torch.float32),
                              reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(task["model_dir"]),
                              callbacks=[RewardLogger()])
        no_grad_lengths: list[int] = []  # sequence length of each forward without grad (generation) in step 1

        def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if torch.is_grad_enabled():  # step 1's training forward: its forwards without grad are all seen
                hook.remove()
            elif kwargs.get("input_ids") is not None:
                no_grad_lengths.append(int(kwargs["input_ids"].shape[1]))

        if not bare:
            hook = trainer.model.model.register_forward_pre_hook(record, with_kwargs=True)
        trainer.train()
        step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
        print(OWN_MARK + json.dumps({"trl_step_time_s": statistics.median(step_times) if step_times else None}),
              flush=True)
        if not bare:
            print(SETTINGS_MARK + json.dumps(trl_settings(trainer, trainer.optimizer, no_grad_lengths)), flush=True)


def trl_settings(trainer: Any, optimizer: Any, no_grad_lengths: list[int]) -> dict[str, Any]:
    """What the TRL trainer does, read back from it after its first step (not from what this script
    asked for); `no_grad_lengths`: the sequence lengths of step 1's forwards without grad (generation:
    one prefill, then one token per forward when it keeps a KV cache; no old-log-prob pass)."""
    import torch

    args, model = trainer.args, trainer.model
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> torch's optimizer
    group = optimizer.param_groups[0] if optimizer is not None else {}
    prompt = trainer.train_dataset[0]["prompt"]
    prompt_ids = trainer.processing_class.apply_chat_template(
        conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    recompute = getattr(model, "is_activation_checkpointing", None)
    if recompute is None:
        recompute = model.is_gradient_checkpointing
    return {
        "recompute": bool(recompute), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "prompts_per_step": args.generation_batch_size // args.num_generations,
        "samples_per_prompt": args.num_generations, "optimizer_steps_per_rollout": args.steps_per_generation
        * args.num_iterations, "max_new_tokens": args.max_completion_length, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k or None,
        "kv_cache": len(no_grad_lengths) > 1 and no_grad_lengths[1] == 1,
        "old_logprob_pass": any(length > 1 for length in no_grad_lengths[1:]),
        "clip": [trainer.epsilon_low, trainer.epsilon_high], "kl": args.beta,
        "loss": f"{trainer.loss_type} (per-sample token mean, then batch mean)"
        if trainer.loss_type == "grpo" else trainer.loss_type,
        "advantage": f"group mean, /(std+1e-4) ({args.scale_rewards})",
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "lr": group.get("lr"), "betas": list(group.get("betas", [])), "adam_eps": group.get("eps"),
        "weight_decay": group.get("weight_decay"), "lr_schedule": str(args.lr_scheduler_type.value),
        "clip_grad": args.max_grad_norm, "dropout": float(getattr(model.config, "attention_dropout", 0.0)),
        "seed": args.seed, "shuffle": args.shuffle_dataset, "prompt_ids": list(prompt_ids),
        "checkpoint": "once, after the last step" if args.save_strategy == "steps" and args.save_steps == args.max_steps
        else str(args.save_strategy),
    }


# -- settings, side by side --------------------------------------------------------------------------------
def hpc_rl_settings(config: Any) -> dict[str, Any]:
    """The same fields, from a run's resolved config (a RunConfig)."""
    from hpc_rl.data.prompt_tokenizer import load_prompt_tokenizer
    from hpc_rl.data.prompts import make_prompt_encoder
    from hpc_rl.training.step_settings import old_logprobs_need_own_pass

    rollout, training, algorithm, optimizer = config.rollout, config.training, config.algorithm, config.optimizer
    first = json.loads((REPO / rollout.prompt_data).read_text().splitlines()[0])
    encode = make_prompt_encoder(load_prompt_tokenizer(REPO / config.checkpoint.hf_checkpoint),
                                 apply_chat_template=rollout.apply_chat_template)
    has_ref = algorithm.use_kl_loss or algorithm.kl_coef != 0.0
    return {
        "recompute": training.recompute_granularity is not None, "dtype": "float32",  # no --bf16 on CPU
        "threads": training.num_threads, "prompts_per_step": rollout.rollout_batch_size,
        "samples_per_prompt": rollout.n_samples_per_prompt,
        "optimizer_steps_per_rollout": training.num_steps_per_rollout,
        "max_new_tokens": rollout.rollout_max_response_len, "temperature": rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p, "top_k": None if rollout.rollout_top_k in (-1, 0) else rollout.rollout_top_k,
        "kv_cache": True,  # the CPU engine's decode always reads its KV cache (engines/cpu/kv_batch.py)
        "old_logprob_pass": old_logprobs_need_own_pass(training, algorithm, has_ref=has_ref),
        "clip": [algorithm.eps_clip, algorithm.eps_clip_high],
        "kl": algorithm.kl_loss_coef if algorithm.use_kl_loss else 0.0,
        "loss": "grpo (per-sample token mean, then batch mean)" if not training.calculate_per_token_loss
        else "per-token",
        "advantage": "group mean, /(std+1e-6) (group)" if not algorithm.disable_grpo_std_normalization
        else "group mean",
        "optimizer": "AdamW" if optimizer.optimizer == "adam" else optimizer.optimizer,
        "lr": optimizer.lr, "betas": [optimizer.adam_beta1, optimizer.adam_beta2], "adam_eps": optimizer.adam_eps,
        "weight_decay": optimizer.weight_decay, "lr_schedule": optimizer.lr_decay_style,
        "clip_grad": optimizer.clip_grad, "dropout": 0.0, "seed": rollout.rollout_seed,
        "shuffle": rollout.rollout_shuffle, "prompt_ids": encode(first[rollout.input_key], {}),
        "checkpoint": "once, after the last step",
    }


WHY_DIFFERENT = {
    "advantage": "the std epsilon is each project's constant (slime's 1e-6, TRL's 1e-4); with 0/1 rewards a "
                 "non-zero group std is >= 0.35, so the two differ by < 0.03%",
    "seed": "different RNGs anyway (engine sampling vs transformers' generate): both runs are random draws",
    "optimizer": "Megatron's CPU fallback is torch's AdamW (the same class)",
    "threads": "hpc_rl: per process (trainer rank, engine); TRL: its one process",
    "loss": "the same formula",
    "lr_schedule": "the same (constant)",
    "checkpoint": "the same (one, after the last step)",
}
"""Why a row may read differently on the two sides although the work is the same (printed beside it)."""


def print_settings(ours: dict[str, Any], theirs: dict[str, Any], first: dict[str, dict[str, Any]], mode: str) -> None:
    """Both sides' settings side by side, and round 1's seconds per step (TRL's also as it times itself)."""
    print("effective settings (hpc_rl: its resolved config; TRL: read back from its trainer):")
    for key in ours:
        a, b = ours[key], theirs.get(key)
        same = a == b
        if key == "prompt_ids":
            a, b = f"{len(a)} tokens", f"{len(b)} tokens" if b is not None else None
        mark = "same" if same else f"DIFFERS: {WHY_DIFFERENT.get(key, 'not equal: fix the benchmark')}"
        print(f"  {key:28s} hpc_rl {str(a):48s} TRL {str(b):48s} {mark}")
    print("  engine                       hpc_rl CPU engine over HTTP (SGLang's API), 1 torch thread; "
          "TRL transformers' generate in its process")
    trl = first["TRL"]
    print(f"  seconds per step (round 1)   hpc_rl {mode} {_fmt(first[mode].get('per_step_s'))} (between progress lines); "
          f"TRL {_fmt(trl.get('per_step_s'))} (between steps), TRL's own step_time {_fmt(trl.get('trl_step_time_s'))} "
          "(its training_step: generation + loss + backward, without the optimizer step)")


# -- the report --------------------------------------------------------------------------------------------
def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def paired_ratio(rounds: list[dict[str, dict[str, Any]]], mode: str, key: str) -> float | None:
    return _median([r[mode][key] / r["TRL"][key] if r[mode].get(key) and r["TRL"].get(key) else None
                    for r in rounds])


def default_mode() -> str:
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    if config.get("cluster", {}).get("colocate"):
        return "colocated"
    return "async" if config.get("rollout", {}).get("async_rollout") else "sync"


def verdict(ratio: float | None, others: float | None) -> str:
    if ratio is None or others is None:
        return "no verdict: a run did not reach +0.3"
    if others < QUIET_BELOW:
        condition = "quiet"
    elif LOAD2_RANGE[0] <= others <= LOAD2_RANGE[1]:
        condition = "load ~2"
    else:
        return (f"ratio {ratio:.2f} at load {others:.1f} from others: neither quiet (< {QUIET_BELOW}) nor ~2 "
                f"({LOAD2_RANGE[0]}-{LOAD2_RANGE[1]}), so no verdict (on a quiet machine: without --add-load for the first target, --add-load 2 for the second)")
    target = TARGETS[condition]
    return f"{'PASS' if ratio <= target else 'FAIL'}: {ratio:.2f}x TRL's time to +{GAIN} ({condition}: target <= {target}x)"


def report(rounds: list[dict[str, dict[str, Any]]], modes: list[str]) -> None:
    names = ["TRL", *modes]
    print(f"\npaired medians over {len(rounds)} round(s) (hpc_rl mode / TRL, pair by pair):")
    for key in ("to_gain_s", "to_gain_step", "startup_s", "per_step_s", "exit_s", "cpu_startup_s", "cpu_to_gain_s",
                "cpu_per_step_s"):
        cells = "  ".join(f"{m} {_fmt(_median([r[m][key] for r in rounds]))} ({_fmt(paired_ratio(rounds, m, key))}x)"
                          for m in modes)
        print(f"  {key:16s} TRL {_fmt(_median([r['TRL'][key] for r in rounds]))}  {cells}")
    for mode in modes:
        split = {k: _median([r[mode].get(k) for r in rounds]) for k in ("gen_s", "train_s", "sync_s", *STARTUP_MARKS)}
        print(f"  hpc_rl {mode}: per step gen {_fmt(split['gen_s'])} train {_fmt(split['train_s'])} sync "
              f"{_fmt(split['sync_s'])} s; start-up (s after spawn) " +
              " ".join(f"{k[:-2]} {_fmt(split[k])}" for k in STARTUP_MARKS))
    print(f"\nlearning per wall-second (medians over {len(rounds)} round(s); gain = +{GAIN} rolling reward):")
    print(f"  {'side':16s} {'start-up s':>10s} {'s/step':>7s} {'step@+0.3':>9s} {'s to +0.3':>9s} "
          f"{'gain/s':>7s} {'vs TRL':>6s} {'gain/s after start-up':>21s} {'CPU-s to +0.3':>13s}")
    trl_rate = None
    for name in names:
        rows = [r[name] for r in rounds]
        to_gain, startup = _median([r["to_gain_s"] for r in rows]), _median([r["startup_s"] for r in rows])
        rate = GAIN / to_gain if to_gain else None
        trl_rate = rate if name == "TRL" else trl_rate
        after = GAIN / (to_gain - startup) if to_gain and startup is not None else None
        label = name if name == "TRL" else f"hpc_rl {name}"
        print(f"  {label:16s} {_fmt(startup):>10s} {_fmt(_median([r['per_step_s'] for r in rows])):>7s} "
              f"{_fmt(_median([r['to_gain_step'] for r in rows])):>9s} {_fmt(to_gain):>9s} "
              f"{f'{rate:.4f}' if rate else '-':>7s} {_fmt(rate / trl_rate if rate and trl_rate else None):>6s} "
              f"{f'{after:.4f}' if after else '-':>21s} "
              f"{_fmt(_median([r['cpu_to_gain_s'] for r in rows])):>13s}")
    trl_step = _median([r["TRL"]["per_step_s"] for r in rounds])
    print(f"\nTRL at its best: {_fmt(trl_step)} s per step (median between steps; its own step_time "
          f"{_fmt(_median([r['TRL'].get('trl_step_time_s') for r in rounds]))} s)", end="")
    if all("bare TRL" in r for r in rounds):
        ratio = _median([r["TRL"]["per_step_s"] / r["bare TRL"]["per_step_s"]
                         if r["TRL"].get("per_step_s") and r["bare TRL"].get("per_step_s") else None for r in rounds])
        cpu_ratio = _median([r["TRL"]["cpu_per_step_s"] / r["bare TRL"]["cpu_per_step_s"]
                             if r["TRL"].get("cpu_per_step_s") and r["bare TRL"].get("cpu_per_step_s") else None
                             for r in rounds])
        print(f"; a bare GRPOTrainer(...).train(): {_fmt(_median([r['bare TRL']['per_step_s'] for r in rounds]))} s "
              f"per step; paired ratio {_fmt(ratio)} ({'within' if ratio is not None and ratio <= 1.15 else 'NOT within'}"
              f" 15%); CPU-seconds per step {_fmt(_median([r['TRL']['cpu_per_step_s'] for r in rounds]))} vs "
              f"{_fmt(_median([r['bare TRL']['cpu_per_step_s'] for r in rounds]))}, paired ratio {_fmt(cpu_ratio)} "
              "(the load-insensitive view)")
    else:
        print(" (--bare-trl: against a bare GRPOTrainer)")
    others = _median([run["others_load"] for r in rounds for run in r.values()])
    print(f"\nload from others during the runs: median {_fmt(others)} (per run above)")
    default = default_mode()
    print(f"verdicts (issue 23: paired median time to +{GAIN} vs TRL's; {CONFIG.relative_to(REPO)}'s mode is {default}):")
    for mode in modes:
        print(f"  {mode:10s} {verdict(paired_ratio(rounds, mode, 'to_gain_s'), others)}")


def start_load(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` busy processes (one runnable each) for the whole benchmark: a reproducible load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="rounds (each: TRL and every mode once)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", default="sync,async,colocated", help="hpc_rl modes, comma-separated")
    parser.add_argument("--add-load", type=int, default=0, help="busy processes to run meanwhile (load ~N)")
    parser.add_argument("--bare-trl", action="store_true",
                        help="also run a bare GRPOTrainer(...).train() each round (the task's settings, TRL's defaults "
                             "otherwise, a reward logger only) and print TRL's per-step time against it")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(args.steps, json.loads(args.task), bare=args.bare)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install -e '.[trl]'", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    print(f"{datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs, load average {load_average():.2f} at start"
          f"{f', plus {args.add_load} busy processes' if args.add_load else ''}", flush=True)
    load = start_load(args.add_load)
    sides: dict[str, dict[str, Any]] = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        names = ["TRL", *modes, *(["bare TRL"] if args.bare_trl else [])]
        for index in range(args.pairs):
            order = names[index % len(names):] + names[:index % len(names)]
            results: dict[str, dict[str, Any]] = {}
            for name in order:
                run, settings = (run_trl(args.steps, bare=name == "bare TRL") if "TRL" in name
                                 else run_hpc_rl(name, args.steps))
                results[name] = run.measures()
                if index == 0:
                    sides[name] = settings
                print(f"pair {index + 1} {run.name:17s}: " + " ".join(f"{k}={_fmt(v)}" for k, v in results[name].items()),
                      flush=True)
            if index == 0:
                print_settings(hpc_rl_settings(sides[modes[0]]), sides["TRL"], results, modes[0])
            rounds.append(results)
    finally:
        for process in load:
            process.kill()
            process.wait()
    report(rounds, modes)
    print(f"load average at the end: {load_average():.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main(sys.argv[1:]))
