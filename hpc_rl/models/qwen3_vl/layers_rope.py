"""Qwen3-VL's multimodal rotary positions (M-RoPE): the 3-D position ids of a token stream with images, and the
interleaved rotary frequencies.

Owns: `mrope_positions` (one sample's [3, L] temporal/height/width position ids, as transformers'
`Qwen3VLModel.get_rope_index` computes them for images: text tokens count on in all three rows; an image's
`t*h*w / merge**2` pad tokens take (start + t, start + row, start + column) over its merged grid, and the text after
it resumes at start + max(h, w) / merge), `batch_mrope_positions` (the same over a micro-batch, padded rows or a
packed row, images consumed in token order), and `InterleavedMRoPE` (the rotary module the GPT model calls).

Why not Megatron's `MultimodalRotaryEmbedding` (megatron-core 0.16.1): it lays the frequency channels out in
contiguous sections (the first mrope_section[0] channels temporal, then height, then width: Qwen2-VL's layout).
Qwen3-VL interleaves them: channel j (of head_dim / 2) takes the height position when j % 3 == 1 and
j < 3 * mrope_section[1], the width position when j % 3 == 2 and j < 3 * mrope_section[2], else the temporal one
(transformers' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`). `InterleavedMRoPE` subclasses Megatron's
module (same constructor, same [s, b, 1, head_dim] output that Megatron's attention applies, packed rows included:
a per-token frequency table of the packed length is applied with offsets by `_apply_rotary_pos_emb_thd`) and
overrides only the channel layout. Half-split rotation (rotate_half), not GPT-J pairs, as Qwen's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding


def interleaved_channel_source(mrope_section: Sequence[int]) -> torch.Tensor:
    """[head_dim / 2]: which position row (0 t, 1 h, 2 w) each frequency channel reads."""
    half = sum(mrope_section)
    source = torch.zeros(half, dtype=torch.long)
    for row, offset in ((1, 1), (2, 2)):
        source[offset: 3 * mrope_section[row]: 3] = row
    return source


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """Megatron's multimodal rotary with Qwen3-VL's interleaved channel layout (see the module docstring)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:  # noqa: ANN001
        if self.rotary_interleaved:
            raise ValueError("Qwen3-VL's M-RoPE rotates half-split channels: rotary_interleaved must be False")
        if sum(mrope_section) != self.inv_freq.numel():
            raise ValueError(f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, the rotary has "
                             f"{self.inv_freq.numel()} frequencies (head_dim / 2)")
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions[..., None] * self.inv_freq.float()  # [3, b, s, half]
        source = interleaved_channel_source(mrope_section).to(freqs.device)
        chosen = torch.gather(freqs, 0, source.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]  # [b, s, half]
        emb = torch.cat((chosen, chosen), dim=-1)
        emb = emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, head_dim]
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1:
            raise NotImplementedError("Qwen3-VL with context parallelism: not built (split the per-token table)")
        return emb


def _vision_positions(start: int, grid_thw: Sequence[int], merge: int) -> torch.Tensor:
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(tokens: Sequence[int] | torch.Tensor, image_token_id: int, grids: Sequence[Sequence[int]],
                    merge: int) -> tuple[torch.Tensor, int]:
    """One sample's [3, L] position ids and how many of `grids` (its images' (t, h, w), in order) it used.

    A run of image pad tokens is one image per grid, `t*h*w / merge**2` tokens each (consecutive images are
    consecutive runs: a run longer than the next grid's count continues with the following grid).
    """
    ids = torch.as_tensor(tokens).tolist()
    pieces, position, index, used = [], 0, 0, 0
    while index < len(ids):
        if ids[index] != image_token_id:
            end = index
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            pieces.append(torch.arange(position, position + end - index).expand(3, -1))
            position += end - index
            index = end
            continue
        if used >= len(grids):
            raise ValueError(f"image pad token at position {index} but only {len(grids)} image grid(s) were given")
        grid = grids[used]
        count = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge ** 2
        run = ids[index: index + count]
        if len(run) != count or any(t != image_token_id for t in run):
            raise ValueError(f"image {used} (grid {list(map(int, grid))}) needs {count} consecutive image pad tokens "
                             f"at position {index}; the prompt has fewer")
        pieces.append(_vision_positions(position, grid, merge))
        position += max(int(grid[1]), int(grid[2])) // merge
        index += count
        used += 1
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    return torch.cat(pieces, dim=1).long(), used


def batch_mrope_positions(tokens: torch.Tensor, image_token_id: int, image_grid_thw: torch.Tensor | None, merge: int,
                          *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """[3, b, s] position ids of a micro-batch: rows of [b, s] (bshd) or the samples of a packed [1, T] row between
    `cu_seqlens` (thd; positions restart per sample). Images are taken from `image_grid_thw` [n, 3] in token order;
    all of them must be used."""
    grids = [] if image_grid_thw is None else [list(map(int, g)) for g in image_grid_thw.tolist()]
    if cu_seqlens is None:
        segments = [(row, 0, tokens.shape[1]) for row in range(tokens.shape[0])]
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        segments = [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        if bounds[-1] < tokens.shape[1]:
            segments.append((0, bounds[-1], tokens.shape[1]))
    out = torch.zeros(3, *tokens.shape, dtype=torch.long)
    used = 0
    for row, start, end in segments:
        positions, taken = mrope_positions(tokens[row, start:end], image_token_id, grids[used:], merge)
        out[:, row, start:end] = positions
        used += taken
    if used != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} image(s), the tokens hold image pads for {used}")
    return out.to(tokens.device)
