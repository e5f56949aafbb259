"""torchrun entry of a trainer rank: `python -m hpc_rl.training [CONFIG] [--batches-file F]`.

    torchrun --nproc-per-node 2 -m hpc_rl.training run_dir/config.resolved.yaml          # with a controller
    torchrun --nproc-per-node 1 -m hpc_rl.training cfg.yaml --batches-file rollouts.jsonl # without one

CONFIG is a resolved config file or run dir (default: $HPC_RL_CONFIG). Reads it, joins the trainer
world (gloo on CPU), builds actor and reference model (resuming from `checkpoint.load` when it
holds a checkpoint), then runs the command loop: commands come from the controller (address in
$HPC_RL_CONTROLLER) or, with --batches-file, from a JSONL of rollouts. Rank 0 writes TensorBoard
scalars to `logging.tensorboard_dir` (default <run_dir>/tensorboard).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from pathlib import Path

CONFIG_ENV = "HPC_RL_CONFIG"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.training", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=os.environ.get(CONFIG_ENV), help=f"(default: ${CONFIG_ENV})")
    parser.add_argument("--batches-file", help="JSONL, one rollout per line: {\"samples\": [...]}")
    parser.add_argument("--num-rollouts", type=int, default=None, help="with --batches-file: stop after this many")
    args = parser.parse_args(argv)
    if not args.config:
        parser.error(f"no config: pass the resolved config path or set {CONFIG_ENV}")
    # force: a rank forked from a preloaded launcher (preload) inherits the launcher's root handlers
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s", force=True)
    preload()
    from hpc_rl.config.loading import load_resolved_config
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.plugin_args import plugin_args
    from hpc_rl.process.startup_gc import freeze_startup_objects
    from hpc_rl.telemetry.scalars import ScalarLog, tensorboard_dir
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.commands import BatchFileCommands, JsonlBatchSource, TrainerCommands
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    config = load_resolved_config(args.config)
    arch = ModelArchitecture.from_yaml(config.model)
    info = init_parallel(config.training, device=config.cluster.device)
    parts = build_trainer(arch=arch, training=config.training, algorithm=config.algorithm,
                          optimizer_config=config.optimizer, checkpoints=config.checkpoint, info=info,
                          model_file=config.model, plugin_args=plugin_args(config),
                          distillation=config.distillation, critic=config.critic, lora=config.lora)
    config_path = Path(args.config).resolve()
    run_dir = Path(config.run_dir) if config.run_dir else (config_path if config_path.is_dir() else config_path.parent)
    save_dir = config.checkpoint.save or str(run_dir / "checkpoints")
    engine_key = None
    resumed = parts.resumed
    if args.batches_file:
        start = resumed.rollout_id + 1 if resumed else 0
        source = BatchFileCommands(JsonlBatchSource(args.batches_file, dp_rank=info.dp_rank, dp_size=info.dp_size),
                                   start_rollout=start, num_rollouts=args.num_rollouts, save_dir=save_dir,
                                   save_interval=config.checkpoint.save_interval)
    else:
        from hpc_rl.training.controller_link import ControllerLink

        from hpc_rl.protocol.messages import ResumeState

        from hpc_rl.weights.device_identity import trainer_rank_device

        # the device: the controller pairs colocated ranks with the engine on the same GPU by it
        hello = {"tp_rank": info.tp_rank, "tp_size": info.tp_size, "dp_rank": info.dp_rank, "dp_size": info.dp_size,
                 "device": trainer_rank_device()}
        resume = (ResumeState(rank=0, rollout_id=resumed.rollout_id, controller_state=resumed.controller_state)
                  if info.rank == 0 and resumed is not None else None)
        source = ControllerLink(run_dir, rank=info.rank, world_size=info.world_size, info=hello, resume=resume)
        engine_key = _engine_key(run_dir)
        from hpc_rl.training.term_deferral import defer_sigterm_in_slurm_step

        defer_sigterm_in_slurm_step()  # scancel/preemption: the controller may still save with us
    tensorboard = tensorboard_dir(config, run_dir)
    scalars = ScalarLog(tensorboard if info.rank == 0 else None, filename_suffix=".trainer")
    freeze_startup_objects()  # a full GC no longer walks torch, Megatron and the model (process.startup_gc)
    try:
        TrainerCommands(parts, arch=arch, info=info, source=source, save_dir=save_dir, scalars=scalars,
                        engine_api_key=engine_key, offload_train=config.training.offload_train,
                        train_memory_margin_bytes=config.training.train_memory_margin_bytes,
                        checkpoint_config=config.checkpoint, keep_last=config.checkpoint.keep_last,
                        max_nonfinite_steps=config.training.max_nonfinite_steps).run()
    finally:
        scalars.close()
        shutdown_parallel()


TRAINER_MODULES = ("hpc_rl.config.loading", "hpc_rl.config.model", "hpc_rl.config.plugin_args",
                   "hpc_rl.telemetry.scalars", "hpc_rl.training.actor", "hpc_rl.training.commands",
                   "hpc_rl.training.parallel", "hpc_rl.training.controller_link")
"""What a rank imports before it builds anything (torch and Megatron-core among them: seconds of CPU)."""


def preload() -> None:
    """Import TRAINER_MODULES (Megatron the light way on CPU: `light_megatron_import`, issue 11); at once
    when already imported. A launcher that calls this and then forks its ranks (`hpc_rl.launch.bound_torchrun
    --fork-preloaded-ranks`) saves each rank its own imports (issue 23)."""
    from hpc_rl.training.cpu_switch import light_megatron_import

    with light_megatron_import():
        for module in TRAINER_MODULES:
            importlib.import_module(module)


def _engine_key(run_dir: Path) -> str:
    """The job's engine key (colocated ranks post weights to their engine), derived from the job secret."""
    from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path

    return engine_api_key(load_secret(secret_path(run_dir)))


if __name__ == "__main__":
    main()
    __import__("hpc_rl.process.child_process").process.child_process.exit_without_teardown(0)  # ~5 s sooner
