"""Micro-batches as the model consumes them: right-padded `[b, s]` ("bshd") or packed `[1, T]` ("thd").

Owns: turning some samples' token ids into model inputs (tokens, position ids, attention mask,
Megatron `PackedSeqParams`), running the model on them, and reading each sample's response
log-probs / entropies back out of the (vocab-parallel) logits. Which samples form a micro-batch is
`batching`'s business; the loss is `losses`'.

Packed ("thd", the default, as in slime): the samples are concatenated into one row with
`cu_seqlens` marking where each starts; positions restart at 0 per sample and attention never
crosses a boundary (Transformer Engine's THD kernels on GPU; `layer_specs.PackedSequenceAttention`
on CPU). When the packed length must be a multiple of TP (sequence parallel), the tail padding is
one extra dummy sequence, so no real sample ever attends to it. No padding is wasted inside the
row, which is what makes token-budget micro-batches (`max_tokens_per_gpu`) cheap.

Padded ("bshd"): one row per sample, right-padded with token 0 and a causal mask; padding sits
after every real token, so it never changes a real token's output.

`auto` (the default) picks one of the two per micro-batch by its shape: `choose_qkv_format`.

Context parallel (CP > 1, packed only): each sample is padded to a multiple of 2*CP and this CP
rank holds two of its 2*CP chunks (`context_parallel`'s layout); `PackedSeqParams` carries the real
`cu_seqlens` and the global `cu_seqlens_padded`, as TE's THD+CP kernels and Megatron's rotary expect.
The next-token target of each local position is sliced with it (position t scores token t + 1,
which may sit in a chunk another rank holds). Per-position log-probs are then all-gathered over CP
(backward: this rank's slice only), so every CP rank reads the same per-sample log-probs and
computes the same loss, and the losses stay the CP=1 code. Gathering [T] floats is cheap next to
the attention's K/V exchange, and unlike summing partial per-sample sums over CP it keeps
sequence-level terms (GSPO's ratio, per-sample means, metrics) exact without touching `losses`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc_rl.training.context_parallel import ContextParallelSplit, gather_with_local_grad, split_packed
from hpc_rl.training.layer_specs import PackedSequenceAttention
from hpc_rl.training.logprobs import (vocab_parallel_greedy_hits, vocab_parallel_head_logprobs,
                                      vocab_parallel_logprobs)
from hpc_rl.training.model_provider import causal_mask

QKV_FORMATS = ("thd", "bshd")
PADDING_LIMIT = 2.0
"""`auto` on CPU pads (bshd) while the padded tokens are at most this many times the real ones."""


def choose_qkv_format(configured: str, lengths: Sequence[int], *, on_cpu: bool, cp_size: int = 1) -> str:
    """The layout of one micro-batch: `training.qkv_format`, or for `auto` the cheaper one by shape.

    `auto`: packed (thd) under CP (it splits packed rows) and on GPU (Transformer Engine's THD
    kernels cost what the real tokens cost, as in slime). On CPU, a packed row of up to
    `PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS` tokens runs one attention under a block-diagonal
    mask, quadratic in the whole row's length; padded rows (bshd) beat it unless padding would more
    than double the tokens (lengths far apart). Longer packed rows run attention per sequence, which
    beats padding. Measured by benchmarks/bench_train_layout.py (the tiny run's shape: bshd; 16
    samples of 16..256 tokens: thd).
    """
    if configured != "auto":
        return configured
    if cp_size > 1 or not on_cpu:
        return "thd"
    total = sum(lengths)
    if total > PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS:
        return "thd"
    return "bshd" if len(lengths) * max(lengths) <= PADDING_LIMIT * total else "thd"


@dataclass
class MicroBatch:
    """Some samples of a rollout in the layout the model consumes."""

    indices: list[int]
    """Positions of these samples in the rollout's `TrainBatch`."""
    total_lengths: list[int]
    response_lengths: list[int]
    tokens: torch.Tensor
    """[b, s] right-padded, or [1, T] packed."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None
    """Megatron `PackedSeqParams` (thd) or None (bshd)."""
    starts: list[int]
    """Where each sample starts in the packed row (all 0 when padded: one row each); under CP, in
    the global padded packed row."""
    context_parallel: ContextParallelSplit | None = None
    """This CP rank's part of the packed row (None without CP)."""
    targets: torch.Tensor | None = None
    """[1, T_local] next-token id of each local position (CP only)."""
    cp_group: dist.ProcessGroup | None = None
    images: dict[str, torch.Tensor] | None = None
    """A vision-language model's images of these samples, in token order: {"pixel_values": [patches, C*T*P*P],
    "image_grid_thw": [images, 3]} (`TrainBatch.images_of`) and "vision_input_ids" (`tokens` with every response
    token -1: the model's images sit at the prompt's pads only), passed to the model as keyword arguments; None:
    text."""
    mtp_loss_mask: torch.Tensor | None = None
    """Like `tokens`: 1 where the next token is a trained response token (the MTP layers' targets, set by
    the trainer with MTP training; `mtp_model.MTPGPTModel`), else None."""

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """Vocab-parallel logits, [b, s, V_local] or [1, T, V_local] (with `mtp_loss_mask`: the MTP loss
        attached to them)."""
        extra = {} if self.mtp_loss_mask is None else {"loss_mask": self.mtp_loss_mask}
        extra.update(self.images or {})
        return model(self.tokens, self.position_ids, self.attention_mask, packed_seq_params=self.packed_seq_params,
                     **extra)

    def next_token_mask(self, loss_masks: Sequence[torch.Tensor]) -> torch.Tensor:
        """[b, s] (or [1, T_local]): at position t, the loss mask of the response token at t + 1 (0 at prompt
        and padding positions); `loss_masks` per sample of this micro-batch, in order."""
        if self.context_parallel is None:
            mask = torch.zeros(self.tokens.shape, dtype=torch.float32, device=self.tokens.device)
            rows, columns = self._response_positions(self.tokens.device)
            mask[rows, columns] = torch.cat([m.to(mask.device, torch.float32) for m in loss_masks])
            return mask
        split = self.context_parallel
        full = torch.zeros(sum(split.padded_lengths), dtype=torch.float32, device=self.tokens.device)
        for start, length, response, mask in zip(self.starts, self.total_lengths, self.response_lengths, loss_masks):
            first = start + length - response - 1
            full[first: first + response] = mask.to(full.device, torch.float32)
        return full[split.rows].unsqueeze(0)

    def response_logprobs(self, logits: torch.Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup | None = None,
                          with_entropy: bool = False,
                          chunk_size: int = -1) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample log-probs (and entropies) of the response tokens, from `forward`'s logits.

        Shifted position t scores token t + 1, so a sample starting at `o` with length L and r
        response tokens is scored at positions [o + L - r - 1, o + L - 1).
        """
        if self.context_parallel is not None:
            log_probs, entropy = self._gathered_logprobs(logits, vocab_size, tp_group, with_entropy, chunk_size)
            rows, columns = self._response_positions(log_probs.device)
            log_probs = log_probs[rows, columns]
            entropy = None if entropy is None else entropy[rows, columns]
        else:  # the softmax only where a response token is scored: prompt positions are never used
            rows, columns = self._response_positions(logits.device)
            log_probs, entropy = vocab_parallel_logprobs(logits[rows, columns], self.tokens[rows, columns + 1],
                                                         vocab_size=vocab_size, tp_group=tp_group,
                                                         with_entropy=with_entropy, chunk_size=chunk_size)
        per_sample = list(log_probs.split(self.response_lengths))
        per_entropy = None if entropy is None else list(entropy.split(self.response_lengths))
        return per_sample, per_entropy

    def response_head_logprobs(self, logits: torch.Tensor, ids: Sequence[torch.Tensor], *, vocab_size: int,
                               tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Score centering: [response tokens of the micro-batch, k] log-probs of the engine's top-k `ids` (per
        sample [response tokens, k]) at each response token's position, samples in order."""
        if self.context_parallel is not None:
            raise ValueError("algorithm.use_score_centering with context_parallel_size > 1 is not offered: the "
                             "head log-probs are gathered before the CP split; use context_parallel_size 1")
        rows, columns = self._response_positions(logits.device)
        return vocab_parallel_head_logprobs(logits[rows, columns], torch.cat([i.to(logits.device) for i in ids]),
                                            vocab_size=vocab_size, tp_group=tp_group)

    def response_greedy_hits(self, logits: torch.Tensor, *, vocab_size: int,
                             tp_group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Per sample, 1.0 at each response token that is the argmax of its position's logits."""
        if self.context_parallel is not None:
            split, group = self.context_parallel, self.cp_group
            assert self.targets is not None and group is not None
            local = vocab_parallel_greedy_hits(logits, self.targets, vocab_size=vocab_size, tp_group=tp_group)
            hits = gather_with_local_grad(local[0], group).index_select(0, split.order).unsqueeze(0)
            rows, columns = self._response_positions(hits.device)
            hits = hits[rows, columns]
        else:
            rows, columns = self._response_positions(logits.device)
            hits = vocab_parallel_greedy_hits(logits[rows, columns], self.tokens[rows, columns + 1],
                                              vocab_size=vocab_size, tp_group=tp_group)
        return list(hits.split(self.response_lengths))

    def response_positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) of the position that scores each response token (critic values are read there too)."""
        return self._response_positions(device)

    def _response_positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) of every response token's score, sample after sample: one gather for the
        whole micro-batch (a slice per sample costs an autograd node each, forward and backward)."""
        rows: list[int] = []
        columns: list[int] = []
        for sample, (start, length, response) in enumerate(zip(self.starts, self.total_lengths,
                                                               self.response_lengths)):
            first = start + length - response - 1
            rows.extend([0 if self.packed else sample] * response)
            columns.extend(range(first, first + response))
        return (torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(columns, dtype=torch.long, device=device))

    def _gathered_logprobs(self, logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None,
                           with_entropy: bool, chunk_size: int = -1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[1, T_padded] log-probs (entropies) of the whole packed row, in global order, on every CP rank."""
        split, targets, group = self.context_parallel, self.targets, self.cp_group
        assert split is not None and targets is not None and group is not None
        log_probs, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=vocab_size, tp_group=tp_group,
                                                     with_entropy=with_entropy, chunk_size=chunk_size)

        def to_global(values: torch.Tensor) -> torch.Tensor:
            return gather_with_local_grad(values[0], group).index_select(0, split.order).unsqueeze(0)

        return to_global(log_probs), None if entropy is None else to_global(entropy)


def build_microbatch(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], indices: Sequence[int], *,
                     qkv_format: str = "thd", pad_multiple: int = 1,
                     device: torch.device | str = "cpu", cp_group: dist.ProcessGroup | None = None,
                     images: dict[str, torch.Tensor] | None = None) -> MicroBatch:
    """The model inputs for these samples; the (local) sequence dim is a multiple of `pad_multiple` (TP
    with SP). With a CP group of size > 1: this CP rank's part of the packed layout. `images`: the samples'
    images for a vision-language model (`MicroBatch.images`)."""
    micro = _build_microbatch(tokens, response_lengths, indices, qkv_format=qkv_format, pad_multiple=pad_multiple,
                              device=device, cp_group=cp_group)
    if images is not None:
        if micro.context_parallel is not None:
            raise ValueError("images with context_parallel_size > 1: not built (Qwen3-VL's M-RoPE under CP)")
        micro.images = {name: tensor.to(device) for name, tensor in images.items()}
        # only the prompt's image pads are images: a policy may generate the pad token, which the engine embedded
        # as text (decode steps pass no pixels), so the model places images and M-RoPE by these ids
        prompt_only = [list(toks[: len(toks) - r]) + [-1] * r for toks, r in zip(tokens, response_lengths)]
        micro.images["vision_input_ids"] = _build_microbatch(
            prompt_only, response_lengths, indices, qkv_format=qkv_format, pad_multiple=pad_multiple, device=device,
            cp_group=cp_group).tokens
    return micro


def _build_microbatch(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], indices: Sequence[int], *,
                      qkv_format: str, pad_multiple: int, device: torch.device | str,
                      cp_group: dist.ProcessGroup | None) -> MicroBatch:
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"training.qkv_format: {qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")
    lengths = [len(t) for t in tokens]
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        if qkv_format != "thd":
            raise ValueError(f"training.qkv_format: {qkv_format!r} with context_parallel_size > 1; use thd")
        return _build_context_parallel(tokens, response_lengths, indices, pad_multiple, device, cp_group)
    if qkv_format == "bshd":
        width = max(lengths)
        width += (-width) % pad_multiple
        ids = torch.tensor([list(toks) + [0] * (width - len(toks)) for toks in tokens], dtype=torch.long).to(device)
        positions = torch.arange(width, device=device).unsqueeze(0).expand(len(tokens), -1)
        return MicroBatch(indices=list(indices), total_lengths=lengths, response_lengths=list(response_lengths),
                          tokens=ids, position_ids=positions, attention_mask=causal_mask(width, device),
                          packed_seq_params=None, starts=[0] * len(tokens))
    from megatron.core.packed_seq_params import PackedSeqParams

    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    total = starts[-1]
    pad = (-total) % pad_multiple
    bounds = starts + ([total + pad] if pad else [])
    ids = torch.zeros(total + pad, dtype=torch.long)
    ids[:total] = torch.as_tensor([t for toks in tokens for t in toks], dtype=torch.long)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return MicroBatch(indices=list(indices), total_lengths=lengths, response_lengths=list(response_lengths),
                      tokens=ids.unsqueeze(0).to(device), position_ids=positions.unsqueeze(0).to(device),
                      attention_mask=None, packed_seq_params=params, starts=starts[:-1])


def _build_context_parallel(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], indices: Sequence[int],
                            pad_multiple: int, device: torch.device | str, cp_group: dist.ProcessGroup) -> MicroBatch:
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [len(t) for t in tokens]
    split = split_packed(lengths, dist.get_world_size(cp_group), dist.get_rank(cp_group), pad_multiple=pad_multiple,
                         device=device)
    starts = split.starts
    row = torch.zeros(sum(split.padded_lengths) + 1, dtype=torch.long)  # + 1: the last position's "next token"
    positions = torch.zeros(sum(split.padded_lengths), dtype=torch.long)
    for start, toks in zip(starts, tokens):
        row[start: start + len(toks)] = torch.as_tensor(toks, dtype=torch.long)
    for start, padded in zip(starts, split.padded_lengths):
        positions[start: start + padded] = torch.arange(padded)
    row, positions = row.to(device), positions.to(device)
    local = split.rows
    cu_seqlens = torch.tensor(split.cu_seqlens, dtype=torch.int32, device=device)
    cu_seqlens_padded = torch.tensor(split.cu_seqlens_padded, dtype=torch.int32, device=device)
    longest = max(split.padded_lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return MicroBatch(indices=list(indices), total_lengths=lengths, response_lengths=list(response_lengths),
                      tokens=row[local].unsqueeze(0), position_ids=positions[local].unsqueeze(0), attention_mask=None,
                      packed_seq_params=params, starts=starts[: len(lengths)], context_parallel=split,
                      targets=row[local + 1].unsqueeze(0), cp_group=cp_group)
