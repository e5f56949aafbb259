"""Unit tests of the engines' pure parts: bucket layout, sampling params, SGLang/router commands."""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

from hpc_rl.weights.bucket_layout import (
    compute_layout,
    dtype_from_name,
    order_for_alignment,
    pack_bucket,
    unpack_bucket,
)
from hpc_rl.engines.cpu.sampling import (
    SamplingParams,
    find_stop_string,
    parse_sampling_params,
    sample_next_tokens,
)
from hpc_rl.engines import API_KEY_ENV
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.engines.router import RouterProcess, build_router_command
from hpc_rl.engines.sglang_launch import (
    SglangLaunchSpec,
    build_sglang_command,
    build_sglang_env,
    write_api_key_file,
)


# ---- bucket layout ---------------------------------------------------------------------------------
def test_layout_offsets_are_cumulative_like_sglang():
    layout = compute_layout(["a", "b", "c"], ["float32", "bfloat16", "bfloat16"], [[2, 3], [5], [1]])
    assert [slot.offset for slot in layout.slots] == [0, 24, 34]
    assert layout.total_bytes == 36
    assert layout.request_fields() == {
        "names": ["a", "b", "c"], "dtypes": ["float32", "bfloat16", "bfloat16"], "shapes": [[2, 3], [5], [1]],
    }


def test_layout_refuses_misaligned_tensor():
    with pytest.raises(ValueError, match="order_for_alignment"):
        compute_layout(["small", "big"], ["bfloat16", "float32"], [[3], [2]])


def test_pack_unpack_roundtrip_mixed_dtypes_and_buffer_reuse():
    named = [("h", torch.randn(3, dtype=torch.bfloat16)), ("f", torch.randn(2, 5)),
             ("i", torch.arange(7, dtype=torch.int64)), ("e", torch.randn(0))]
    ordered = order_for_alignment(named)
    assert [name for name, _ in ordered] == ["i", "f", "e", "h"]
    reusable = torch.empty(1024, dtype=torch.uint8)
    buffer, layout = pack_bucket(ordered, out=reusable)
    assert buffer.data_ptr() == reusable.data_ptr() and buffer.numel() == layout.total_bytes
    receiver = compute_layout(**{k: v for k, v in zip(("names", "dtypes", "shapes"),
                                                      layout.request_fields().values())})
    for (name, original), (got_name, got) in zip(ordered, unpack_bucket(buffer.clone(), receiver)):
        assert name == got_name and got.dtype == original.dtype and torch.equal(got, original)


def test_dtype_names():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_name("float7")


# ---- sampling ---------------------------------------------------------------------------------------
def test_sampling_params_validation():
    params = parse_sampling_params({"max_new_tokens": 4, "temperature": 0, "stop": "x", "n": 1,
                                    "skip_special_tokens": False, "frequency_penalty": 0.0})
    assert params.greedy and params.stop == ["x"] and params.max_new_tokens == 4
    with pytest.raises(ValueError, match="unknown sampling_params key"):
        parse_sampling_params({"temprature": 1.0})
    with pytest.raises(ValueError, match="top_p"):
        parse_sampling_params({"top_p": 0})
    with pytest.raises(ValueError, match="not supported"):
        parse_sampling_params({"repetition_penalty": 1.2})


def test_logprobs_are_tempered_by_default_and_raw_with_sglang_env(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(2, 11)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    tokens, logprobs = sample_next_tokens(logits, params, [None, None], [[], []])
    expected = torch.log_softmax(logits[0] / 0.5, -1)[tokens[0]]
    assert torch.allclose(logprobs[0], expected)
    assert tokens[1] == logits[1].argmax()
    assert torch.allclose(logprobs[1], torch.log_softmax(logits[1], -1)[tokens[1]])
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    tokens, logprobs = sample_next_tokens(logits, params, [None, None], [[], []])
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]])


def test_top_k_top_p_restrict_support_and_seed_is_reproducible():
    logits = torch.tensor([[5.0, 4.0, 3.0, -9.0, -9.0]])
    params = SamplingParams(top_k=2, sampling_seed=7)
    seen = set()
    for _ in range(50):
        generator = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
        token, _ = sample_next_tokens(logits, [params], [generator], [[]])
        seen.add(int(token))
    assert seen <= {0, 1}
    first = [int(sample_next_tokens(logits, [SamplingParams()], [torch.Generator().manual_seed(3)], [[]])[0])
             for _ in range(3)]
    assert len(set(first)) == 1
    only_top = SamplingParams(top_p=0.5)
    assert all(int(sample_next_tokens(logits, [only_top], [None], [[]])[0]) == 0 for _ in range(20))


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[9.0, 0.0, 0.0]])
    token, logprob = sample_next_tokens(logits, [SamplingParams(temperature=0)], [None], [[0]])
    assert int(token) != 0 and torch.isfinite(logprob).all()


def test_find_stop_string_returns_earliest():
    assert find_stop_string("a b = 3 : 4", ["4", "="]) == ("=", 4)
    assert find_stop_string("abc", ["x", ""]) is None


# ---- commands ---------------------------------------------------------------------------------------
def test_sglang_command_renders_every_option():
    spec = SglangLaunchSpec(
        hf_checkpoint="/ckpt/qwen3", host="10.0.0.5", port=15000, rollout_num_gpus_per_engine=4, api_key="s3",
        sglang_options={"mem_fraction_static": 0.7, "cuda_graph_bs": [1, 2, 4], "enable_memory_saver": True,
                        "sglang_disable_radix_cache": False, "json_model_override_args": {"a": 1},
                        "log_level": None},
        python="python",
    )
    assert build_sglang_command(spec) == [
        "python", "-m", "sglang.launch_server", "--model-path", "/ckpt/qwen3", "--tp-size", "4",
        "--host", "10.0.0.5", "--port", "15000", "--api-key", "s3",
        "--cuda-graph-bs", "1", "2", "4", "--enable-memory-saver", "--json-model-override-args", '{"a": 1}',
        "--mem-fraction-static", "0.7",
    ]


def test_sglang_command_rejects_overriding_hpc_rl_flags():
    with pytest.raises(ValueError, match="set by hpc_rl"):
        SglangLaunchSpec(hf_checkpoint="/c", host="h", port=1, sglang_options={"sglang_tp_size": 2})


def test_sglang_env():
    env = build_sglang_env({"PATH": "/bin", "NCCL_CUMEM_ENABLE": "1"}, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["PATH"] == "/bin" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_router_command():
    command = build_router_command(host="127.0.0.1", port=3000, prometheus_port=3001, policy="round_robin",
                                   worker_urls=["http://a:1"], python="python")
    assert command == [
        "python", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "3000",
        "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", "3001",
        "--disable-retries", "--log-level", "warn", "--worker-urls", "http://a:1",
    ]
    with pytest.raises(ValueError):
        build_router_command(host="h", port=1, prometheus_port=2, policy="fastest")


# ---- the engine key stays off command lines ------------------------------------------------------------
KEY = "f00d" * 16


def test_cpu_engine_gets_its_key_in_the_environment(tmp_path):
    engine = CpuEngineProcess("/m", log_path=tmp_path / "e.log", port=1234, api_key=KEY,
                              env={"PATH": "/bin", API_KEY_ENV: "inherited"})
    assert not any(KEY in word for word in engine.process.command)
    assert engine.process.env is not None and engine.process.env[API_KEY_ENV] == KEY
    open_engine = CpuEngineProcess("/m", log_path=tmp_path / "e.log", port=1234, env={API_KEY_ENV: "inherited"})
    assert open_engine.process.env is not None and API_KEY_ENV not in open_engine.process.env


def test_cpu_engine_reads_the_key_from_the_environment():
    from hpc_rl.engines.cpu.__main__ import build_parser, resolve_api_key

    parse = build_parser().parse_args
    assert resolve_api_key(parse(["--model-path", "/m"]), {API_KEY_ENV: KEY}) == KEY
    assert resolve_api_key(parse(["--model-path", "/m"]), {API_KEY_ENV: ""}) is None
    assert resolve_api_key(parse(["--model-path", "/m", "--api-key", "flag"]), {API_KEY_ENV: KEY}) == "flag"


def test_sglang_key_goes_in_a_private_config_file(tmp_path):
    path = tmp_path / "sglang_api_key.yaml"
    write_api_key_file(path, KEY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == f'api-key: "{KEY}"\n'  # SGLang's --config turns key `api-key` into --api-key
    spec = SglangLaunchSpec(hf_checkpoint="/c", host="h", port=1, api_key_file=str(path), python="python")
    command = build_sglang_command(spec)
    assert command[-2:] == ["--config", str(path)] and not any(KEY in word for word in command)
    with pytest.raises(ValueError, match="set by hpc_rl"):
        SglangLaunchSpec(hf_checkpoint="/c", host="h", port=1, sglang_options={"config": "/mine.yaml"})


def test_router_with_a_key_runs_through_the_env_launcher(tmp_path, monkeypatch):
    router = RouterProcess(log_path=tmp_path / "r.log", port=3000, prometheus_port=3001, api_key=KEY)
    command = router.process.command
    assert command[1:3] == ["-m", "hpc_rl.engines.router"] and not any(KEY in word for word in command)
    assert router.process.env is not None and router.process.env[API_KEY_ENV] == KEY
    plain = RouterProcess(log_path=tmp_path / "r.log", port=3000, prometheus_port=3001)
    assert plain.process.command[1:3] == ["-m", "sglang_router.launch_router"]

    import sglang_router.router as rust_router_module

    from hpc_rl.engines import router as router_module

    launched = []

    class FakeRouter:  # stands in for the Rust router: records the args it would have started with
        def __init__(self, args) -> None:
            self.args = args

        def start(self) -> None:
            launched.append(self.args)

    monkeypatch.setattr(rust_router_module.Router, "from_args", staticmethod(FakeRouter))
    monkeypatch.setenv(API_KEY_ENV, KEY)
    router_module.main(command[3:])
    (args,) = launched
    assert args.api_key == KEY and args.port == 3000 and args.disable_retries


def test_driver_engine_commands_carry_no_key(tmp_path):
    from hpc_rl.config import load_config
    from hpc_rl.launch.step_plan import engine_command, sglang_api_key_path
    from hpc_rl.launch.topology import plan_topology

    config = load_config(["configs/tiny_cpu.yaml"])
    config.run_dir = str(tmp_path)
    placement = plan_topology(config.cluster).engines[0]
    cpu = engine_command(config, placement, "127.0.0.1", 5000)
    assert cpu[:3] == [sys.executable, "-m", "hpc_rl.engines.cpu"] and "--api-key" not in cpu
    config.cluster.device = "cuda"
    gpu = engine_command(config, placement, "10.0.0.1", 5000)
    assert "--api-key" not in gpu and gpu[gpu.index("--config") + 1] == str(tmp_path / "sglang_api_key.yaml")
    assert sglang_api_key_path(config) == tmp_path / "sglang_api_key.yaml"
    assert os.path.basename(gpu[gpu.index("--config") + 1]).endswith(".yaml")  # SGLang insists


def test_colocated_sglang_engine_gets_the_memory_saver_once():
    spec = SglangLaunchSpec(hf_checkpoint="/m", host="h", port=1234, colocated=True)
    assert build_sglang_command(spec)[-1] == "--enable-memory-saver"
    spec = SglangLaunchSpec(hf_checkpoint="/m", host="h", port=1234, colocated=True,
                            sglang_options={"enable_memory_saver": True})
    assert build_sglang_command(spec).count("--enable-memory-saver") == 1
    assert "--enable-memory-saver" not in build_sglang_command(SglangLaunchSpec(hf_checkpoint="/m", host="h", port=1))
