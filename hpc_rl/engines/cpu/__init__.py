"""hpc_rl's CPU engine: SGLang's HTTP API served by a transformers model on torch CPU.

`python -m hpc_rl.engines.cpu --model-path DIR --host 127.0.0.1 --port P` runs it. It exists so that
every code path above the engine (controller, router, weight sync) runs unchanged on a laptop and
in CI; on GPU nodes hpc_rl launches real SGLang (`hpc_rl.engines.sglang_launch`).
Modules: `server` (HTTP), `scheduler` (batching thread), `kv_batch` (KV cache and model calls),
`sampling` (pure), `requests` (request/response shapes), `weight_sync` (weight loading).

It fails where SGLang 0.5.23 fails (tests/integration/test_engine_conformance.py runs the same checks on
both): over-context requests are 400s, and an out-of-vocabulary input id ends the process (exit 1) as it
ends SGLang's, rather than a 400 that SGLang would never give: a client that sends such ids must see the
engine die here too (and a dead scheduler never leaves /health answering 200 while requests hang).
Known differences that remain: `cached_tokens` is always 0 (no prefix cache: every prompt is prefilled);
`n` > 1 and a streamed batch are refused (400); `meta_info` lacks
SGLang's `cached_tokens_details`, `dp_rank`, `num_retractions`, `output_token_logprobs_length`,
`reasoning_tokens`, `response_sent_to_client_ts`; schema errors are not SGLang's exact texts.
"""
