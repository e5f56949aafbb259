"""Multi-token prediction (MTP) with Megatron-core's own MTP block, trained as slime trains it.

Owns: the MTP block spec (Megatron's `MultiTokenPredictionLayer`: enorm, hnorm, eh_proj, a decoder layer
shaped like the model's last one, final norm; the embedding and output layer are the model's), and
`MTPGPTModel`, a GPTModel whose MTP layers run only when asked:

* a training forward given `loss_mask` (the micro-batch's MTP targets, `MicroBatch.mtp_loss_mask`): each
  depth k predicts the token k + 2 places ahead from the previous depth's hidden state and the embedding of
  the token k + 1 ahead; its cross entropy over the masked positions, times `mtp_loss_scale`, is attached to
  the main hidden states by Megatron's `MTPLossAutoScaler`, so the main loss's backward runs it. As in slime
  (its Megatron patch, docker/patch/latest/megatron.patch), the MTP layers see the decoder's hidden states,
  the embeddings and the output layer detached: the MTP loss trains the MTP layers only (a draft model
  following the policy), never the policy;
* `mtp_logits`: each depth's logits, for tests against transformers' `MtpModel`;
* any other forward returns the main logits and never runs the MTP layers.

Why a subclass: Megatron-core 0.16.1's GPTModel runs MTP in every forward once `mtp_num_layers` is set,
requires `labels` for it and then returns the language-model loss instead of logits; an RL trainer needs
logits (log-probs at the sampling temperature) and MTP only in the training pass (slime patches Megatron
for the same reason). The padded vocabulary rows are masked in the MTP cross entropy as in the log-probs
(`logprobs.vocab_parallel_logprobs`). Positions whose MTP target lies beyond the sample (or in another
packed sample: Megatron's `roll_tensor` respects packed boundaries and CP chunks) are not trained.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
    roll_tensor,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from hpc_rl.training.logprobs import vocab_parallel_logprobs


def mtp_model_of(model: torch.nn.Module) -> MTPGPTModel | None:
    """The MTPGPTModel inside DDP / Float16Module wrappers, if this stage holds MTP layers."""
    inner: Any = model
    while not isinstance(inner, MTPGPTModel) and hasattr(inner, "module"):
        inner = inner.module
    return inner if isinstance(inner, MTPGPTModel) and getattr(inner, "mtp_process", False) else None


def mtp_block_spec(block: TransformerBlockSubmodules, mtp_num_layers: int, *, use_te: bool,
                   norm: type | None = None) -> MultiTokenPredictionBlockSubmodules:
    """Megatron's MTP block for the last stage: `mtp_num_layers` layers around a copy of the stage's last
    decoder layer spec (`norm`: the CPU norm class for enorm / hnorm / the final norm)."""
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend: Any = TESpecProvider()
    else:
        from megatron.core.models.backends import LocalSpecProvider

        backend = LocalSpecProvider()
    layer: ModuleSpec = get_mtp_layer_spec_for_backend(transformer_layer_spec=block.layer_specs[-1], backend=backend)
    if norm is not None:
        for field in ("enorm", "hnorm", "layer_norm"):
            setattr(layer.submodules, field, norm)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * mtp_num_layers)


def padded_packing(packed_seq_params: Any) -> Any:
    """The packed-sequence parameters the MTP layers run with: under context parallelism Megatron's
    `roll_tensor` locates each sequence's chunks from `cu_seqlens_q` as CP-padded offsets (slime packs that
    way), while hpc_rl's rows carry the real lengths there and the padded ones in `cu_seqlens_q_padded`; the
    padded offsets serve both. Padding sits after each sequence's real tokens, so under causal attention no
    real token's output changes."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q_padded is None:
        return packed_seq_params
    import dataclasses

    return dataclasses.replace(packed_seq_params, cu_seqlens_q=packed_seq_params.cu_seqlens_q_padded,
                               cu_seqlens_kv=packed_seq_params.cu_seqlens_kv_padded)


class MTPGPTModel(GPTModel):
    """GPTModel with MTP layers that run only in an MTP-training forward or `mtp_logits` (see the module)."""

    mtp_loss_scale: float = 0.0
    """Multiplier of each micro-batch's summed MTP cross entropy (the trainer sets it per step)."""
    vocab_size_unpadded: int = 0
    """The tokenizer's vocabulary (rows above it are Megatron's padding)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """GPTModel's, with the metadata Megatron 0.16.1 reads unguarded when MTP sits on a stage without the
        embedding (`metadata['dp_cp_group']` with the default metadata None raises TypeError)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    def reset_mtp_metrics(self) -> None:
        depths = self.config.mtp_num_layers or 0
        self.mtp_loss_sums = [0.0] * depths
        self.mtp_token_counts = [0.0] * depths

    def _mtp_hidden(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: Any, packed_seq_params: Any, detach: bool, **rotary: Any) -> list[torch.Tensor]:
        """Each depth's hidden states [s, b, h] (s / TP under SP)."""
        def embed(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            out = self.embedding(input_ids=input_ids, position_ids=position_ids)
            return out.detach() if detach else out

        stacked = self.mtp(input_ids=input_ids, position_ids=position_ids,
                           hidden_states=hidden_states.detach() if detach else hidden_states,
                           attention_mask=attention_mask, packed_seq_params=packed_seq_params, embedding=embed, **rotary)
        return list(torch.chunk(stacked, 1 + (self.config.mtp_num_layers or 0), dim=0))[1:]

    def _mtp_logits(self, hidden: torch.Tensor, *, detach_weight: bool) -> torch.Tensor:
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else \
            self.output_layer.weight
        logits, _ = self.output_layer(hidden, weight=weight.detach() if detach_weight else weight)
        return logits.transpose(0, 1)  # [b, s, V / TP]

    def _attach_mtp_loss(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         loss_mask: torch.Tensor, attention_mask: Any, packed_seq_params: Any,
                         **rotary: Any) -> torch.Tensor:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        cp_group = self.cp_group if self.config.context_parallel_size > 1 else None
        packed_seq_params = padded_packing(packed_seq_params)
        labels, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        mask = loss_mask.float()
        depths = self._mtp_hidden(hidden_states, input_ids, position_ids, attention_mask, packed_seq_params,
                                  detach=True, **rotary)
        for depth, hidden in enumerate(depths):
            labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
            mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
            log_probs, _ = vocab_parallel_logprobs(self._mtp_logits(hidden, detach_weight=True), labels,
                                                   vocab_size=self.vocab_size_unpadded,
                                                   tp_group=tp_group if tp_group.size() > 1 else None)
            loss = -(log_probs * mask).sum()
            self.mtp_loss_sums[depth] += float(loss.detach())
            self.mtp_token_counts[depth] += float(mask.sum())
            hidden_states = MTPLossAutoScaler.apply(hidden_states, self.mtp_loss_scale * loss)
        return hidden_states

    def _postprocess(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     labels: Any, rotary_pos_emb: Any, rotary_pos_cos: Any, rotary_pos_sin: Any,
                     mtp_in_postprocess: bool | None = None, loss_mask: torch.Tensor | None = None,
                     decoder_input: Any = None, attention_mask: Any = None, inference_params: Any = None,
                     packed_seq_params: Any = None, sequence_len_offset: Any = None,
                     runtime_gather_output: bool | None = None, extra_block_kwargs: Any = None,
                     inference_context: Any = None) -> torch.Tensor:
        if mtp_in_postprocess and loss_mask is not None and self.training:
            hidden_states = self._attach_mtp_loss(hidden_states, input_ids, position_ids, loss_mask, attention_mask,
                                                  packed_seq_params, rotary_pos_emb=rotary_pos_emb,
                                                  rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin)
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()

    @torch.no_grad()
    def mtp_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any,
                   packed_seq_params: Any = None) -> list[torch.Tensor]:
        """Each MTP depth's vocab-parallel logits [b, s, V / TP] (PP = 1): position t of depth k scores the
        token at t + k + 2 (the last k + 1 positions have no input token)."""
        decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params)
        return [self._mtp_logits(depth, detach_weight=False)
                for depth in self._mtp_hidden(hidden, input_ids, position_ids, attention_mask, packed_seq_params,
                                              detach=False)]
