"""The engines' top-k log-probs per generated token, for score centering (`algorithm.use_score_centering`).

Owns: the request field (SGLang's `top_logprobs_num`, beside `return_logprob`), reading the answer's
`meta_info.output_top_logprobs` (one entry per output token: a list of `[logprob, token id, text]`, most
likely first) into two [tokens, k] arrays, and appending them to a `Sample` (`top_logprob_ids`,
`top_logprobs`). Generated tokens carry the engine's head; tool tokens (not generated, loss mask 0) get id 0
and log-prob -inf rows so every response token has one row. Does not own when a request asks (generate.py)
nor the loss (`hpc_rl.training.losses.score_centering_correction`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpc_rl.data.samples import Sample

REQUEST_FIELD = "top_logprobs_num"
ANSWER_FIELD = "output_top_logprobs"


class TopLogprobsError(ValueError):
    """An answer without the top-k log-probs asked for, or with the wrong shape."""


def top_logprobs_from_answer(meta_info: dict[str, Any], *, n_tokens: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """([n_tokens, k] int32 ids, [n_tokens, k] float32 log-probs) from `meta_info.output_top_logprobs`."""
    entries = meta_info.get(ANSWER_FIELD)
    if n_tokens == 0:
        return np.zeros((0, k), dtype=np.int32), np.zeros((0, k), dtype=np.float32)
    if not isinstance(entries, list) or len(entries) != n_tokens:
        got = "none" if entries is None else (f"{len(entries)} entries" if isinstance(entries, list) else
                                              type(entries).__name__)
        raise TopLogprobsError(
            f"algorithm.use_score_centering needs meta_info.{ANSWER_FIELD} with one entry per output token "
            f"({n_tokens}); the engine answered {got} (was the request sent with return_logprob and "
            f"{REQUEST_FIELD}?)")
    ids = np.zeros((n_tokens, k), dtype=np.int32)
    logprobs = np.full((n_tokens, k), -np.inf, dtype=np.float32)
    for row, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) < k:
            raise TopLogprobsError(f"meta_info.{ANSWER_FIELD}[{row}] has "
                                   f"{len(entry) if isinstance(entry, list) else 'no'} candidates, expected k={k} "
                                   f"(algorithm.score_centering_top_k must not exceed the vocabulary)")
        for column, candidate in enumerate(entry[:k]):
            logprobs[row, column] = -np.inf if candidate[0] is None else float(candidate[0])
            ids[row, column] = int(candidate[1])
    return ids, logprobs


def append_top_logprobs(sample: Sample, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """Append rows for newly generated tokens (before the tokens themselves are appended)."""
    if sample.top_logprob_ids is None or sample.top_logprobs is None:
        if sample.response_length:  # tokens from before (tool output, or a resumed sample): no head known
            k = ids.shape[1]
            sample.top_logprob_ids = np.zeros((sample.response_length, k), dtype=np.int32)
            sample.top_logprobs = np.full((sample.response_length, k), -np.inf, dtype=np.float32)
        else:
            sample.top_logprob_ids, sample.top_logprobs = ids, logprobs
            return
    sample.top_logprob_ids = np.concatenate([sample.top_logprob_ids, ids])
    sample.top_logprobs = np.concatenate([sample.top_logprobs, logprobs])


def pad_top_logprobs(sample: Sample, n_tokens: int) -> None:
    """Rows for tokens the model did not generate (tool output): id 0, log-prob -inf."""
    if sample.top_logprob_ids is None or sample.top_logprobs is None or n_tokens == 0:
        return
    k = sample.top_logprob_ids.shape[1]
    append_top_logprobs(sample, np.zeros((n_tokens, k), dtype=np.int32),
                        np.full((n_tokens, k), -np.inf, dtype=np.float32))
