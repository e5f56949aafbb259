"""Rollout engines: SGLang's launch wrapper, hpc_rl's CPU engine (SGLang's HTTP API on torch), router.

Modules: `sglang_launch` (pure command/env rendering), `engine_process` (CpuEngineProcess,
SglangEngineProcess), `router` (RouterProcess) (their processes: `hpc_rl.process.child_process`),
`cpu/` (the CPU engine; it reads weight buckets with `hpc_rl.weights.bucket_layout`, the wire format
the trainer writes).
The only part of hpc_rl that knows SGLang's server; nothing here imports Megatron.
"""

API_KEY_ENV = "HPC_RL_ENGINE_API_KEY"
"""Environment variable that hands the job's engine key to the CPU engine and to the router launcher:
unlike argv, another user cannot read a process's environment (`ps` shows argv)."""
