"""Score centering end to end, in pieces: the engine's top-k log-probs (CPU engine vs a forward pass), the
parsing and packing on the rollout side, the trainer's head log-probs, and the loss with hand-checked values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.samples import Sample
from hpc_rl.engines.cpu.requests import GenerationRequest, parse_generate_body
from hpc_rl.engines.cpu.sampling import make_generator, parse_sampling_params
from hpc_rl.engines.cpu.scheduler import Scheduler
from hpc_rl.rollout.request_batching import batchable, merge_payloads
from hpc_rl.rollout.top_logprobs import (TopLogprobsError, append_top_logprobs, pad_top_logprobs,
                                         top_logprobs_from_answer)
from hpc_rl.training.logprobs import vocab_parallel_head_logprobs
from hpc_rl.training.losses import PolicyLossConfig, policy_loss_and_metrics
from hpc_rl.training.train_batch import TrainBatch
from tests.unit.test_engines_cpu import drive, hf_model, model, tokenizer  # noqa: F401 (fixtures)


# --- the CPU engine -------------------------------------------------------------------------------


def test_cpu_engine_top_logprobs_equal_a_forward_pass_top_k(model, tokenizer, hf_model):  # noqa: F811
    scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0")
    params = parse_sampling_params({"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3})
    prompt = [5, 6, 7]
    asked = GenerationRequest(rid="a", input_ids=prompt, params=params, return_logprob=True, top_logprobs_num=4,
                              output_top_logprobs=[], generator=make_generator(params))
    plain = GenerationRequest(rid="b", input_ids=[8, 9], params=params, return_logprob=True,
                              generator=make_generator(params))
    futures = [scheduler.submit(asked), scheduler.submit(plain)]
    drive(scheduler, futures)
    meta = futures[0].result()["meta_info"]
    output = futures[0].result()["output_ids"]
    assert "output_top_logprobs" not in futures[1].result()["meta_info"]  # only where asked
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(output)].topk(4, dim=-1)
    top = meta["output_top_logprobs"]
    assert len(top) == len(output) == 5 and all(len(entry) == 4 for entry in top)
    assert [[c[1] for c in entry] for entry in top] == reference.indices.tolist()
    got = torch.tensor([[c[0] for c in entry] for entry in top])
    assert (got - reference.values).abs().max() < 1e-4
    assert all(c[2] is None for entry in top for c in entry)
    # the sampled token's own log-prob is one of the candidates' when it is in the head
    for (sampled_lp, token, _), entry in zip(meta["output_token_logprobs"], top):
        if token in [c[1] for c in entry]:
            assert abs(sampled_lp - next(c[0] for c in entry if c[1] == token)) < 1e-6


def test_cpu_engine_parses_top_logprobs_num_per_item(tokenizer):  # noqa: F811
    parsed = parse_generate_body({"input_ids": [[5, 6], [7]], "return_logprob": True, "top_logprobs_num": [2, 0],
                                  "sampling_params": {"max_new_tokens": 2}}, tokenizer=tokenizer,
                                 context_length=256)
    assert [r.top_logprobs_num for r in parsed.requests] == [2, 0]
    assert parsed.requests[0].output_top_logprobs == [] and parsed.requests[1].output_top_logprobs is None
    with pytest.raises(Exception, match="top_logprobs_num"):
        parse_generate_body({"input_ids": [5], "top_logprobs_num": -1}, tokenizer=tokenizer, context_length=256)


# --- the rollout side -----------------------------------------------------------------------------


def test_top_logprobs_from_an_sglang_answer_and_onto_the_sample() -> None:
    meta = {"output_top_logprobs": [[[-0.1, 7, None], [-2.5, 3, None], [-4.0, 9, None]],
                                    [[-0.3, 4, "x"], [-1.5, 7, "y"], [None, 1, None]]]}
    ids, logprobs = top_logprobs_from_answer(meta, n_tokens=2, k=2)  # k below what came: the first k
    assert ids.tolist() == [[7, 3], [4, 7]] and ids.dtype == np.int32
    np.testing.assert_allclose(logprobs, [[-0.1, -2.5], [-0.3, -1.5]], rtol=1e-6)
    assert np.isneginf(top_logprobs_from_answer(meta, n_tokens=2, k=3)[1][1, 2])
    with pytest.raises(TopLogprobsError, match="one entry per output token"):
        top_logprobs_from_answer({}, n_tokens=2, k=2)
    with pytest.raises(TopLogprobsError, match="expected k=4"):
        top_logprobs_from_answer(meta, n_tokens=2, k=4)
    sample = Sample(index=0, group_index=0, prompt="p", prompt_token_ids=[1, 2])
    append_top_logprobs(sample, ids, logprobs)
    sample.response_token_ids += [5, 6]
    pad_top_logprobs(sample, 1)  # a tool token
    sample.response_token_ids += [8]
    assert sample.top_logprob_ids.shape == (3, 2) and np.isneginf(sample.top_logprobs[2]).all()
    back = Sample.from_dict(sample.to_dict())  # checkpoints: -inf survives JSON as null
    np.testing.assert_array_equal(back.top_logprobs, sample.top_logprobs)
    np.testing.assert_array_equal(back.top_logprob_ids, sample.top_logprob_ids)


def test_requests_with_top_logprobs_num_still_batch() -> None:
    payloads = [{"rid": f"r{i}", "input_ids": [1, 2], "sampling_params": {}, "return_logprob": True,
                 "top_logprobs_num": 8} for i in range(2)]
    assert all(batchable(p) for p in payloads)
    assert merge_payloads(payloads)["top_logprobs_num"] == 8


def test_top_logprobs_travel_to_the_trainer_per_sample() -> None:
    samples = []
    for index, n in enumerate([2, 3]):
        s = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1, 2], response_token_ids=[3] * n,
                   response_logprobs=[-0.5] * n, weight_versions=[0] * n, reward=1.0)
        s.top_logprob_ids = np.arange(n * 2, dtype=np.int32).reshape(n, 2) + 10 * index
        s.top_logprobs = -np.arange(n * 2, dtype=np.float32).reshape(n, 2) - index
        samples.append(s)
    arrays = pack_samples(samples, [1.0, -1.0])
    assert arrays["top_logprobs"].shape == (5, 2) and arrays["top_logprob_ids"].dtype == np.int32
    batch = TrainBatch.from_arrays(arrays)
    for s, ids, lps in zip(samples, batch.top_logprob_ids, batch.top_logprobs):
        np.testing.assert_array_equal(ids, s.top_logprob_ids)
        np.testing.assert_array_equal(lps, s.top_logprobs)
    again = TrainBatch.from_arrays(batch.select([1]).to_arrays())
    np.testing.assert_array_equal(again.top_logprob_ids[0], samples[1].top_logprob_ids)
    samples[1].top_logprobs = None
    samples[1].top_logprob_ids = None
    with pytest.raises(ValueError, match="sample 1 has no top-k log-probs"):
        pack_samples(samples, [1.0, -1.0])


# --- the trainer ----------------------------------------------------------------------------------


def test_head_logprobs_are_the_full_softmax_at_the_ids() -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ids = torch.tensor([[0, 3], [10, 2], [5, 5], [7, 1]])
    head = vocab_parallel_head_logprobs(logits, ids, vocab_size=11)
    torch.testing.assert_close(head, torch.log_softmax(logits, -1).gather(-1, ids))
    head.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    padded = torch.cat([logits.detach(), torch.full((4, 3), 50.0)], -1)  # Megatron's padded rows get no mass
    torch.testing.assert_close(vocab_parallel_head_logprobs(padded, ids, vocab_size=11),
                               torch.log_softmax(logits.detach(), -1).gather(-1, ids))


def test_reinforce_with_score_centering_hand_values() -> None:
    # One sample, two tokens, advantage 2, on-policy. Token 0: p = [0.5, 0.25] (sampled is p=0.5), sampler
    # q = [0.4, 0.4]. With TIS [0, 1]: w = [1, 0.625], rho = 0.2 / 0.25 = 0.8, alpha = 0.8 * min(1.25, 1) = 0.8,
    # residual = [0.4 - 0.4, 0.25 - 0.2] = [0, 0.05], c_0 = 0.05 * log 0.25. Token 1 has loss mask 0: no term.
    # The sampled token's TIS weight: exp(logp - logq) = 0.5 / 0.4 = 1.25 -> clamped to 1.
    # pg_0 = -2 * 1 * log 0.5 + 2 * 0.05 * log 0.25; sum_of_sample_mean over 1 trained token = pg_0.
    log_p = torch.log(torch.tensor([0.5, 0.3])).requires_grad_()
    train_head = torch.log(torch.tensor([[0.5, 0.25], [0.3, 0.3]])).requires_grad_()
    sampler_head = torch.tensor([[math.log(0.4), math.log(0.4)], [-math.inf, -math.inf]])
    config = PolicyLossConfig(policy_loss_type="reinforce", use_tis=True, tis_clip=1.0, tis_clip_low=0.0,
                              entropy_coef=0.0)
    loss, metrics = policy_loss_and_metrics(
        config, log_probs=[log_p], old_log_probs=None, advantages=[torch.tensor([2.0, 2.0])],
        loss_masks=[torch.tensor([1.0, 0.0])], rollout_log_probs=[torch.log(torch.tensor([0.4, 0.3]))],
        score_centering=(train_head, sampler_head))
    expected = -2.0 * math.log(0.5) + 2.0 * 0.05 * math.log(0.25)
    assert abs(float(loss) - expected) < 1e-5
    assert abs(float(metrics["score_centering_head_mass_q"]) - 0.8) < 1e-6
    assert abs(float(metrics["score_centering_head_mass_p"]) - 0.75) < 1e-6
    assert abs(float(metrics["score_centering_abs"]) - 0.05 * math.log(4.0)) < 1e-6
    loss.backward()
    torch.testing.assert_close(train_head.grad, torch.tensor([[0.0, 0.1], [0.0, 0.0]]))  # A * residual, row 0 only
    assert torch.isfinite(train_head.grad).all()
    # Without TIS the sampled score has no weight and neither has its expectation: w = 1, alpha = rho = 0.8,
    # residual = q - 0.8 p = [0.4 - 0.4, 0.4 - 0.2] = [0, 0.2]: pg_0 = -2 log 0.5 + 2 * 0.2 * log 0.25.
    plain = PolicyLossConfig(policy_loss_type="reinforce", entropy_coef=0.0)
    train_head.grad = None
    loss, _ = policy_loss_and_metrics(plain, log_probs=[log_p.detach()], old_log_probs=None,
                                      advantages=[torch.tensor([2.0, 2.0])], loss_masks=[torch.tensor([1.0, 0.0])],
                                      score_centering=(train_head, sampler_head))
    assert abs(float(loss) - (-2.0 * math.log(0.5) + 2.0 * 0.2 * math.log(0.25))) < 1e-5
    loss.backward()
    torch.testing.assert_close(train_head.grad, torch.tensor([[0.0, 0.4], [0.0, 0.0]]))
    # On-policy (q = p) the head estimate is exact and the term vanishes.
    loss, _ = policy_loss_and_metrics(plain, log_probs=[log_p.detach()], old_log_probs=None,
                                      advantages=[torch.tensor([2.0, 2.0])], loss_masks=[torch.tensor([1.0, 0.0])],
                                      score_centering=(train_head.detach(), train_head.detach()))
    assert abs(float(loss) + 2.0 * math.log(0.5)) < 1e-5
    with pytest.raises(ValueError, match="REINFORCE"):
        policy_loss_and_metrics(PolicyLossConfig(policy_loss_type="ppo"), log_probs=[log_p.detach()],
                                old_log_probs=None, advantages=[torch.tensor([2.0, 2.0])],
                                loss_masks=[torch.tensor([1.0, 0.0])], score_centering=(train_head, sampler_head))
