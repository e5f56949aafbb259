"""The CPU engine's hold gate (`faults.HOLD_GENERATION`), which tests use to keep requests in flight at a moment
they choose: while its file exists the scheduler decodes nothing, an abort still ends the held request with its
partial output, and once the file is gone generation goes on where it stopped. Unset, the scheduler never looks."""

from __future__ import annotations

import pytest

from hpc_rl.engines.cpu.faults import HOLD_GENERATION, generation_hold
from hpc_rl.engines.cpu.scheduler import Scheduler
from tests.unit.test_in_place_updates import LENGTH, drive, model, seeded_request, tokenizer  # noqa: F401 - fixtures


def test_unset_there_is_no_gate() -> None:
    assert generation_hold({}) is None and generation_hold({HOLD_GENERATION: ""}) is None


def test_a_held_request_decodes_nothing_until_the_file_goes_and_an_abort_ends_a_held_one(
        model, tokenizer, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "hold"
    monkeypatch.setenv(HOLD_GENERATION, str(gate))
    scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="0")
    held = scheduler.submit(seeded_request("held"))
    scheduler.run_iteration()
    scheduler.run_iteration()
    (request,) = scheduler._running
    before = len(request.output_ids)
    gate.touch()
    aborted = scheduler.submit(seeded_request("aborted"))
    for _ in range(5):
        assert not scheduler.run_iteration()  # nothing runs while the gate is open
    assert len(request.output_ids) == before and not held.done() and not aborted.done()

    scheduler.call(lambda: scheduler.abort("aborted", abort_all=False))
    scheduler.run_iteration()
    assert aborted.result()["meta_info"]["finish_reason"]["type"] == "abort" and not held.done()

    gate.unlink()
    response = drive(scheduler, held)
    assert len(response["output_ids"]) == LENGTH  # went on from where it was held, nothing lost
