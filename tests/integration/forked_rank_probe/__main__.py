"""`-m tests.integration.forked_rank_probe [die]`: print what this rank inherited, as one JSON line.

With `die`, rank 1 then ends itself with SIGTERM (a rank must die of it, as a spawned one does)."""

from __future__ import annotations

import json
import os
import signal
import sys


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
    if args[:1] == ["die"] and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
