"""The driver's logging leaves the application's root handlers alone and logs hpc_rl's records to the run dir."""

from __future__ import annotations

import logging

from hpc_rl.launch.driver import setup_logging


def test_root_handlers_are_kept_and_hpc_rl_logs_to_the_run_dir(tmp_path) -> None:
    root = logging.getLogger()
    users_handler = logging.NullHandler()  # what an application embedding hpc_rl set up
    root.addHandler(users_handler)
    package = logging.getLogger("hpc_rl")
    try:
        before = list(root.handlers)
        setup_logging(tmp_path, "INFO")
        setup_logging(tmp_path, "INFO")  # twice: still one file handler
        assert root.handlers == before
        logging.getLogger("hpc_rl.driver").info("hello from the driver")
        ours = [h for h in package.handlers if getattr(h, "hpc_rl_run_log", False)]
        assert len(ours) == 2
        for handler in ours:
            handler.flush()
        assert "hello from the driver" in (tmp_path / "logs" / "controller.log").read_text()
    finally:
        root.removeHandler(users_handler)
        for handler in [h for h in package.handlers if getattr(h, "hpc_rl_run_log", False)]:
            package.removeHandler(handler)
            handler.close()
        package.setLevel(logging.NOTSET)
