"""The Megatron Qwen3-VL model: Megatron's GPTModel (Qwen3 / Qwen3-MoE layers) with the vision tower, image
embeddings placed at the image pad tokens, Qwen3-VL's interleaved M-RoPE and deepstack.

Owns: `Qwen3VLGPTModel` (a GPTModel subclass: the language model's parameters keep GPTModel's names, so the
shared name map, checkpointing, freezing and weight sync treat them as any Qwen3's; the tower is the submodule
`vision_model`), and `vl_model_class` (what `training.model_provider.build_gpt_model` builds for an
architecture whose `vision_config` is set).

The vision tower: megatron-core 0.16.1 has no Qwen3-VL tower (its `models/vision` holds CLIP/RADIO ViTs and a
LLaVA-style projector, not Qwen3-VL's patch embed with learned-grid interpolation, 2-D rotary, 2x2 patch merger and
deepstack mergers), so it is transformers' `Qwen3VLVisionModel`, built in the trainer's dtype on its device,
replicated on every TP rank (each rank runs it on the same pixels; the gradients reaching it are already complete
on every TP rank, as Megatron's column-parallel input all-reduce / sequence-parallel all-gather give the first
layer's input full gradients, so it needs no TP reduction; it has no `tensor_model_parallel` attribute, so grad-norm
clipping counts it once). Freeze it with slime's `--freeze-params-name-list vision_model` (Megatron names).

Inputs (`forward`): `input_ids` [b, s] (right-padded rows) or [1, T] (packed, with `packed_seq_params`) holding
`image_token_id` pads, one run of t*h*w/merge**2 pads per image; `pixel_values` [sum of patches, C*T*P*P] and
`image_grid_thw` [n_images, 3] of the micro-batch's images in token order (row-major over rows, then packed order),
as transformers' image processor gives them per sample, concatenated. `position_ids` is ignored: the M-RoPE ids are
computed here from the tokens and grids (positions restart per packed sample). Without pixel_values the model is
Qwen3 with M-RoPE on text (all three rows equal: ordinary RoPE). `vision_input_ids` (optional, like input_ids):
where the images are, the responses' tokens -1 (a generated pad token is text, as in the engines' decode).

Deepstack (as transformers' `Qwen3VLTextModel`): the output of decoder layer i (i < number of deepstack mergers) gets
deepstack feature i added at the image positions: forward hooks on those layers add a [s, b, h] tensor that is zero
elsewhere (sequence-parallel: this rank's slice). Pipeline parallelism is refused (the tower and the deepstack
layers would need to sit on the first stage; not built). Context parallelism is refused by the rotary.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from hpc_rl.models.qwen3_vl.vision import build_vision_tower
from hpc_rl.models.qwen3_vl.layers_rope import InterleavedMRoPE, batch_mrope_positions


class Qwen3VLGPTModel(GPTModel):
    """GPTModel + the Qwen3-VL vision tower, M-RoPE and deepstack (the module docstring says what it takes)."""

    def __init__(self, *args: Any, vision_config: dict[str, Any], image_token_id: int, mrope_section: list[int],
                 **kwargs: Any) -> None:
        kwargs["scatter_embedding_sequence_parallel"] = False  # images go in first, then this model scatters
        config = kwargs.get("config", args[0] if args else None)
        if config is not None and config.apply_rope_fusion:
            raise ValueError("Qwen3-VL: apply_rope_fusion must be off (the fused THD rotary reads one table per "
                             "sequence from position 0; M-RoPE needs a per-token table, which Megatron's unfused "
                             "path applies with offsets)")
        super().__init__(*args, **kwargs)
        if self.config.pipeline_model_parallel_size > 1:
            raise ValueError("Qwen3-VL with pipeline_model_parallel_size > 1: not built (the vision tower and the "
                             "deepstack layers must sit on one stage); use TP/EP")
        self.image_token_id = int(image_token_id)
        self.spatial_merge_size = int(vision_config.get("spatial_merge_size", 2))
        self.position_embedding_type = "mrope"
        self.mrope_section = list(mrope_section)
        self.rotary_pos_emb = InterleavedMRoPE(kv_channels=self.config.kv_channels, rotary_percent=1.0,
                                               rotary_base=kwargs.get("rotary_base", 10000))
        device = "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device()
        self.vision_model = build_vision_tower(vision_config, dtype=self.config.params_dtype, device=device)
        self._deepstack: list[torch.Tensor] | None = None
        deepstack = len(vision_config.get("deepstack_visual_indexes") or [])
        if deepstack > len(self.decoder.layers):
            raise ValueError(f"vision_config.deepstack_visual_indexes has {deepstack} entries, the language model "
                             f"{len(self.decoder.layers)} layers")
        for index in range(deepstack):
            self.decoder.layers[index].register_forward_hook(functools.partial(self._add_deepstack, index))

    def _add_deepstack(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._deepstack is None:
            return output
        hidden, context = output
        return hidden + self._deepstack[index].to(hidden.dtype), context

    def _images_into_embeddings(self, input_ids: torch.Tensor, embeddings: torch.Tensor, pixel_values: torch.Tensor,
                                image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """[s, b, h] embeddings with the merged image features at the pads; the deepstack addends, [s, b, h]."""
        vision = self.vision_model(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw,
                                   return_dict=True)
        where = (input_ids == self.image_token_id).nonzero()  # (row, column) in row-major order, as HF fills them
        if where.shape[0] != vision.pooler_output.shape[0]:
            raise ValueError(f"the tokens hold {where.shape[0]} image pad tokens, the images give "
                             f"{vision.pooler_output.shape[0]} features (image_grid_thw vs the prompt's pads)")
        seq, row = where[:, 1], where[:, 0]
        embeddings = embeddings.clone()
        embeddings[seq, row] = vision.pooler_output.to(embeddings.dtype)
        addends = []
        for feature in vision.deepstack_features:
            addend = embeddings.new_zeros(embeddings.shape)
            addend[seq, row] = feature.to(embeddings.dtype)
            addends.append(addend)
        return embeddings, addends

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                inference_context: Any = None, packed_seq_params: Any = None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                vision_input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        # where the images are: `vision_input_ids` when given (input_ids with the responses' tokens -1, so an image
        # pad token the policy generated stays text, as in the engine's decode), else every pad of input_ids
        image_ids = input_ids if vision_input_ids is None else vision_input_ids
        cu_seqlens = None
        if packed_seq_params is not None:
            cu_seqlens = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
                          else packed_seq_params.cu_seqlens_q)
        positions = batch_mrope_positions(image_ids, self.image_token_id, image_grid_thw, self.spatial_merge_size,
                                          cu_seqlens=cu_seqlens)
        self._deepstack = None
        if decoder_input is None:
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], not scattered
            if pixel_values is not None:
                embeddings, addends = self._images_into_embeddings(image_ids, embeddings, pixel_values,
                                                                   image_grid_thw)
                if self.config.sequence_parallel:
                    addends = [tensor_parallel.scatter_to_sequence_parallel_region(a) for a in addends]
                self._deepstack = addends
            if self.config.sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            decoder_input = embeddings
        return super().forward(input_ids, positions, attention_mask, decoder_input=decoder_input, labels=labels,
                               inference_context=inference_context, packed_seq_params=packed_seq_params, **kwargs)


def vl_model_class(arch: Any) -> Any:
    """The model class `build_gpt_model` builds for an architecture with `vision_config` (Qwen3-VL)."""
    vision = arch.vision_config
    if not vision or "image_token_id" not in vision or "mrope_section" not in vision:
        raise ValueError(f"model family {arch.family}: vision_config needs config.json's vision_config with "
                         f"image_token_id and mrope_section (hpc_rl.models.qwen3_vl.names.architecture_fields_from_hf)")
    return functools.partial(Qwen3VLGPTModel, vision_config=vision, image_token_id=vision["image_token_id"],
                             mrope_section=vision["mrope_section"])
