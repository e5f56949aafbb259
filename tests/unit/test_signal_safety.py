"""Pieces of stopping safely (issue 24): a trainer command abandoned by a signal is absorbed when the ranks
finish it (the old "TrainerFailed: ... command N, which is not running" traceback), the trainer names NaN/inf
steps and stops past training.max_nonfinite_steps in a row, non-finite weights are never synced, and a
rank in a Slurm step serves the controller after SIGTERM for a bounded time (a real process)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.protocol.messages import CommandDone, StopCommand
from hpc_rl.training.nonfinite import NonFiniteSteps, NonFiniteTraining, check_finite_weights


def test_an_abandoned_command_is_absorbed_and_the_channel_idles_after_it() -> None:
    async def scenario() -> None:
        channel = TrainerChannel(world_size=2)
        run = asyncio.create_task(channel.run(lambda rank, seq: StopCommand(seq=seq, reason="x")))
        await asyncio.sleep(0)
        assert not channel.idle and channel.running == "StopCommand"
        run.cancel()  # a signal: the loop stops waiting, the ranks go on with the command
        await asyncio.gather(run, return_exceptions=True)
        assert not channel.idle
        channel.on_done(CommandDone(rank=0, seq=1, ok=True))  # old: TrainerFailed "... which is not running"
        assert not channel.idle
        assert channel.running == "StopCommand"  # what a stop that could not wait names
        channel.on_done(CommandDone(rank=1, seq=1, ok=True))
        assert channel.idle and channel.failure is None and channel.running == ""

    asyncio.run(scenario())


def test_nonfinite_steps_are_named_and_stop_the_run_past_the_limit(caplog) -> None:
    steps = NonFiniteSteps(max_in_a_row=1)
    steps.check(0, [{"loss": 0.1, "grad_norm": 0.5, "skipped": 0.0}])
    steps.check(1, [{"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0}])
    assert "rollout 1, optimizer step 1 of 1: loss nan, grad_norm nan; the step was skipped (1 in a row" in caplog.text
    steps.check(2, [{"loss": 0.1, "grad_norm": 0.5, "skipped": 0.0}])  # recovered: the count starts again
    steps.check(2, [{"loss": float("inf"), "grad_norm": 0.5, "skipped": 0.0}])  # a step applied is not called skipped
    assert "loss inf; the optimizer applied the step (its gradients were finite) (1 in a row" in caplog.text
    steps.check(2, [{"loss": 0.1, "grad_norm": 0.5, "skipped": 0.0}])
    steps.check(3, [{"loss": 0.2, "grad_norm": float("inf"), "skipped": 1.0}])
    with pytest.raises(NonFiniteTraining, match="rollout 4, optimizer step 1 of 1: grad_norm inf.*2 in a row.*stopping"):
        steps.check(4, [{"loss": 0.2, "grad_norm": float("inf"), "skipped": 1.0}])


def test_nonfinite_weights_are_never_synced() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    check_finite_weights(model, device="cpu", rank=0)
    with torch.no_grad():
        model[1].bias.fill_(float("inf"))
    with pytest.raises(NonFiniteTraining, match=r"not finite \(1.bias on rank 0\): they are not synced"):
        check_finite_weights(model, device="cpu", rank=0)


RANK = """
import sys, time
from hpc_rl.training.term_deferral import defer_sigterm_in_slurm_step
print(defer_sigterm_in_slurm_step(), flush=True)
time.sleep(60)
"""


def test_a_rank_in_a_slurm_step_outlives_sigterm_for_its_grace_only() -> None:
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "PYTHONPATH": os.getcwd()}
    code = RANK.replace("print(defer_sigterm_in_slurm_step(), flush=True)",  # a 1 s grace instead of 25 s
                        "from hpc_rl.training.term_deferral import defer_sigterm\ndefer_sigterm(1.0)\n"
                        "print(True, flush=True)")
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "True"
        signalled = time.monotonic()
        os.kill(rank.pid, signal.SIGTERM)
        assert rank.wait(30) == 143  # gone after its grace, as SIGTERM would have ended it ...
        lived = time.monotonic() - signalled
        assert lived >= 1.0, f"the rank died {lived:.2f} s after SIGTERM: the controller could not save with it"
    finally:
        rank.kill()
    plain = subprocess.Popen([sys.executable, "-c", RANK], env={**os.environ, "SLURM_STEP_ID": ""},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert plain.stdout is not None and plain.stdout.readline().strip() == "False"  # not in a Slurm step
        os.kill(plain.pid, signal.SIGTERM)
        assert plain.wait(10) == -signal.SIGTERM
    finally:
        plain.kill()


def test_sigterms_passed_on_by_torchruns_agent_are_the_same_stop() -> None:
    """scancel: slurmd signals the rank, and torchrun's agent, signalled too, sends the rank its own SIGTERM 13 ms
    later (measured on the local cluster). That one is the same stop, not a second one: the rank must go on
    serving the controller (old: it exited at once, so no checkpoint was ever saved after a scancel)."""
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "PYTHONPATH": os.getcwd()}
    code = RANK.replace("print(defer_sigterm_in_slurm_step(), flush=True)",
                        "from hpc_rl.training.term_deferral import defer_sigterm\ndefer_sigterm(30.0, same_stop_s=1.5)\n"
                        "print(True, flush=True)")
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "True"
        os.kill(rank.pid, signal.SIGTERM)  # slurmd's
        time.sleep(0.02)
        os.kill(rank.pid, signal.SIGTERM)  # the agent's, passed on
        os.kill(rank.pid, signal.SIGTERM)  # srun's
        time.sleep(0.8)
        assert rank.poll() is None, "the rank took a passed-on SIGTERM for a second one and exited"
        time.sleep(2.0)  # past the window even if the rank took the first one up to 1.3 s late (a loaded machine)
        os.kill(rank.pid, signal.SIGTERM)  # a real second one, after the window: at once
        assert rank.wait(10) == 143
    finally:
        rank.kill()


def test_the_checkpoint_writers_manager_outlives_slurms_sigterm(monkeypatch) -> None:
    """Megatron's async checkpoint writer passes results through a Manager process; Slurm's SIGTERM reaches it
    too, and a scancel's save then failed with "Broken pipe" (measured on the local cluster). The Manager the
    rank starts in a Slurm step ignores SIGTERM: the queue still works after one (a real Manager process)."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hpc_rl.training import term_deferral

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(filesystem_async, "_get_write_results_queue", filesystem_async._get_write_results_queue)
    assert term_deferral.keep_checkpoint_writer_through_sigterm()
    queue = filesystem_async._get_write_results_queue()  # as the writer asks for it, from the module's global
    manager = term_deferral._writer_manager
    assert isinstance(manager, SyncManager) and manager._process is not None
    try:
        os.kill(manager._process.pid, signal.SIGTERM)  # old: the default Manager died here
        time.sleep(0.5)
        assert manager._process.is_alive()
        queue.put({"written": 1})
        assert queue.get(timeout=5) == {"written": 1}
        assert filesystem_async._get_write_results_queue() is queue  # one Manager per rank
    finally:
        manager.shutdown()
        term_deferral._writer_manager = None


def test_the_checkpoint_writers_manager_dies_with_a_killed_rank(tmp_path: Path) -> None:
    """With SIGTERM ignored, the writer's Manager must still end when its rank is killed outright (SIGKILL):
    it is armed with PR_SET_PDEATHSIG (old: it and the resource tracker stayed, adopted by PID 1)."""
    import subprocess
    import sys

    pid_file = tmp_path / "manager.pid"
    script = (
        "import os, signal, sys\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async\n"
        "from hpc_rl.training import term_deferral\n"
        "assert term_deferral.keep_checkpoint_writer_through_sigterm()\n"
        "filesystem_async._get_write_results_queue()\n"
        "open(sys.argv[1], 'w').write(str(term_deferral._writer_manager._process.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    with open(tmp_path / "rank.log", "w") as log:  # a file, not a pipe: a surviving Manager would hold a pipe open
        code = subprocess.run([sys.executable, "-c", script, str(pid_file)], stdout=log, stderr=log, timeout=120,
                              cwd=Path(__file__).resolve().parents[2]).returncode
    assert code == -signal.SIGKILL, (tmp_path / "rank.log").read_text()[-2000:]
    manager_pid = int(pid_file.read_text())

    def running() -> bool:
        try:
            return Path(f"/proc/{manager_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = running()
    if alive:
        os.kill(manager_pid, signal.SIGKILL)
    assert not alive, "the Manager outlived its killed rank"
