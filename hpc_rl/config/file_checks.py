"""Submit-time checks of the files a run reads: paths exist, the HF directory holds a model, and
every line of the prompt files parses, before anything is queued.

Owns: what makes an HF checkpoint usable (config.json, weights, a tokenizer) and the whole-file scan
of prompt data (every line: valid JSON, the input key holding a prompt, the label key present), with
the first few bad lines quoted and the count of the rest; and, on the first LABEL_ROWS_CHECKED rows, that
the label is one the reward type can score (`data.label_shapes`: a list or null label for deepscaler is
refused naming file, line and field; always, `skip_bad_lines` or not: such data trains on zeros).
`--no-check-files` skips all of it.
"""

from __future__ import annotations

from pathlib import Path

from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.data.images import ImageLimits, image_problem
from hpc_rl.data.prompts import DataError, DataKeys, iter_rows_at, row_to_record
from hpc_rl.data.label_shapes import label_problem

BAD_LINES_QUOTED = 3
LABEL_ROWS_CHECKED = 1000
"""Rows whose label shape is checked against the reward type (the brief's "first rows"): a dataset's labels
share one shape, so its first rows say which, and a file with a few odd labels further down gets errors naming
those samples at scoring time."""
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def hf_checkpoint_problems(path: str) -> list[Problem]:
    """An HF directory needs config.json, weight files and a tokenizer (engines and the trainer read all three)."""
    directory = Path(path)
    if not directory.is_dir():
        return [Problem("checkpoint.hf_checkpoint", "bad_file", f"{path} is not a directory")]
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not missing:
        return []
    return [Problem("checkpoint.hf_checkpoint",
                        "bad_file",
                        f"{path} is not a HuggingFace model directory: no {', no '.join(missing)}; point it at the "
                        f"directory `huggingface-cli download` wrote")]


def data_file_problems(path: str, keys: DataKeys, field: str, *, skip_bad_lines: bool,
                       rm_type: str | None = None, image_limits: ImageLimits | None = None) -> list[Problem]:
    """Every row of a prompt file checked; the first bad lines quoted, the rest counted.
    With skip_bad_lines, bad lines are allowed but a file with no usable prompt is not. With `rm_type` (a rule
    reward scores this file), the first LABEL_ROWS_CHECKED rows' labels must be ones it can score. With
    multimodal keys, every image of every row is read and decoded once (one at a time; `image_limits`): a missing,
    undecodable or oversized one is refused naming the row, skip_bad_lines or not."""
    if not path or not Path(path).is_file():
        return []
    bad: list[str] = []
    unscorable: list[str] = []
    bad_images: list[str] = []
    good = 0
    data_file = str(Path(path).resolve())
    try:
        for index, (where, position, row) in enumerate(iter_rows_at(path)):
            try:
                if isinstance(row, DataError):
                    raise row
                record = row_to_record(row, index, keys, where, data_file=data_file, position=position)
                good += 1
                for ref in record.images:
                    why_image = image_problem(ref, image_limits or ImageLimits(32 << 20, 4096 * 4096))
                    if why_image is not None:
                        bad_images.append(f"{where}: {why_image}")
                if rm_type and keys.label_key is not None and index < LABEL_ROWS_CHECKED:
                    row_type = str(record.metadata.get("rm_type") or rm_type)
                    why = label_problem(row_type, record.label)
                    if why is not None:
                        unscorable.append(f"{where}: field {keys.label_key!r} {why}")
            except DataError as error:
                bad.append(str(error))
    except (DataError, OSError, ValueError) as error:
        return [Problem(field, "bad_file", f"{path}: cannot be read: {error}")]
    if bad_images:
        more = f" (and {len(bad_images) - BAD_LINES_QUOTED} more)" if len(bad_images) > BAD_LINES_QUOTED else ""
        return [Problem(field, "bad_file", f"{len(bad_images)} image(s) cannot be used: "
                                           f"{'; '.join(bad_images[:BAD_LINES_QUOTED])}{more}")]
    if unscorable:
        more = f" (and {len(unscorable) - BAD_LINES_QUOTED} more)" if len(unscorable) > BAD_LINES_QUOTED else ""
        quoted = "; ".join(unscorable[:BAD_LINES_QUOTED])
        return [Problem(field, "bad_file",
                        f"{len(unscorable)} label(s) the reward cannot score, in the first "
                        f"{min(good, LABEL_ROWS_CHECKED)} row(s): {quoted}{more}; every such sample "
                        "would get reward 0 and train nothing. Fix the labels, set rollout.label_key / "
                        "rm_type to what the data holds, or score with custom_rm_path")]
    if not good:
        reason = f"; {len(bad)} bad row(s), the first: {bad[0]}" if bad else " (the file is empty)"
        return [Problem(field, "bad_file", f"{path} has no usable prompt{reason}")]
    if bad and not skip_bad_lines:
        quoted = "; ".join(bad[:BAD_LINES_QUOTED])
        more = f" (and {len(bad) - BAD_LINES_QUOTED} more)" if len(bad) > BAD_LINES_QUOTED else ""
        return [Problem(field, "bad_file",
                        f"{len(bad)} bad row(s) of {len(bad) + good} (whole file checked): {quoted}{more}; "
                        f"fix them or set skip_bad_lines: true")]
    return []


def path_problems(config: RunConfig) -> list[Problem]:
    problems = []
    required = {"rollout.prompt_data": config.rollout.prompt_data, "checkpoint.hf_checkpoint": config.checkpoint.hf_checkpoint}
    for field, value in required.items():
        if not value:
            problems.append(Problem(field, "needs", "is empty; give a path"))
        elif not Path(value).exists():
            problems.append(Problem(field, "not_found",
                                    f"{value} does not exist (use --no-check-files to render the job elsewhere)"))
        elif field == "checkpoint.hf_checkpoint":
            problems += hf_checkpoint_problems(value)
    if config.checkpoint.ref_load and not Path(config.checkpoint.ref_load).exists():
        problems.append(Problem("checkpoint.ref_load", "not_found",
                                f"{config.checkpoint.ref_load} does not exist"))
    for dataset in config.eval.eval_prompt_data:
        if not Path(dataset.path).exists():
            problems.append(Problem(f"eval.eval_prompt_data[{dataset.name}]", "not_found",
                                    f"{dataset.path} does not exist"))
    checkpoint = config.checkpoint
    if checkpoint.ref_ckpt_step is not None and checkpoint.ref_load and Path(checkpoint.ref_load).is_dir():
        wanted = Path(checkpoint.ref_load) / f"iter_{checkpoint.ref_ckpt_step:07d}"
        if not wanted.is_dir():
            problems.append(Problem("checkpoint.ref_ckpt_step", "not_found",
                                    f"{wanted} does not exist: no iteration "
                                    f"{checkpoint.ref_ckpt_step} in ref_load"))
    custom_config = config.rollout.custom_config_path
    if custom_config and not Path(custom_config).is_file():
        problems.append(Problem("rollout.custom_config_path", "not_found", f"{custom_config} does not exist"))
    return problems


def prompt_file_problems(config: RunConfig) -> list[Problem]:
    rollout = config.rollout
    keys = DataKeys(input_key=rollout.input_key, label_key=rollout.label_key, metadata_key=rollout.metadata_key,
                    tool_key=rollout.tool_key, multimodal_keys=dict(rollout.multimodal_keys))
    limits = ImageLimits(rollout.max_image_bytes, rollout.max_image_pixels)
    rm_type = None if rollout.custom_rm_path else rollout.rm_type  # a custom reward reads labels its own way
    problems = data_file_problems(rollout.prompt_data, keys, "rollout.prompt_data",
                                  skip_bad_lines=rollout.skip_bad_lines, rm_type=rm_type, image_limits=limits)
    problems += vision_checkpoint_problems(config)
    evaluation = config.eval
    eval_keys = DataKeys(input_key=evaluation.eval_input_key or keys.input_key,
                         label_key=evaluation.eval_label_key or keys.label_key, metadata_key=keys.metadata_key,
                         tool_key=evaluation.eval_tool_key or keys.tool_key, multimodal_keys=keys.multimodal_keys)
    for dataset in evaluation.eval_prompt_data:
        own_keys = DataKeys(input_key=dataset.input_key or eval_keys.input_key,
                            label_key=dataset.label_key or eval_keys.label_key,
                            metadata_key=dataset.metadata_key or eval_keys.metadata_key,
                            tool_key=dataset.tool_key or eval_keys.tool_key, multimodal_keys=keys.multimodal_keys)
        problems += data_file_problems(dataset.path, own_keys, f"eval.eval_prompt_data[{dataset.name}]",
                                       skip_bad_lines=rollout.skip_bad_lines, rm_type=rm_type, image_limits=limits)
    return problems


def vision_checkpoint_problems(config: RunConfig) -> list[Problem]:
    """Image prompts (multimodal_keys) need the checkpoint's image processor config and Qwen's vision tokens."""
    if not config.rollout.multimodal_keys or not Path(config.checkpoint.hf_checkpoint).is_dir():
        return []
    from hpc_rl.data.vision_prompts import ImageGrid, VisionPromptError

    try:
        ImageGrid.from_checkpoint(config.checkpoint.hf_checkpoint)
    except (VisionPromptError, KeyError, ValueError) as error:
        return [Problem("rollout.multimodal_keys", "bad_file", f"{error}")]
    return []


def multimodal_config_problems(config: RunConfig) -> list[Problem]:
    """multimodal_keys builds chat messages with image items: the chat template must render them."""
    rollout = config.rollout
    if rollout.multimodal_keys and not rollout.apply_chat_template:
        return [Problem("rollout.multimodal_keys", "needs", "image prompts are chat messages with image items: set "
                                                       "apply_chat_template (slime's --apply-chat-template) too")]
    unknown = sorted(set(rollout.multimodal_keys) - {"image"})
    if unknown:
        return [Problem("rollout.multimodal_keys", "unsupported", f"media kind(s) {', '.join(unknown)} are not served: only "
                                                       "image (slime's video and audio kinds are not offered)")]
    return []
