"""Which decoder layers each pipeline stage holds: Megatron's even split, or slime's uneven first/last stages.

Owns: the layer count of every stage from `num_layers`, the PP size and Megatron-LM's
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` (TransformerConfig's
num_layers_in_first/last_pipeline_stage: the first and/or last stage take the given counts, the stages
between split the rest evenly), as Megatron-core 0.16.1 computes it (`get_num_layers_to_build`,
`get_transformer_layer_offset`), and the rules Megatron enforces on it, as problems that name the numbers.
MTP layers sit after the decoder on the last stage (Megatron's default placement). Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSplit:
    """Decoder layers per pipeline stage."""

    counts: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first global layer of each stage."""
        out, total = [], 0
        for count in self.counts:
            out.append(total)
            total += count
        return tuple(out)

    def layers(self, stage: int) -> range:
        start = self.offsets[stage]
        return range(start, start + self.counts[stage])


class PipelineSplitError(ValueError):
    """A split Megatron refuses; the message names the numbers."""


def stage_split(num_layers: int, pp_size: int, first: int | None = None, last: int | None = None) -> StageSplit:
    """The layers of each of `pp_size` stages (Megatron's rules; raises PipelineSplitError)."""
    if first is None and last is None:
        if num_layers % pp_size:
            raise PipelineSplitError(
                f"PP {pp_size} does not divide the model's num_layers ({num_layers}): every pipeline stage holds "
                f"num_layers / PP layers, unless --decoder-first-pipeline-num-layers / "
                f"--decoder-last-pipeline-num-layers set the end stages' counts")
        return StageSplit(counts=(num_layers // pp_size,) * pp_size)
    if pp_size == 1:
        raise PipelineSplitError("--decoder-first/last-pipeline-num-layers need pipeline_model_parallel_size > 1")
    for name, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value <= 0:
            raise PipelineSplitError(f"{name} {value} must be larger than 0 (Megatron)")
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp_size - (first is not None) - (last is not None)
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
        raise PipelineSplitError(
            f"the {num_layers} layers do not split over PP {pp_size} with first stage {first}, last stage {last}: "
            f"{rest} layers are left for {middle} other stage(s), which must split them evenly (Megatron)")
    per_middle = rest // middle if middle else 0
    counts = [per_middle] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if 0 in counts:
        raise PipelineSplitError(f"the split {counts} leaves a pipeline stage without layers")
    return StageSplit(counts=tuple(counts))


def training_split(num_layers: int, training: object) -> StageSplit:
    """`stage_split` for a TrainingConfig's PP size and first/last stage counts."""
    return stage_split(num_layers, getattr(training, "pipeline_model_parallel_size"),
                       getattr(training, "decoder_first_pipeline_num_layers", None),
                       getattr(training, "decoder_last_pipeline_num_layers", None))
