"""How the driver names a dead trainer rank: torchrun's root-cause block, srun labels, signals."""

from __future__ import annotations

from pathlib import Path

from hpc_rl.launch.trainer_exit import describe_trainer_exit, exit_phrase, root_cause

TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
hpc_rl.training FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_23:13:01
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4238)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4238
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_23:13:01
  host      : localhost
  rank      : {rank} (local_rank: 0)
  exitcode  : {code} (pid: 4239)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4239
======================================================
"""


def test_root_cause_is_the_first_failed_rank_not_the_ranks_torchrun_stopped() -> None:
    failure = root_cause("noise\n" + TORCHRUN_REPORT.format(rank=1, code=-9))
    assert failure is not None and (failure.rank, failure.exitcode, failure.task_label) == (1, -9, None)


def test_signal_and_node_named_from_an_srun_labelled_log(tmp_path: Path) -> None:
    labelled = "".join(f"1: {line}\n" for line in TORCHRUN_REPORT.format(rank=1, code=-9).splitlines())
    log = tmp_path / "trainer.log"
    log.write_text("0: starting\n" + labelled)
    assert describe_trainer_exit(1, log, ["node1", "node2"]) == (
        "trainer rank 1 (on node2) was killed by signal 9 (SIGKILL); the trainer step exited with code 1")


def test_exit_code_of_a_rank(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text(TORCHRUN_REPORT.format(rank=3, code=7))
    assert describe_trainer_exit(1, log).startswith("trainer rank 3 exited with code 7;")


def test_without_a_report_the_step_itself_is_described(tmp_path: Path) -> None:
    text = describe_trainer_exit(-9, tmp_path / "missing.log")
    assert text.startswith("the trainer step was killed by signal 9 (SIGKILL)") and "named no failed rank" in text
    assert exit_phrase(137) == "exited with code 137 (128 + 9: SIGKILL)"


def test_the_killed_rank_is_named_though_its_peers_agent_reports_last(tmp_path: Path) -> None:
    """Two nodes, one agent each: rank 1 SIGKILLed on node2; rank 0 on node1 exits with 1 once the controller
    refuses it, and its agent's report lands last in the shared log (seen on the local Slurm cluster)."""
    killed = "".join(f"1: {line}\n" for line in TORCHRUN_REPORT.format(rank=1, code=-9).splitlines())
    refused = "".join(f"0: {line}\n" for line in TORCHRUN_REPORT.format(rank=0, code=1).splitlines())
    log = tmp_path / "trainer.log"
    log.write_text(killed + refused)
    assert describe_trainer_exit(143, log, ["node1", "node2"]).startswith(
        "trainer rank 1 (on node2) was killed by signal 9 (SIGKILL);")
    log.write_text(refused)  # a rank that only exited with a code is still named
    assert describe_trainer_exit(1, log, ["node1", "node2"]).startswith("trainer rank 0 (on node1) exited with code 1;")


def test_a_header_srun_split_over_two_labelled_lines_and_interleaved_agents(tmp_path: Path) -> None:
    """Seen in CI (Nov 29, tests/slurm/test_faults_slurm.py): srun --label printed node2's header as '1: Root Cause ('
    and '1: first observed failure):', and node1's later block (rank 0, exit 1) was the only one found."""
    def labelled(label: int, text: str) -> list[str]:
        return [f"{label}: {line}" for line in text.splitlines()]

    killed = labelled(1, TORCHRUN_REPORT.format(rank=1, code=-9).replace("Root Cause (first", "Root Cause (\nfirst"))
    peer = labelled(0, TORCHRUN_REPORT.format(rank=0, code=1))
    mixed = [line for pair in zip(killed, peer[:len(killed)]) for line in pair] + peer[len(killed):]
    log = tmp_path / "trainer.log"
    log.write_text("\n".join(mixed) + "\n")
    assert describe_trainer_exit(1, log, ["node1", "node2"]).startswith(
        "trainer rank 1 (on node2) was killed by signal 9 (SIGKILL)")


def test_a_field_srun_split_over_two_labelled_lines(tmp_path: Path) -> None:
    """Seen at load 12 (tests/slurm/test_faults_slurm.py, Nov 29): node2's block had '1:   exitcod' and
    '1: e  : -9 (pid: 12091)  (SIGKILL)', its exit code went unread, and node1's rank 0 (exit 1) was named."""
    killed = "".join(f"1: {line}\n" for line in TORCHRUN_REPORT.format(rank=1, code=-9).replace(
        "  exitcode  : -9", "  exitcod\ne  : -9").replace("  rank      : 1", "  ra\nnk      : 1").splitlines())
    refused = "".join(f"0: {line}\n" for line in TORCHRUN_REPORT.format(rank=0, code=1).splitlines())
    log = tmp_path / "trainer.log"
    log.write_text(killed + refused)
    assert describe_trainer_exit(143, log, ["node1", "node2"]).startswith(
        "trainer rank 1 (on node2) was killed by signal 9 (SIGKILL);")
