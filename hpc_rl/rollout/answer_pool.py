"""/generate answer bodies parsed in worker processes, into compact token arrays (`rollout.answer_parse_workers`).

Owns `compact_answers(raw)` (the parse: JSON to SGLang's answer dicts, with each answer's `output_ids` an
`array('q')` and `meta_info.output_token_logprobs` an `array('d')` of the output tokens' log-probs) and
`AnswerPool`, the processes that run it for the controller's `EngineClient`.

Why: at full response length (a median 2,500 tokens, 144 kB of JSON per sample with log-probs) parsing the
answers was most of the coordinating process's CPU (bench_scale, N=64, token scale 1: orjson.loads ~1.8
and the log-probs ~0.5 of ~5 CPU s per 1,000 samples, profiled). A worker parses the body and sends back
two flat arrays per sample (~55 kB of machine numbers), which the controller turns into the sample's
lists in C (`array.tolist`). What a run does is unchanged: same tokens, same float64 log-probs (a JSON
integer log-prob comes back as the equal float), same fields; an answer whose token ids or log-probs are
not plain numbers keeps its lists, so generate.py's handling of malformed answers applies as before.

Bodies below `inline_below` bytes (short answers, the tiny test model) are parsed on the loop: the trip
to a worker costs more than they do. The bytes travel over local pipes between processes of one job
(multiprocessing, spawned workers), not the network; exceptions come back as text.

Does not own: the HTTP exchange (engine_client.py), what an answer means (generate.py).
"""

from __future__ import annotations

import gc
import logging
from array import array
from concurrent.futures.process import BrokenProcessPool
from operator import itemgetter
from typing import Any

import orjson

from hpc_rl.process.spawned_pool import SpawnedWorkers

log = logging.getLogger(__name__)

COLLECT_EVERY = 1024
"""A worker's full GC collection every this many bodies (its automatic GC is off)."""
INLINE_BELOW = 32 * 1024
"""Default size (bytes) under which a body is parsed on the loop (a full-length answer is ~144 kB)."""


class AnswerNotJSON(ValueError):
    """The body is not JSON; the message is orjson's."""


def _compact(item: Any) -> None:
    """Replace one answer dict's per-token lists by arrays, in place (kept as lists when not plain numbers)."""
    if not isinstance(item, dict):
        return
    ids = item.get("output_ids")
    if isinstance(ids, list):
        try:
            item["output_ids"] = array("q", ids)
        except (TypeError, OverflowError):
            pass
    meta = item.get("meta_info")
    entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if isinstance(entries, list):
        try:
            meta["output_token_logprobs"] = array("d", map(itemgetter(0), entries))
        except (TypeError, IndexError, KeyError):
            pass  # None or a malformed entry: generate.output_logprobs reads the lists


def compact_answers(raw: bytes) -> tuple[bool, Any]:
    """Run in a worker (or inline): (True, the parsed body with compact token arrays) or (False, orjson's
    message) for a body that is not JSON. A batched answer (a list) has each of its dicts compacted."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        return False, str(error)
    for item in body if isinstance(body, list) else (body,):
        _compact(item)
    return True, body


_parsed_here = 0


def _parse_in_worker(raw: bytes) -> tuple[bool, Any]:
    """`compact_answers` in a worker, whose cyclic GC is off (`_init_worker`): a parsed body is a tree, freed
    by reference counting once sent; a full collection every `COLLECT_EVERY` bodies catches anything else."""
    global _parsed_here
    _parsed_here += 1
    if _parsed_here % COLLECT_EVERY == 0:
        gc.collect()
    return compact_answers(raw)


def _init_worker() -> None:
    """Cyclic GC off in the worker: with it on, the parse of a full-length answer (~10k lists) ran gen-0
    collections over the half-built body, 2.5x the parse's own CPU (1,250 vs 500 us per sample measured)."""
    gc.disable()


def _warm_up() -> None:
    """Nothing to load: starts the worker process before the first answer needs it."""


class AnswerPool:
    """`workers` processes parsing /generate answers; `await parse(raw)` per answer body."""

    def __init__(self, workers: int, *, inline_below: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"rollout.answer_parse_workers: an answer pool needs at least one worker, got {workers}")
        self.workers = workers
        self.inline_below = INLINE_BELOW if inline_below is None else inline_below
        """Bodies shorter than this (bytes) are parsed on the loop (None: the module's `INLINE_BELOW`)."""
        self.parsed_in_workers = 0
        """Bodies parsed by a worker (the rest were parsed on the loop)."""
        self._workers = SpawnedWorkers(workers, warm_up=_warm_up, initializer=_init_worker)

    async def start(self) -> None:
        """Start every worker (a spawned interpreter with orjson: well under a second)."""
        await self._workers.start()

    async def parse(self, raw: bytes) -> Any:
        """The answer body, with compact token arrays; AnswerNotJSON if it is not JSON. A worker that died
        (killed, out of memory) is replaced and the body parsed again on the loop."""
        if len(raw) < self.inline_below:
            ok, value = compact_answers(raw)
        else:
            try:
                ok, value = await self._workers.run(_parse_in_worker, raw)
                self.parsed_in_workers += 1
            except BrokenProcessPool as error:
                log.warning("an answer-parsing worker died (%s); starting the pool again, this answer parsed "
                            "on the loop", error)
                self.close()
                ok, value = compact_answers(raw)
        if not ok:
            raise AnswerNotJSON(value)
        return value

    def close(self) -> None:
        """Stop the workers now (an answer being parsed is abandoned: its request fails as a transport error)."""
        self._workers.close()
