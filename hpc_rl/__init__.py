"""hpc_rl: reinforcement-learning post-training of LLMs on Slurm, without Ray.

Subpackages own one concern each (see DESIGN.md in the shared notes):
config, data, protocol, controller, rollout, rewards, engines, training, weights, launch, telemetry.
"""

__version__ = "0.1.0"
