"""Which nodes of a job Slurm reports lost (pure: sinfo's text in, losses out), and `--wait` across a
requeue (a fake watcher standing in for sacct)."""

from __future__ import annotations

from hpc_rl.launch.node_health import NodeLoss, is_lost, lost_nodes, parse_sinfo
from hpc_rl.launch.slurm_submit import RequeueTracker

# sinfo -h -N -o '%N|%T|%E' on the local cluster, 15 s and 25 s after node3's slurmd was killed
NOT_ANSWERING = "node1|mixed|none\nnode1|mixed|none\nnode3|mixed*|none\nnode3|mixed*|none\n"
DOWN = "node1|idle|none\nnode3|down*|Not responding\nnode3|down*|Not responding\n"


def test_a_node_that_does_not_answer_is_lost_before_slurm_marks_it_down() -> None:
    assert lost_nodes(parse_sinfo(NOT_ANSWERING)) == [NodeLoss("node3", "mixed*", "")]
    assert lost_nodes(parse_sinfo(DOWN)) == [NodeLoss("node3", "down*", "Not responding")]


def test_states_that_are_lost_and_states_that_are_not() -> None:
    for state in ("down", "down*", "drained", "draining", "fail", "failing", "idle*", "allocated*"):
        assert is_lost(state), state
    for state in ("idle", "mixed", "allocated", "completing", "planned", "reserved"):
        assert not is_lost(state), state


def test_the_message_names_the_node_its_state_and_what_ran_there() -> None:
    loss = NodeLoss("node3", "down*", "Not responding")
    assert loss.describe(["engine-0"]) == "node node3 is lost (Slurm state down*, reason: Not responding); it ran engine-0"


class FakeWatcher:
    """sacct's answers in order (the last one repeats)."""

    def __init__(self, states: list[str]) -> None:
        self.states = states

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


class FakeJob:
    job_id = "7"

    def __init__(self, states: list[str]) -> None:
        self.watcher = FakeWatcher(states)


def test_a_requeued_job_is_waited_for_until_slurm_says_it_ended() -> None:
    # the first attempt's result file exists; Slurm requeued the job (a node died) and runs it again
    tracker = RequeueTracker(FakeJob(["PENDING", "RUNNING", "COMPLETING", "COMPLETED"]))  # type: ignore[arg-type]
    assert [tracker.still_going() for _ in range(4)] == [True, True, True, False]


def test_a_job_that_was_never_requeued_ends_with_its_result_file() -> None:
    tracker = RequeueTracker(FakeJob(["RUNNING"]))  # type: ignore[arg-type]
    assert tracker.still_going() is False
