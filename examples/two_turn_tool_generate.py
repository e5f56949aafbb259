"""A custom generate function with one tool call: model turn -> tool output -> model turn.

Use it with
    rollout:
      custom_generate_function_path: examples/two_turn_tool_generate.py:generate

The signature is slime's: `async def generate(args, sample, sampling_params) -> Sample`.
- `args` is the flat plug-in namespace (`hpc_rl.config.plugin_args`); this example reads
  `args.hf_checkpoint` for the tokenizer.
- `sampling_params` holds the SGLang sampling params; `max_new_tokens` is the budget of the WHOLE
  response (model turns + tool output), and `generate_turn` enforces it across turns.
- Model turns go through `hpc_rl.rollout.generate_turn(sample, params)`: it sends prompt + everything
  so far, appends tokens/logprobs/weight versions, survives engine deaths and weight-update pauses,
  and stops when the rollout aborts (then return the sample as it is: it is resumed later).
- Tool output goes through `append_tool_tokens(sample, ids, text)`: loss_mask 0, logprob 0.

The tool here is a calculator for the tiny model's vocabulary ("add 3 + 4"): a real model would
emit a structured call (e.g. `<tool_call>{...}</tool_call>`) in turn 1 and you would parse it; the
tiny random model emits noise, so this tool reads its arguments from the prompt.

Run it by hand on the CPU engine:
    python examples/two_turn_tool_generate.py --model-path assets/tiny_qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
from typing import Any

from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout import append_tool_tokens, generate_turn

FIRST_TURN_TOKENS = 4
"""The model's first turn (its "tool call") is at most this many tokens."""


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def calculator(prompt: str) -> str:
    """The tool: sums the numbers named in the prompt."""
    numbers = [int(n) for n in re.findall(r"\d+", prompt)]
    return f"answer : {sum(numbers) % 10}"


def _prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    return prompt if isinstance(prompt, str) else " ".join(str(m["content"]) for m in prompt)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Turn 1 (tool call) -> calculator output (not trained) -> turn 2 (the answer)."""
    tokenizer = _tokenizer(args.hf_checkpoint)
    # Resumed partial samples (partial rollout) restart at the turn they were in.
    tool_done = sample.metadata.get("tool_done", False)
    if not tool_done:
        call_budget = sample.response_length + FIRST_TURN_TOKENS
        params = {**sampling_params, "max_new_tokens": min(sampling_params["max_new_tokens"], call_budget)}
        await generate_turn(sample, params)
        if sample.status in (SampleStatus.ABORTED, SampleStatus.FAILED):
            return sample
        text = f" <|im_end|> <|im_start|> user {calculator(_prompt_text(sample.prompt))} <|im_end|> <|im_start|> assistant "
        append_tool_tokens(sample, tokenizer(text, add_special_tokens=False)["input_ids"], text)
        sample.metadata["tool_done"] = True
    return await generate_turn(sample, sampling_params)


async def _demo(model_path: str, prompts: list[str]) -> None:
    import tempfile
    from types import SimpleNamespace

    from hpc_rl.data.prompts import make_prompt_encoder
    from hpc_rl.engines.engine_process import CpuEngineProcess
    from hpc_rl.rollout import EngineClient, GenerationSession, StaticEngineDirectory
    from hpc_rl.rollout.generate import run_generate

    with tempfile.TemporaryDirectory() as tmp, CpuEngineProcess(model_path, log_path=f"{tmp}/engine.log") as engine:
        engine.wait_healthy(timeout=120)
        async with EngineClient(StaticEngineDirectory([engine.url])) as client:
            session = GenerationSession(client)
            tokenizer = _tokenizer(model_path)
            args = SimpleNamespace(hf_checkpoint=model_path)
            encode = make_prompt_encoder(tokenizer, apply_chat_template=True)
            samples = [Sample(index=i, group_index=i, prompt=p, prompt_token_ids=encode(p, {}))
                       for i, p in enumerate(prompts)]
            params = {"max_new_tokens": 24, "temperature": 1.0}
            for sample in await asyncio.gather(*(run_generate(generate, args, s, params, session) for s in samples)):
                print(f"[{sample.status.value}] {sample.prompt!r} -> {sample.response_text!r}")
                print(f"    loss_mask={sample.loss_mask} {sample.metadata.get('error', '')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    cli = parser.parse_args()
    asyncio.run(_demo(cli.model_path, ["add 3 + 4", "add 1 + 8"]))
