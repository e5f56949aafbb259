"""Finding the answer a response puts in its last `\\boxed{...}`.

Owns: locating the last `\\boxed` command and cutting out its brace-balanced argument, with the
same edge cases as slime's `math_utils.extract_answer` (a `\\boxed` without a braced argument gives
no answer; nested braces are kept). It does not normalise or grade what it finds.
"""

from __future__ import annotations

BOXED = "\\boxed"
BOXED_OPEN = "\\boxed{"


def _last_boxed_span(text: str) -> str | None:
    """The text from the last `\\boxed` up to the brace that closes the first brace after it."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def last_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, or None.

    None when there is no `\\boxed`, when its braces never close, or when the last `\\boxed` is not
    directly followed by `{` (e.g. `\\boxed 5`): slime gives no answer in all three cases.
    """
    if BOXED not in text:
        return None
    span = _last_boxed_span(text)
    if span is None or not span.startswith(BOXED_OPEN) or not span.endswith("}"):
        return None
    return span[len(BOXED_OPEN) : -1]
