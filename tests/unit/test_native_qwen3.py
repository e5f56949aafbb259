"""The CPU engine's own Qwen3 forward and tokenizer against transformers' (same checkpoint, same answers).

The engine loads them instead of transformers to start without importing transformers' modeling; these
tests hold them to transformers' numbers: prefill of left-padded rows and decode steps through
`kv_batch` on both models, the loaded checkpoint's names and tied weights, and the tokenizer's
encode/decode on the tiny vocabulary.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from hpc_rl.engines.cpu import kv_batch
from hpc_rl.engines.cpu.__main__ import load_model
from hpc_rl.engines.cpu.engine_tokenizer import EngineTokenizer, load_engine_tokenizer, native_tokenizer_support
from hpc_rl.engines.cpu.native_qwen3 import NativeQwen3ForCausalLM, load_native_qwen3, native_support
from hpc_rl.engines.cpu.weight_sync import named_tensors
from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(3)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec())


@pytest.fixture(scope="module")
def models(checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return hf, load_native_qwen3(checkpoint)


def test_prefill_and_decode_match_transformers(models):
    hf, native = models
    rng = random.Random(0)
    sequences = [[rng.randrange(5, 24) for _ in range(n)] for n in (3, 9, 1, 6)]
    outputs = []
    for model in (hf, native):
        batch, last, _ = kv_batch.prefill(model, sequences)
        steps = [last]
        for step in range(3):
            tokens = torch.tensor([(7 + step + row) % 24 for row in range(len(sequences))])
            batch, logits = kv_batch.decode_step(model, batch, tokens)
            steps.append(logits)
        outputs.append(torch.stack(steps))
    assert outputs[0].shape == outputs[1].shape == (4, len(sequences), 24)
    assert (outputs[0] - outputs[1]).abs().max() < 1e-5


def test_full_logits_match_transformers(models):
    hf, native = models
    sequences = [[5, 6, 7, 8], [9, 10]]
    per_sequence = [kv_batch.prefill(model, sequences, full_logits=True)[2] for model in (hf, native)]
    for a, b in zip(*per_sequence):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5


def test_repeated_sequences_run_once_and_answer_as_if_each_ran(models):
    """share_repeats: a GRPO group's samples (one prompt, several rows) are prefilled once; their cache, logits and
    the decode steps after it equal a prefill of every row."""
    _, native = models
    sequences = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 2 + [[11, 12, 13]]
    rows_run = []
    hook = native.model.embed_tokens.register_forward_hook(lambda module, args, out: rows_run.append(args[0].shape[0]))
    try:
        shared = kv_batch.prefill(native, sequences, full_logits=True, share_repeats=True)
        every = kv_batch.prefill(native, sequences, full_logits=True)
    finally:
        hook.remove()
    assert rows_run == [3, 6]
    (batch_a, last_a, full_a), (batch_b, last_b, full_b) = shared, every
    assert torch.equal(batch_a.mask, batch_b.mask) and (last_a - last_b).abs().max() < 1e-5
    for a, b in zip([*batch_a.keys, *batch_a.values, *full_a], [*batch_b.keys, *batch_b.values, *full_b]):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])
    _, logits_a = kv_batch.decode_step(native, batch_a, tokens)
    _, logits_b = kv_batch.decode_step(native, batch_b, tokens)
    assert (logits_a - logits_b).abs().max() < 1e-5
    assert kv_batch.distinct_sequences([[1], [2], [1]]) == ([[1], [2]], [0, 1, 0])


def test_checkpoint_names_and_tied_weights(models, checkpoint):
    hf, native = models
    assert set(named_tensors(native)) - {"inv_freq"} >= set(dict(hf.named_parameters(remove_duplicate=False)))
    assert native.lm_head.weight is native.model.embed_tokens.weight
    assert native.generation_config.eos_token_id == hf.generation_config.eos_token_id
    assert native.config.max_position_embeddings == hf.config.max_position_embeddings


def test_unsupported_checkpoints_say_why_and_load_through_transformers(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    assert native_support(config) is None
    assert "rope type 'yarn'" in native_support({**config, "rope_parameters": {"rope_type": "yarn",
                                                                              "rope_theta": 1e6}})
    assert "model_type 'llama'" in native_support({**config, "model_type": "llama"})
    with pytest.raises(ValueError, match="cannot run this checkpoint"):
        NativeQwen3ForCausalLM({**config, "use_sliding_window": True})
    assert isinstance(load_model(str(checkpoint), "auto", "eager"), NativeQwen3ForCausalLM)
    assert not isinstance(load_model(str(checkpoint), "auto", "sdpa"), NativeQwen3ForCausalLM)
    assert not isinstance(load_model(str(checkpoint), "transformers", "eager"), NativeQwen3ForCausalLM)


def test_a_checkpoint_missing_a_weight_is_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_native_qwen3(tmp_path)


def test_tokenizer_answers_as_transformers(checkpoint):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(checkpoint)
    ours = load_engine_tokenizer(checkpoint)
    assert isinstance(ours, EngineTokenizer) and native_tokenizer_support(checkpoint) is None
    assert ours.eos_token_id == reference.eos_token_id
    for text in ("0 1 2", "copy 7<|im_end|>", "", "<|im_start|>user\n3<|im_end|>\n"):
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    rng = random.Random(1)
    sequences = [[rng.randrange(0, 24) for _ in range(rng.randrange(0, 12))] for _ in range(40)]
    for skip in (False, True):
        assert ours.batch_decode(sequences, skip_special_tokens=skip) == reference.batch_decode(
            sequences, skip_special_tokens=skip)
        assert [ours.decode(s, skip_special_tokens=skip) for s in sequences] == [
            reference.decode(s, skip_special_tokens=skip) for s in sequences]


def test_tokenizer_falls_back_where_transformers_adds_processing(checkpoint, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert native_tokenizer_support(tmp_path) == "clean_up_tokenization_spaces is set"
    assert not isinstance(load_engine_tokenizer(tmp_path), EngineTokenizer)
