"""The CPU twin of the Gated DeltaNet kernels against transformers' torch path, on tiny shapes.

Times forward (and forward + backward) of `hpc_rl.models.qwen3_next.gdn_kernels.chunk_gated_delta_rule` and
transformers' `torch_chunk_gated_delta_rule` (qwen3_next, unwrapped from its kernel-hub decorator), the recurrent
forms, and the causal convolutions, fp32, one thread, in alternating rounds so machine load hits both alike
(each sample: 10 calls in a row); prints
the median milliseconds per call of each and the twin's max |diff| to transformers. The packed row is the twin on
`--samples` samples of the same total length, packed with cu_seqlens (transformers' torch path has no packing).

    python benchmarks/bench_gdn_kernels.py [--rounds 7] [--length 256] [--heads 4] [--dim 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from hpc_rl.models.qwen3_next import gdn_kernels as twin


def _unwrapped(function: Callable) -> Callable:
    return getattr(function, "__wrapped__", function)


def _timed(call: Callable[[], object], repeat: int = 10) -> float:
    """Milliseconds per call, averaged over `repeat` calls in a row (one call is too short to time alone)."""
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) * 1000 / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length, args.heads)
    q, k, v = (torch.randn(*shape, args.dim, generator=generator, requires_grad=True) for _ in range(3))
    g = (-torch.rand(*shape, generator=generator) * 2).requires_grad_()
    beta = torch.rand(*shape, generator=generator).requires_grad_()
    channels = 3 * args.heads * args.dim  # q, k and v, as a Gated DeltaNet layer convolves them
    x, weight = torch.randn(args.batch, channels, args.length), torch.randn(channels, 4)
    packed = [t.detach()[:1].repeat(1, args.batch, *[1] * (t.dim() - 2)) for t in (q, k, v, g, beta)]
    cu_seqlens = torch.linspace(0, args.batch * args.length, args.samples + 1).long()
    hf_chunk = _unwrapped(hf.torch_chunk_gated_delta_rule)
    hf_recurrent = _unwrapped(hf.torch_recurrent_gated_delta_rule)
    hf_conv = _unwrapped(hf.causal_conv1d_fn)

    def backward(rule: Callable) -> Callable[[], None]:
        return lambda: rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].sum().backward()

    cases = {
        "chunk fwd": (lambda: twin.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True),
                      lambda: hf_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)),
        "chunk fwd+bwd": (backward(twin.chunk_gated_delta_rule), backward(hf_chunk)),
        "recurrent fwd": (
            lambda: twin.fused_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True),
            lambda: hf_recurrent(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)),
        "conv1d fwd": (lambda: twin.causal_conv1d_fn(x, weight, activation="silu"),
                       lambda: hf_conv(x, weight, activation="silu")),
    }
    def packed_case() -> object:
        return twin.chunk_gated_delta_rule(*packed, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)

    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    packed_times: list[float] = []
    with torch.no_grad():
        ours, theirs = cases["chunk fwd"][0]()[0], cases["chunk fwd"][1]()[0]
    for _ in range(args.rounds):
        for name, (ours_call, theirs_call) in cases.items():
            grad = "bwd" in name
            with torch.set_grad_enabled(grad):
                times[name][0].append(_timed(ours_call))
                times[name][1].append(_timed(theirs_call))
        with torch.no_grad():
            packed_times.append(_timed(packed_case))
    print(f"B={args.batch} T={args.length} H={args.heads} K=V={args.dim}, fp32, 1 thread, median of {args.rounds}")
    print(f"{'case':<16}{'twin ms':>10}{'transformers ms':>17}{'ratio':>8}")
    for name, (ours_ms, theirs_ms) in times.items():
        a, b = statistics.median(ours_ms), statistics.median(theirs_ms)
        print(f"{name:<16}{a:>10.2f}{b:>17.2f}{b / a:>8.2f}")
    packed_ms = statistics.median(packed_times)
    print(f"{'chunk packed':<16}{packed_ms:>10.2f}{'-':>17}  ({args.samples} samples in one row)")
    print(f"chunk fwd max |twin - transformers| = {(ours - theirs).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
