"""The controller: one asyncio process that owns the RL loop (rollouts, training batches, weight syncs,
checkpoints, stopping) and talks to the router, the engines and the trainer ranks. It imports no torch."""
