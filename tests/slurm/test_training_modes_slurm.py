"""Issue 21 on the local Slurm cluster: SFT as a trainer-only job (one component, no engine or router step), and
on-policy distillation with its teacher as a component of the het job (its own node), through the real driver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.run_helpers import processes_mentioning, records

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def submit(run_dir: Path, config: str, *flags: str) -> str:
    process = subprocess.run([sys.executable, "-m", "hpc_rl.submit", config, "--executor", "slurm", "--run-dir",
                              str(run_dir), *flags, "--wait"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert "COMPLETED" in process.stdout + process.stderr
    return process.stdout


def steps_of(run_dir: Path) -> list[str]:
    """The job's step names, as Slurm accounts them (one line per step and component)."""
    job_id = (run_dir / "slurm_job_id").read_text().strip()
    out = subprocess.run(["sacct", "-j", job_id, "--noheader", "--parsable2", "--format=JobName"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_sft_is_a_trainer_only_slurm_job(run_dir: Path) -> None:
    submit(run_dir, "configs/tiny_sft_cpu.yaml", "--num-rollout", "4", "--eval-interval", "2")
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3] and all("train/loss" in r["metrics"] for r in rows)
    assert "eval/tiny_copy_chat/exact_match" in rows[-1]["metrics"]
    script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    assert "hetjob" not in script  # one component: the trainer's
    names = steps_of(run_dir)
    assert "trainer" in names and not [n for n in names if n.startswith("engine") or "router" in n]
    assert not list((run_dir / "logs").glob("engine-*.log")) and not (run_dir / "logs" / "router.log").exists()
    assert processes_mentioning(str(run_dir)) == []


def test_opd_teacher_is_a_component_of_the_het_job(run_dir: Path) -> None:
    submit(run_dir, "configs/tiny_opd_cpu.yaml", "--num-rollout", "3", "--eval-interval", "100")
    rows = records(run_dir)
    assert len(rows) == 3 and all(r["metrics"]["train/opd_reverse_kl"] > 0.5 for r in rows)
    script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    assert script.count("hetjob") == 2  # trainer, rollout, teacher
    assert "teacher" in steps_of(run_dir)
    assert "assets/tiny_qwen3_teacher" in (run_dir / "logs" / "teacher.log").read_text() or \
        (run_dir / "logs" / "teacher.log").stat().st_size > 0
    assert processes_mentioning(str(run_dir)) == []
