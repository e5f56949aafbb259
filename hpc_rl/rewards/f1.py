"""The `f1` reward: token-overlap F1 between response and label (HotpotQA / SQuAD style).

Owns: the text normalisation (lower-case, drop ASCII punctuation, drop the articles a/an/the,
collapse whitespace), the yes/no/noanswer rule (such answers score 0 unless they match exactly) and
the F1 of the two token multisets. Mirrors slime's `rm_hub/f1.py`; the reward is the F1 alone.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import NamedTuple

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


class F1Score(NamedTuple):
    f1: float
    precision: float
    recall: float


_ZERO = F1Score(0.0, 0.0, 0.0)


def normalize_text(text: str) -> str:
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str, ground_truth: str) -> F1Score:
    """F1, precision and recall of the normalised token overlap."""
    predicted = normalize_text(prediction)
    truth = normalize_text(ground_truth)
    if (predicted in _CLOSED_ANSWERS or truth in _CLOSED_ANSWERS) and predicted != truth:
        return _ZERO
    predicted_tokens = predicted.split()
    truth_tokens = truth.split()
    overlap = sum((Counter(predicted_tokens) & Counter(truth_tokens)).values())
    if overlap == 0:
        return _ZERO
    precision = overlap / len(predicted_tokens)
    recall = overlap / len(truth_tokens)
    return F1Score(2 * precision * recall / (precision + recall), precision, recall)


def f1_reward(response: str, label: object) -> float:
    """F1 of `response` against `label` (a string; anything else is a TypeError)."""
    if not isinstance(label, str):
        raise TypeError(f"f1 needs a string label, got {type(label).__name__}: {label!r}")
    return f1_score(response, label).f1
