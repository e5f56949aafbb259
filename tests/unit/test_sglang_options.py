"""SGLang options are checked before anything is queued (issue 9 item 5), and the engine kind is chosen
apart from the device (item 7)."""

from __future__ import annotations

import pytest

from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import (
    PINNED_SGLANG_VERSION,
    engine_kind,
    engine_problems,
    option_problems,
    pinned_options,
)
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_OPTIONS, SglangLaunchSpec, build_sglang_command, sglang_device_options

PINNED = pinned_options()


def test_the_pinned_list_is_sglangs_and_matches_the_pinned_extra(repo_root):
    assert {"--mem-fraction-static", "--cuda-graph-bs-decode", "--enable-memory-saver", "--tp-size"} <= set(PINNED.kinds)
    assert "--cuda-graph-bs" not in PINNED.kinds  # 0.5.23 split it: argparse calls it ambiguous
    assert f"sglang=={PINNED_SGLANG_VERSION}" in (repo_root / "setup.cfg").read_text()


def test_ambiguous_unknown_abbreviated_and_misshapen_options_are_refused():
    problems = option_problems({"cuda_graph": [1], "mem_fraction": 0.7, "enable_memory_saverx": True,
                                "enable_memory_saver": "yes", "mem_fraction_static": [0.7, 0.8]}, PINNED)
    assert "ambiguous" in problems["cuda_graph"] and "--cuda-graph-bs-decode" in problems["cuda_graph"]
    assert "abbreviation of --mem-fraction-static" in problems["mem_fraction"]
    assert "did you mean --enable-memory-saver" in problems["enable_memory_saverx"]
    assert "switch" in problems["enable_memory_saver"]
    assert "one value" in problems["mem_fraction_static"]
    assert option_problems({"mem_fraction_static": 0.7, "enable_memory_saver": True, "sglang_cuda_graph_bs": [1, 2],
                            "cuda_graph_bs": [4]}, PINNED) == {}


def test_slimes_cuda_graph_bs_becomes_the_decode_batch_sizes_on_the_command_line():
    options = sglang_device_options("cuda", {"cuda_graph_bs": [1, 2, 4], "mem_fraction_static": 0.7})
    command = build_sglang_command(SglangLaunchSpec(hf_checkpoint="/m", host="h", port=1, sglang_options=options))
    at = command.index("--cuda-graph-bs-decode")
    assert command[at + 1:at + 4] == ["1", "2", "4"] and "--cuda-graph-bs" not in command


def test_engine_kind_is_separate_from_the_device():
    assert engine_kind("auto", "cuda") == "sglang" and engine_kind("auto", "cpu") == "cpu"
    assert engine_kind("sglang", "cpu") == "sglang" and engine_kind("cpu", "cpu") == "cpu"
    (gloo,) = engine_problems("cpu", "cuda", {})
    assert (gloo.field, gloo.code) == ("rollout.engine", "unsupported") and "gloo" in gloo.message
    (vllm,) = engine_problems("vllm", "cpu", {})
    assert (vllm.field, vllm.code) == ("rollout.engine", "not_one_of") and "must be one of" in vllm.message
    assert engine_problems("cpu", "cpu", {"cuda_graph": 1}) == []  # the CPU engine takes no SGLang options
    (ambiguous,) = engine_problems("sglang", "cpu", {"sglang_cuda_graph": [1]})
    assert (ambiguous.field, ambiguous.code) == ("sglang.sglang_cuda_graph", "unknown_key")
    assert "ambiguous" in ambiguous.message
    assert sglang_device_options("cpu", {"attention_backend": "sdpa"}) == {**SGLANG_ON_CPU_OPTIONS,
                                                                            "attention_backend": "sdpa"}


def test_validation_reports_a_bad_sglang_option_before_submission():
    from hpc_rl.config.validation import collect_problems

    config = RunConfig()
    config.sglang.extra_args = {"cuda_graph": [1, 2]}
    problems = [p for p in collect_problems(config, check_files=False) if p.where.startswith("sglang.")]
    assert problems and "ambiguous" in problems[0].message


@pytest.mark.parametrize("engine,device,expected", [("auto", "cpu", "hpc_rl.engines.cpu"),
                                                     ("sglang", "cpu", "sglang.launch_server"),
                                                     ("auto", "cuda", "sglang.launch_server")])
def test_the_driver_launches_the_chosen_engine(engine, device, expected):
    from hpc_rl.launch.step_plan import engine_command
    from hpc_rl.launch.topology import plan_topology

    config = RunConfig()
    config.rollout.engine, config.cluster.device = engine, device
    config.checkpoint.hf_checkpoint = "/m"
    placement = plan_topology(config.cluster).engines[0]
    command = engine_command(config, placement, "127.0.0.1", 30000)
    assert expected in command
    if expected == "sglang.launch_server" and device == "cpu":
        assert command[command.index("--device") + 1] == "cpu"
