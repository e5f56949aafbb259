"""What reading one sample's /generate answer costs the controller, and what it would cost if token ids
and log-probs passed through unparsed.

The controller's CPU per sample has a floor: the JSON of each answer. This prints, per sample (a GRPO
group of 8 answered in one batched body, SGLang's fields: text, output_ids, meta_info with
finish_reason, weight_version(s), output_token_logprobs as [logprob, token id, null]):

  parse now    orjson.loads + the token list + output_logprobs + parse_weight_versions (generate.py's
               work per answer)
  meta only    msgspec decoding the same body with output_ids and output_token_logprobs kept as raw
               JSON bytes (msgspec.Raw: validated, not turned into objects) and the rest read: what the
               controller would pay if token arrays went to the trainer unparsed
  trainer side those raw bytes to numpy arrays (orjson), the part that would move to the trainer ranks

for a response of `--tokens` wire tokens (3,440: the Qwen3-4B recipe's mean response; 107: what
benchmarks/bench_scale.py sends at its token scale 32).

    python benchmarks/bench_answer_parsing.py [--tokens 107 3440] [--repeat 200]

msgspec is not a dependency of hpc_rl (`pip install msgspec` to print the last two columns).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import orjson  # noqa: E402

from hpc_rl.controller.app import GC_FIRST_GENERATION  # noqa: E402
from hpc_rl.rollout.generate import output_logprobs, parse_weight_versions  # noqa: E402

GROUP = 8


def batched_answer(tokens: int) -> bytes:
    """A batched /generate answer of one group, each sample `tokens` long, SGLang's field layout."""
    samples = []
    for index in range(GROUP):
        ids = [(7919 * (index + 1) * (t + 1)) % 151_000 for t in range(tokens)]
        samples.append({
            "text": "x" * (4 * tokens),
            "output_ids": ids,
            "meta_info": {"id": f"s{index}-0123456789ab", "finish_reason": {"type": "stop", "matched": 151645},
                          "prompt_tokens": 120, "completion_tokens": tokens, "cached_tokens": 96,
                          "weight_version": "3", "weight_versions": [{"version": "3", "start": 0, "end": tokens}],
                          "e2e_latency": 41.5,
                          "output_token_logprobs": [[-0.1 - (t % 97) / 13.0, i, None] for t, i in enumerate(ids)]},
        })
    return orjson.dumps(samples)


def parse_now(body: bytes) -> int:
    count = 0
    for item in orjson.loads(body):
        meta = item.get("meta_info") or {}
        token_ids = list(map(int, item.get("output_ids") or []))
        logprobs = output_logprobs(meta.get("output_token_logprobs") or [])
        versions = parse_weight_versions(meta, len(token_ids), 0)
        count += len(token_ids) + len(logprobs) + len(versions) + len(str(item.get("text") or ""))
    return count


try:
    import msgspec
except ImportError:
    msgspec = None
else:
    class Meta(msgspec.Struct):
        """The meta_info fields the controller reads; the log-probs stay raw JSON bytes."""

        finish_reason: Any = None
        completion_tokens: int = 0
        weight_version: Any = None
        weight_versions: Any = None
        output_token_logprobs: msgspec.Raw = msgspec.Raw(b"[]")

    class Answer(msgspec.Struct):
        """One sample's answer; its token ids stay raw JSON bytes."""

        text: str = ""
        output_ids: msgspec.Raw = msgspec.Raw(b"[]")
        meta_info: Meta = msgspec.field(default_factory=Meta)


def meta_only_decoder() -> Any:
    if msgspec is None:
        raise ImportError("msgspec")
    return msgspec.json.Decoder(list[Answer])


def to_arrays(answers: list[Any]) -> int:
    count = 0
    for answer in answers:
        ids = np.array(orjson.loads(bytes(answer.output_ids)), dtype=np.int64)
        logprobs = np.array([entry[0] for entry in orjson.loads(bytes(answer.meta_info.output_token_logprobs))],
                            dtype=np.float32)
        count += len(ids) + len(logprobs)
    return count


def per_sample_us(fn: Any, arg: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times) / GROUP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[107, 3440])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])  # as the controller runs
    try:
        decoder = meta_only_decoder()
    except ImportError:
        decoder = None
        print("msgspec not installed: `pip install msgspec` for the meta-only columns")
    print(f"{'tokens':>7} {'body kB/sample':>15} {'parse now us':>13} {'meta only us':>13} {'trainer side us':>16}")
    for tokens in args.tokens:
        body = batched_answer(tokens)
        now = per_sample_us(parse_now, body, args.repeat)
        if decoder is not None:
            meta = per_sample_us(decoder.decode, body, args.repeat)
            answers = decoder.decode(body)
            assert answers[0].meta_info.completion_tokens == tokens
            trainer = per_sample_us(to_arrays, answers, args.repeat)
            extra = f"{meta:>13.1f} {trainer:>16.1f}"
        else:
            extra = f"{'-':>13} {'-':>16}"
        print(f"{tokens:>7} {len(body) / GROUP / 1000:>15.1f} {now:>13.1f} {extra}")


if __name__ == "__main__":
    main()
