"""What label each rule reward can score, checked on the data at submit (issue 37 case 5).

Owns `label_problem(rm_type, label)`: why a row's label cannot be scored by the reward type, or None. A label the
grader cannot read (a list, an object, null, a bool) made deepscaler and math score 0 on every sample (their
"no answer" paths come before the label is looked at, and most responses take them), so a whole run trained on
zeros and ended "run finished". The graders' own rules (`hpc_rl.rewards`), as shapes:

    deepscaler, math, dapo, tiny_task   a string or a number (int/float), not empty (dapo: an integer,
                                        which its grader checks and names per sample)
    f1                                  a string
    remote_rm, custom_rm_path           anything (the remote or custom function decides)

A per-row `metadata["rm_type"]` (slime's override) is the type checked for that row. Here, in `data`, because
submit's file checks (`config.file_checks`) read it and sit below `rewards`; `tests/unit/test_label_shapes.py`
keeps this table and the graders' list (`rewards.scoring.RM_TYPES`) the same.
"""

from __future__ import annotations

from typing import Any

LABEL_SHAPES: dict[str, str] = {"deepscaler": "number or text", "math": "number or text", "dapo": "number or text",
                                "tiny_task": "number or text", "f1": "text", "remote_rm": "anything",
                                "geo3k": "number or text", "tiny_vl_task": "number or text"}
"""Rule reward type (without slime's `boxed_` prefix) -> the labels it can score."""


def _shape(label: Any) -> str:
    if label is None:
        return "null"
    if isinstance(label, bool):
        return f"a bool ({str(label).lower()})"
    kind = {list: "a list", dict: "an object"}.get(type(label), f"a {type(label).__name__}")
    text = repr(label)
    return f"{kind} ({text if len(text) <= 60 else text[:57] + '...'})"


def label_problem(rm_type: str, label: Any) -> str | None:
    """Why `label` cannot be scored by `rm_type` (with or without `boxed_`), or None when it can (or the type is
    not a rule type: its own check names it)."""
    shape = LABEL_SHAPES.get(rm_type.removeprefix("boxed_"))
    if shape == "number or text":
        if not isinstance(label, (str, int, float)) or isinstance(label, bool):
            return f"is {_shape(label)}; rm_type {rm_type} compares the answer with a string or number label"
        if isinstance(label, str) and not label.strip():
            return f"is empty; rm_type {rm_type} can never score it"
    elif shape == "text" and not isinstance(label, str):
        return f"is {_shape(label)}; rm_type {rm_type} compares text with a string label"
    return None
