"""HF -> torch_dist (written by 2 TP ranks, or 2 PP stages) -> HF (one process, the CLI) is bit-exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ARCH_FILE = str(ROOT / "configs/models/tiny_qwen3.yaml")


def convert_rank(hf_dir: str, save_dir: str, tp: int, pp: int) -> str:
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.convert import hf_to_torch_dist

    out = hf_to_torch_dist(hf_dir, ARCH_FILE, save_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    shutdown_parallel()
    return str(out)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_hf_torch_dist_hf_round_trip_is_exact(tmp_path: Path, tp: int, pp: int) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf")
    save_dir = tmp_path / "torch_dist"
    written = run_ranks(convert_rank, 2, str(hf_dir), str(save_dir), tp, pp, timeout=600)[0]  # 73 s at load 14
    assert Path(written) == save_dir / "iter_0000000"
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text() == "0"
    out_dir = tmp_path / "hf_back"
    subprocess.run([sys.executable, str(ROOT / "tools/convert_torch_dist_to_hf.py"), "--load", str(save_dir),
                    "--model", ARCH_FILE, "--output", str(out_dir), "--hf-reference", str(hf_dir)],
                   check=True, timeout=600, capture_output=True)
    original = load_file(str(hf_dir / "model.safetensors"))
    back = load_file(str(out_dir / "model.safetensors"))
    assert set(back) == set(original) - {"lm_head.weight"}  # tied: the embedding is the head
    for name, tensor in back.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    for side_file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out_dir / side_file).read_bytes() == (hf_dir / side_file).read_bytes()


def test_slime_command_lines_round_trip(tmp_path: Path) -> None:
    """`convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint X --save Y` and slime's reverse line."""
    from tests.unit.slime_lines import flags_of

    model_args = flags_of("tiny_qwen3_model_args.txt")
    hf_dir = ROOT / "assets" / "tiny_qwen3"
    save_dir, out_dir = tmp_path / "torch_dist", tmp_path / "hf_back"
    forward = subprocess.run([sys.executable, str(ROOT / "tools/convert_hf_to_torch_dist.py"), *model_args,
                              "--hf-checkpoint", str(hf_dir), "--save", str(save_dir)],
                             capture_output=True, text=True, timeout=300)
    assert forward.returncode == 0, forward.stderr
    assert (save_dir / "model.yaml").is_file() and (save_dir / "latest_checkpointed_iteration.txt").is_file()
    reverse = subprocess.run([sys.executable, str(ROOT / "tools/convert_torch_dist_to_hf.py"),
                              "--input-dir", str(save_dir / "iter_0000000"), "--output-dir", str(out_dir),
                              "--origin-hf-dir", str(hf_dir)], capture_output=True, text=True, timeout=300)
    assert reverse.returncode == 0, reverse.stderr
    original, back = load_file(str(hf_dir / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def test_converter_refuses_flags_that_disagree_with_config_json(tmp_path: Path) -> None:
    from tests.unit.slime_lines import flags_of

    result = subprocess.run([sys.executable, str(ROOT / "tools/convert_hf_to_torch_dist.py"),
                             *flags_of("tiny_qwen3_model_args.txt"), "--rotary-base", "10000",
                             "--hf-checkpoint", str(ROOT / "assets" / "tiny_qwen3"), "--save", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "rotary_base" in result.stderr


def test_slime_command_lines_round_trip_a_moe_model_at_ep2(tmp_path: Path) -> None:
    """slime's MoE conversion line (`torchrun --nproc-per-node N convert_hf_to_torch_dist.py ${MODEL_ARGS[@]}
    --expert-model-parallel-size N`, qwen3-30B-A3B.sh's flag set) and the reverse line: every tensor back bit-exact."""
    from hpc_rl.process.child_process import planned_port
    from tests.unit.slime_lines import flags_of

    hf_dir = ROOT / "assets" / "tiny_qwen3_moe"
    save_dir, out_dir = tmp_path / "torch_dist", tmp_path / "hf_back"
    forward = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(planned_port()),
                              str(ROOT / "tools/convert_hf_to_torch_dist.py"),
                              *flags_of("tiny_qwen3_moe_model_args.txt"), "--expert-model-parallel-size", "2",
                              "--hf-checkpoint", str(hf_dir), "--save", str(save_dir)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert forward.returncode == 0, forward.stderr[-3000:]
    reverse = subprocess.run([sys.executable, str(ROOT / "tools/convert_torch_dist_to_hf.py"),
                              "--input-dir", str(save_dir), "--output-dir", str(out_dir),
                              "--origin-hf-dir", str(hf_dir)], capture_output=True, text=True, timeout=300)
    assert reverse.returncode == 0, reverse.stderr[-3000:]
    original, back = load_file(str(hf_dir / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    assert set(back) == set(original)
    assert any(".mlp.experts.3.down_proj." in name for name in back)
    for name, tensor in back.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
