"""Issue 26: slime's misc flags with slime's meaning: --train-env-vars (the trainer step's environment),
--http-proxy (the reward server's calls go through it), --model-name (checked against the architecture),
--only-train/--freeze-params-name-list (checked at submit)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.data.samples import Sample
from hpc_rl.launch.supervisor import CONTROLLER_ENV, Driver
from hpc_rl.launch.steps import StepSpec
from hpc_rl.launch.submit_args import assign_run_dir
from hpc_rl.rewards import RewardSpec, reward_group
from tests.unit.slime_lines import flags_of

REPO = Path(__file__).resolve().parents[2]


class RecordingLauncherForTest:
    """A fake step launcher: records the steps it is asked to start, starts nothing."""

    def __init__(self) -> None:
        self.specs: list[StepSpec] = []

    def start(self, spec: StepSpec) -> object:
        self.specs.append(spec)
        return object()

    def node_address(self, het_group: int, node_index: int) -> str:
        return "127.0.0.1"


class FakeControllerForTest:
    address = ("127.0.0.1", 4321)


def test_train_env_vars_reach_the_trainer_step(tmp_path: Path) -> None:
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"], [
        "--run-dir", str(tmp_path / "run"),
        "--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "HPC_RL_CONTROLLER": "x"}'])
    config = assign_run_dir(config)
    write_resolved_config(config, config.run_dir)
    launcher = RecordingLauncherForTest()
    driver = Driver(config.run_dir, launcher, local=True)  # type: ignore[arg-type]
    driver.controller = FakeControllerForTest()  # type: ignore[assignment]
    driver._start_trainer()
    (spec,) = launcher.specs
    assert spec.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert spec.env[CONTROLLER_ENV] == "127.0.0.1:4321"  # hpc_rl's own variables win


class ProxyForTest:
    """A fake forward HTTP proxy: answers every request it is sent, recording the absolute URL asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.append(str(request.url))
        return web.json_response({"score": 0.75})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def test_http_proxy_carries_the_reward_calls() -> None:
    """The reward server's host does not resolve here: only through the proxy is there an answer."""
    config = load_config([], ["--rm-type", "remote_rm", "--rm-url", "http://reward.invalid/score", "--reward-key",
                              "score", "--http-proxy", "http://placeholder"])
    assert config.rollout.http_proxy == "http://placeholder"

    async def scenario() -> tuple[list[float], list[str]]:
        proxy = ProxyForTest()
        async with proxy as url:
            spec = RewardSpec(rm_type="remote_rm", rm_url=config.rollout.rm_url, reward_key="score", proxy=url)
            sample = Sample(index=0, group_index=0, prompt="p", prompt_token_ids=[1], response_text="r")
            return await reward_group(spec, [sample]), proxy.asked

    rewards, asked = asyncio.run(scenario())
    assert rewards == [0.75] and asked == ["http://reward.invalid/score"]


def test_model_name_must_name_the_architectures_family() -> None:
    qwen3 = flags_of("qwen3_4B_model_args.txt")

    def problems(*flags: str) -> list[Any]:
        return [p for p in collect_problems(load_config([], [*qwen3, *flags]), check_files=False)
                if p.where == "checkpoint.model_name"]

    assert problems("--model-name", "qwen3") == [] and problems("--model-name", "Qwen3ForCausalLM") == []
    assert "the architecture's 'qwen3'" in problems("--model-name", "glm4")[0].message


def test_freeze_lists_are_checked_at_submit() -> None:
    both = load_config([], ["--only-train-params-name-list", "layers", "--freeze-params-name-list", "embedding"])
    assert any("give only one" in p.message for p in collect_problems(both, check_files=False))
    bad = load_config([], ["--freeze-params-name-list", "layers.(["])
    assert any("not a regular expression" in p.message for p in collect_problems(bad, check_files=False))


def test_dump_details_sets_both_debug_dumps_and_the_rollout_dump_is_written(tmp_path: Path) -> None:
    from hpc_rl.telemetry.recorder import RunRecorder
    from hpc_rl.telemetry.scalars import ScalarLog

    config = load_config([], ["--dump-details", str(tmp_path / "dump")])
    assert config.logging.save_debug_rollout_data == f"{tmp_path}/dump/rollout_data/{{rollout_id}}.jsonl"
    assert config.training.save_debug_train_data == f"{tmp_path}/dump/train_data/{{rollout_id}}_{{rank}}.pt"
    recorder = RunRecorder(tmp_path, ScalarLog(None), num_rollout=3, print_fn=lambda line: None,
                           debug_rollout_data=config.logging.save_debug_rollout_data)
    groups = [[Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[2, 3],
                      reward=float(i)) for i in range(2)]]
    recorder.rollout(1, {"rollout/reward_mean": 0.5}, groups)
    lines = (tmp_path / "dump" / "rollout_data" / "1.jsonl").read_text().splitlines()
    import json

    assert [json.loads(line)["reward"] for line in lines] == [0.0, 1.0]
    assert json.loads(lines[0])["response_token_ids"] == [2, 3]
