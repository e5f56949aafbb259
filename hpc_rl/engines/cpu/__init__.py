"""hpc_rl's CPU engine: SGLang's HTTP API served by a transformers model on torch CPU.

`python -m hpc_rl.engines.cpu --model-path DIR --host 127.0.0.1 --port P` runs it. It exists so that
every code path above the engine (controller, router, weight sync) runs unchanged on a laptop and
in CI; on GPU nodes hpc_rl launches real SGLang (`hpc_rl.engines.sglang_launch`).
Modules: `server` (HTTP), `scheduler` (batching thread), `kv_batch` (KV cache and model calls),
`sampling` (pure), `requests` (request/response shapes), `weight_sync` (weight loading).
"""
