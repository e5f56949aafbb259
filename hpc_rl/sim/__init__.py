"""Simulated SGLang engines, for showing the controller, router and scheduler at cluster scale.

Owns: a GPU engine's timing model (`model`: prefill per token, decode step vs running batch, response
lengths, rewards, control-call costs, the time scale), the continuous-batching state of one simulated
engine (`engine`), SGLang's HTTP API served for many engines by one process (`server`, `__main__`), and
the stand-in trainer that answers the controller's commands with a fixed time per sample (`trainer`).

Nothing here imports torch or transformers: a process of 1,024 simulated engines must start in a second.
The engines are real HTTP servers and the router, controller and scheduler in front of them are the
real ones; only the GPU is simulated. Used by benchmarks/bench_scale.py; see docs/scaling.md.
"""
