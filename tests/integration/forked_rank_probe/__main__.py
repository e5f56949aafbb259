"""`-m tests.integration.forked_rank_probe [die MARKER]`: print what this rank inherited, as one JSON line.

With `die`, rank 1 then ends itself with SIGTERM (a rank must die of it, as a spawned one does), once rank 0 has
printed its line (rank 0 creates MARKER after it): otherwise torchrun's agent, seeing rank 1 fail, stops rank 0,
which a loaded machine may not have run as far as its line yet. (A forked rank that returned stays alive until
every rank has, for the agent to read its result: rank 0 waits there, not failed, when rank 1 dies.)"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

RANK0_LINE_WAIT_S = 120.0


def preload() -> None:
    import tests.integration.forked_rank_probe as probe

    probe.preloaded_in = os.getpid()


def main(argv: list[str] | None = None) -> None:
    import tests.integration.forked_rank_probe as probe

    args = sys.argv[1:] if argv is None else argv
    print("PROBE " + json.dumps({"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
                                 "pid": os.getpid(), "parent": os.getppid(), "preloaded_in": probe.preloaded_in,
                                 "argv": args, "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}),
          flush=True)
    if args[:1] == ["die"]:
        marker = Path(args[1])
        if os.environ["RANK"] == "0":
            marker.touch()
        else:
            deadline = time.monotonic() + RANK0_LINE_WAIT_S
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 printed nothing within {RANK0_LINE_WAIT_S:.0f} s ({marker})")
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
