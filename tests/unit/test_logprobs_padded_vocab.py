"""`hpc_rl.training.logprobs` on a padded vocabulary (Megatron pads it to a multiple of 128): the padded ids count
for nothing in the log-probs, the entropy, the greedy hits or the gradient, however large their logits."""

from __future__ import annotations

import torch

from hpc_rl.training.logprobs import vocab_parallel_greedy_hits, vocab_parallel_head_logprobs, vocab_parallel_logprobs


def test_padded_ids_count_for_nothing_and_get_no_gradient() -> None:
    torch.manual_seed(0)
    vocab, padded = 24, 128
    logits = torch.randn(3, 5, padded)
    logits[..., vocab:] = 40.0  # padding rows of the output layer are not trained: any value
    logits.requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 5))
    log_probs, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=vocab, with_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()

    real = logits.detach()[..., :vocab].clone().requires_grad_(True)
    reference = torch.log_softmax(real, dim=-1)
    expected = reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1)
    (expected.sum() + expected_entropy.sum()).backward()

    assert log_probs.shape == entropy.shape == (3, 5)
    assert torch.allclose(log_probs, expected, atol=1e-6) and torch.allclose(entropy, expected_entropy, atol=1e-5)
    assert torch.allclose(logits.grad[..., :vocab], real.grad, atol=1e-6)
    assert torch.count_nonzero(logits.grad[..., vocab:]) == 0
    hits = vocab_parallel_greedy_hits(logits.detach(), real.detach().argmax(-1), vocab_size=vocab)
    assert hits.min() == 1.0  # the padded 40s are never the argmax
    head = vocab_parallel_head_logprobs(logits.detach().reshape(15, padded), torch.tensor([[0, 5]] * 15),
                                        vocab_size=vocab)
    assert torch.allclose(head, reference.detach().reshape(15, vocab)[:, [0, 5]], atol=1e-6)
