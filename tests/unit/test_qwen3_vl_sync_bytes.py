"""What one weight sync of the released Qwen3-VL-8B / -30B-A3B moves (bf16), on the meta device: hpc_rl's name map
names exactly transformers' tensors (experts per expert), and the byte counts docs/vision-language.md gives."""

from __future__ import annotations

import pytest

from hpc_rl.models.qwen3_vl.releases import RELEASES
from hpc_rl.weights.vl_sync_bytes import sync_bytes


@pytest.mark.parametrize(("release", "total", "vision"), [
    ("Qwen3-VL-8B-Instruct", 17_534_247_392, 831_782_880 + 80_238_080 + 240_755_712),
    ("Qwen3-VL-30B-A3B-Instruct", 62_141_508_064, 831_782_880 + 61_359_616 + 184_120_320),
])
def test_release_sync_bytes(release: str, total: int, vision: int) -> None:
    parts = sync_bytes(RELEASES[release])
    assert parts["total"] == total
    assert parts["vision_blocks"] + parts["merger"] + parts["deepstack_mergers"] == vision
    assert parts["total"] / 2 == pytest.approx({"Qwen3-VL-8B-Instruct": 8.77e9,
                                                "Qwen3-VL-30B-A3B-Instruct": 31.07e9}[release], rel=1e-3)
