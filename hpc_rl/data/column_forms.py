"""The two forms a sample's token-id and log-prob columns may be held in: wide (int64 / float64, `array('q'/'d')`)
and narrow (int32 / float32, `array('i'/'f')`), and the exact conversions between them.

Owns: which typecodes each compact column may have (`COLUMN_FORMS`), `narrowed` (the narrow form of a wide array
when it holds the same numbers exactly, else the array itself), `widened`, and numpy's dtype of each typecode.

Why: SGLang's log-probs are float32 values (torch float32 `.tolist()`) and token ids fit int32, so an answer's
columns are narrowed where they are parsed (rollout/answer_workers.py) and the coordinating process receives, keeps,
journals and packs half the bytes per generated token. Exact means: every id in int32's range; every log-prob's
float32 round trip gives back the same float64 bits (NaN and -0.0 included). Any reader sees the same values in
both forms (`array('f').tolist()` gives the float32 values as Python floats, equal to the float64 ones).
"""

from __future__ import annotations

from array import array

import numpy as np

COLUMN_FORMS = {"response_token_ids": ("q", "i"), "response_logprobs": ("d", "f"), "weight_versions": ("q",)}
"""Per compact column, the typecodes it may be held as (the wide one first)."""

WIDE = {"q": "q", "i": "q", "d": "d", "f": "d"}
"""The wide typecode of each typecode."""

DTYPES = {code: np.dtype(code) for code in WIDE}
"""numpy's dtype of each typecode (native byte order; 'i' int32, 'f' float32)."""

assert DTYPES["i"].itemsize == 4 and DTYPES["f"].itemsize == 4 and DTYPES["q"].itemsize == 8


def narrowed(values: array) -> array:
    """`values` (an `array('q')` or `array('d')`) as an `array('i')` / `array('f')` of the same numbers when that is
    exact, else `values` itself (also for any other array)."""
    code = values.typecode
    if code == "q":
        if not len(values):
            return array("i")
        wide = np.frombuffer(values, dtype=np.int64)
        if int(wide.min()) < -2**31 or int(wide.max()) >= 2**31:
            return values
        narrow = array("i")
        narrow.frombytes(wide.astype(np.int32).tobytes())
        return narrow
    if code == "d":
        if not len(values):
            return array("f")
        wide = np.frombuffer(values, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # (beyond float32's range: inf, not the same bits)
            small = wide.astype(np.float32)
        if small.astype(np.float64).tobytes() != wide.tobytes():  # not the same bits back (NaN payloads too)
            return values
        narrow = array("f")
        narrow.frombytes(small.tobytes())
        return narrow
    return values


def widened(values: array) -> array:
    """`values` in its wide form (a new array of the same numbers; `values` itself when already wide)."""
    code = values.typecode
    wide_code = WIDE.get(code, code)
    if wide_code == code:
        return values
    wide = array(wide_code)
    if len(values):
        wide.frombytes(np.frombuffer(values, dtype=DTYPES[code]).astype(DTYPES[wide_code]).tobytes())
    return wide
