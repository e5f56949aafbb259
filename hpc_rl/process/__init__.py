"""Child processes every part of hpc_rl starts or is: process groups with a log file, stopping them without
orphans, free ports, and how a clean child exits (`child_process`). Engines, the trainer and launch import it;
it imports only `protocol` (tier 0: what every process shares)."""
