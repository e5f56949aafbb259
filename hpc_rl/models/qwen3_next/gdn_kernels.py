"""The CPU twins of the GPU-only kernels a Gated DeltaNet layer calls, in plain torch.

Owns: `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` (flash-linear-attention's contract:
q/k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H], `initial_state` [N, H, K, V], `cu_seqlens` with B == 1 for
packed samples, returns the output [B, T, H, V] and the final state or None), `l2norm` (fla's: x / sqrt(sum x^2 + eps)
as x * rsqrt(...), eps 1e-6), and `causal_conv1d_fn` (causal-conv1d's contract: x [B, D, T], weight [D, W], `seq_idx`
[B, T] naming each token's sample, or `cu_seqlens`). With `cu_seqlens` (or `seq_idx`) the recurrent state and the
convolution window restart at every sample boundary: each packed sample is computed exactly as if alone.

How: packed samples are laid out as a padded batch [N, L, ...] (`pack_to_batch`) and run as N rows. A padded step
has g = 0, beta = 0 and k = v = 0, so it leaves the state as it was (the final state is the sample's own), and its
output is dropped (`batch_to_pack`). The chunked form solves each chunk's unit-lower-triangular system with
`torch.linalg.solve_triangular` (the WY/UT form of the delta rule, as fla and transformers' torch path), then scans
the chunks; all in float32, the output cast back to the input's dtype.
Does not own where these are installed (`hpc_rl.models.qwen3_next.cpu_twin`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x over its L2 norm along `dim` (fla's l2norm, eps inside the square root)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def sample_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """Lengths of the packed samples whose boundaries `cu_seqlens` [N + 1] gives."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {bounds}")
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def pack_to_batch(x: torch.Tensor, lengths: list[int], dim: int = 1) -> torch.Tensor:
    """[1, T, ...] packed along `dim` -> [N, L, ...] (L the longest sample), right-padded with zeros."""
    pieces = torch.split(x, lengths, dim=dim)
    longest = max(lengths) if lengths else 0
    padded = []
    for piece in pieces:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - piece.shape[dim]]
        padded.append(F.pad(piece, pad))
    return torch.cat(padded, dim=0)


def batch_to_pack(x: torch.Tensor, lengths: list[int], dim: int = 1) -> torch.Tensor:
    """The inverse of `pack_to_batch`: [N, L, ...] -> [1, T, ...], padding dropped."""
    return torch.cat([x[i:i + 1].narrow(dim, 0, length) for i, length in enumerate(lengths)], dim=dim)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           cu_seqlens: torch.Tensor | None) -> None:
    if q.shape != k.shape or q.shape[:3] != v.shape[:3] or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}: expected q, k [B, T, H, K], v [B, T, H, V], "
                         f"g, beta [B, T, H] (repeat grouped q/k heads to v's before the call)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"gated delta rule: cu_seqlens packs samples into one row, but the batch is {q.shape[0]}")


def _varlen(rule):  # noqa: ANN001, ANN202 - decorator over the two rules below
    """Run `rule` (on [B, T, ...] rows) over packed samples: one padded row per sample, state per sample."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
            use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
            **options: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check(q, k, v, g, beta, cu_seqlens)
        dtype = q.dtype
        q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if cu_seqlens is None:
            out, state = rule(q * scale, k, v, g, beta, initial_state, **options)
        else:
            lengths = sample_lengths(cu_seqlens)
            rows = [pack_to_batch(t, lengths) for t in (q * scale, k, v, g, beta)]
            out, state = rule(*rows, initial_state, **options)
            out = batch_to_pack(out, lengths)
        return out.to(dtype), (state if output_final_state else None)

    run.__doc__ = rule.__doc__
    run.__name__ = rule.__name__.lstrip("_")
    return run


def _zero_state(k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    batch, _, heads, k_dim = k.shape
    if initial_state is None:
        return k.new_zeros(batch, heads, k_dim, v.shape[-1])
    if initial_state.shape != (batch, heads, k_dim, v.shape[-1]):
        raise ValueError(f"initial_state {tuple(initial_state.shape)}: expected one state per sample "
                         f"{(batch, heads, k_dim, v.shape[-1])}")
    return initial_state.float().clone()


@_varlen
def _chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            initial_state: torch.Tensor | None, chunk_size: int = 64,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, chunk by chunk: S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,
    o_t = S_t^T q_t (q scaled by `scale`, default K^-0.5). fla's `chunk_gated_delta_rule` contract."""
    batch, length, heads, _ = k.shape
    state = _zero_state(k, v, initial_state)
    pad = (-length) % chunk_size
    # [B, T, H, D] -> [B, H, n, C, D] chunks; g, beta -> [B, H, n, C]
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk_size)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk_size)) for t in (g, beta))
    cumulative = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i: what the state written at j has decayed by at i
    decay = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly-lower(beta_i k_i.k_j decay_ij)) [u | w] = [beta v | beta k exp(G)]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    solved = torch.linalg.solve_triangular(system, torch.cat([v * beta.unsqueeze(-1), k_beta * cumulative.exp()
                                                              .unsqueeze(-1)], dim=-1), upper=False,
                                           unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cumulative.exp().unsqueeze(-1)
    last = cumulative[..., -1:]
    k_to_end = k * (last - cumulative).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)
    out = torch.empty_like(u)
    for n in range(u.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ state
        out[:, :, n] = q_decayed[:, :, n] @ state + intra[:, :, n] @ v_new
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out = out.flatten(2, 3)[:, :, :length].transpose(1, 2)
    return out, state


@_varlen
def _fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, initial_state: torch.Tensor | None,
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one step at a time (the same recurrence as the chunked form; fla's
    `fused_recurrent_gated_delta_rule` contract): the reference the chunked form is checked against, and the
    decode step."""
    state = _zero_state(k, v, initial_state)
    out = torch.empty_like(v)
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        delta = (v[:, t] - (state * k_t.unsqueeze(-1)).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(-2)
    return out, state


chunk_gated_delta_rule = _chunk_gated_delta_rule
fused_recurrent_gated_delta_rule = _fused_recurrent_gated_delta_rule

_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


def seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """causal-conv1d's `seq_idx` [1, T] (each token's sample number, non-decreasing) -> `cu_seqlens` [N + 1]."""
    if seq_idx.shape[0] != 1:
        raise ValueError(f"seq_idx {tuple(seq_idx.shape)}: packed samples are one row, [1, T]")
    counts = torch.unique_consecutive(seq_idx[0], return_counts=True)[1]
    return F.pad(counts.cumsum(0), (1, 0))


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution, x [B, D, T], weight [D, W] -> [B, D, T] (causal-conv1d's contract): output t
    sees inputs t-W+1..t of its own sample only (`seq_idx` or `cu_seqlens` for packed samples, B == 1)."""
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("causal_conv1d_fn CPU twin: carried convolution states are not built "
                                  "(training starts every sample from zeros)")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d_fn: activation {activation!r}, expected None, silu or swish")
    if seq_idx is not None and cu_seqlens is None:
        cu_seqlens = seq_idx_to_cu_seqlens(seq_idx)
    dtype, width = x.dtype, weight.shape[-1]

    def convolve(rows: torch.Tensor) -> torch.Tensor:
        out = F.conv1d(rows.to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=rows.shape[1])
        return _ACTIVATIONS[activation](out[..., :rows.shape[-1]])

    if cu_seqlens is None:
        return convolve(x).to(dtype)
    if x.shape[0] != 1:
        raise ValueError(f"causal_conv1d_fn: packed samples are one row, but the batch is {x.shape[0]}")
    lengths = sample_lengths(cu_seqlens)
    return batch_to_pack(convolve(pack_to_batch(x, lengths, dim=2)), lengths, dim=2).to(dtype)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """One decode step (x [B, D, 1] or [B, D]) of the causal convolution; `conv_state` [B, D, W] holds the last
    inputs and is updated in place (causal-conv1d's `causal_conv1d_update` contract)."""
    step = x if x.dim() == 3 else x.unsqueeze(-1)
    window = torch.cat([conv_state, step.to(conv_state.dtype)], dim=-1)[..., -conv_state.shape[-1]:]
    conv_state.copy_(window)
    out = (window[..., -weight.shape[-1]:].to(weight.dtype) * weight).sum(-1, keepdim=True)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    out = _ACTIVATIONS[activation](out).to(x.dtype)
    return out if x.dim() == 3 else out.squeeze(-1)
