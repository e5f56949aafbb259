"""Bytes one VL weight sync moves for Qwen3-VL-8B-Instruct and Qwen3-VL-30B-A3B-Instruct (bf16), built on the meta
device from the released configs' numbers (`hpc_rl.models.qwen3_vl.releases`, `hpc_rl.weights.vl_sync_bytes`): `python benchmarks/bench_vl_sync_bytes.py`."""

from hpc_rl.models.qwen3_vl.releases import RELEASES
from hpc_rl.weights.vl_sync_bytes import sync_bytes

if __name__ == "__main__":
    gib = 1 << 30
    for name, hf in RELEASES.items():
        parts = sync_bytes(hf)
        vision = parts["vision_blocks"] + parts["merger"] + parts["deepstack_mergers"]
        print(f"{name}: total {parts['total'] / gib:.3f} GiB ({parts['total'] / 2 / 1e9:.3f} B params); "
              f"language model {parts['language_model'] / gib:.3f} GiB (routed experts "
              f"{parts['routed_experts'] / gib:.3f}); vision tower {parts['vision_blocks'] / gib:.3f} GiB, merger "
              f"{parts['merger'] / gib:.4f}, deepstack mergers {parts['deepstack_mergers'] / gib:.4f}; "
              f"vision share {vision / parts['total']:.1%}; exact bytes {parts}")
