"""Rollout engines: SGLang's launch wrapper, hpc_rl's CPU engine (SGLang's HTTP API on torch), router.

Modules: `sglang_launch` (pure command/env rendering), `engine_process` (CpuEngineProcess,
SglangEngineProcess), `router` (RouterProcess), `child_process` (process groups, logs, ports),
`bucket_layout` (flattened weight buckets, shared with the trainer), `cpu/` (the CPU engine).
The only part of hpc_rl that knows SGLang's server; nothing here imports Megatron.
"""

API_KEY_ENV = "HPC_RL_ENGINE_API_KEY"
"""Environment variable that hands the job's engine key to the CPU engine and to the router launcher:
unlike argv, another user cannot read a process's environment (`ps` shows argv)."""
