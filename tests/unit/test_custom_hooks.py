"""slime's custom loss / advantage plug-ins: flags, submit-time checks (file:line named), result checks.

Training a real step through them: tests/integration/test_custom_loss_step.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from hpc_rl.config.loading import ConfigError, load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.training.custom_hooks import CustomHookError, check_custom_loss_result, run_custom_advantages

PLUGIN = textwrap.dedent('''
    import torch

    def good_loss(args, batch, logits, sum_of_sample_mean):
        return sum_of_sample_mean(torch.cat(batch["current_log_probs"])), {}

    def loss_missing_a_parameter(args, batch, logits):
        return None

    def good_advantages(args, rollout_data):
        rollout_data["advantages"] = rollout_data["returns"] = [torch.ones_like(m) for m in rollout_data["loss_masks"]]

    async def async_advantages(args, rollout_data):
        pass
''')


@pytest.fixture()
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_loss.py"
    path.write_text(PLUGIN)
    return path


def problems_of(*flags: str) -> list[str]:
    config = load_config(["configs/tiny_cpu.yaml"], list(flags))
    return [str(p) for p in collect_problems(config, check_files=False)]


def test_slime_flags_and_aliases_set_the_fields(plugin_file: Path) -> None:
    config = load_config([], ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{plugin_file}:good_loss",
                              "--custom-advantage-function-path", f"{plugin_file}.good_advantages"])
    algorithm = config.algorithm
    assert algorithm.loss_type == "custom_loss" and algorithm.custom_loss_function_path == f"{plugin_file}:good_loss"
    assert algorithm.custom_advantage_function_path == f"{plugin_file}.good_advantages"
    aliased = load_config([], ["--custom-loss-path", "a.b", "--custom-advantage-path", "c.d"]).algorithm
    assert (aliased.custom_loss_function_path, aliased.custom_advantage_function_path) == ("a.b", "c.d")


def test_good_plugins_validate(plugin_file: Path) -> None:
    assert problems_of("--loss-type", "custom_loss", "--custom-loss-function-path", f"{plugin_file}:good_loss",
                       "--custom-advantage-function-path", f"{plugin_file}:good_advantages") == []


def test_wrong_signature_names_the_file_and_line(plugin_file: Path) -> None:
    problems = problems_of("--loss-type", "custom_loss",
                           "--custom-loss-function-path", f"{plugin_file}:loss_missing_a_parameter",
                           "--custom-advantage-function-path", f"{plugin_file}:async_advantages")
    line = PLUGIN.splitlines().index("def loss_missing_a_parameter(args, batch, logits):") + 1
    assert any(p.startswith("algorithm.custom_loss_function_path:") and "(args, batch, logits, sum_of_sample_mean)"
               in p and f"defined at {plugin_file}:{line}" in p for p in problems), problems
    assert any(p.startswith("algorithm.custom_advantage_function_path:") and "must be a plain (non-async) function"
               in p for p in problems), problems


def test_loss_type_and_path_go_together(plugin_file: Path) -> None:
    config = load_config(["configs/tiny_cpu.yaml"], ["--loss-type", "custom_loss"])
    assert [(p.field, p.code) for p in collect_problems(config, check_files=False)] == [("algorithm.loss_type", "needs")]
    with pytest.raises(ConfigError) as refused:
        load_config([], ["--loss-type", "value_loss"])
    assert [(p.field, p.code, p.location) for p in refused.value.problems] == [
        ("algorithm.loss_type", "not_one_of", "command line --loss-type")]
    assert ("algorithm.loss_type: custom_loss needs custom_loss_function_path (--custom-loss-function-path module.fn)"
            in problems_of("--loss-type", "custom_loss"))
    problems = problems_of("--custom-loss-function-path", f"{plugin_file}:good_loss")
    assert any(p.startswith("algorithm.custom_loss_function_path: is called only with loss_type custom_loss")
               for p in problems), problems
    with pytest.raises(Exception, match="value_loss is the critic's own"):
        load_config([], ["--loss-type", "value_loss"])


def test_advantage_results_are_checked() -> None:
    masks = [torch.ones(3), torch.ones(2)]

    def short(args, data):
        data["advantages"], data["returns"] = [torch.ones(3), torch.ones(1)], [torch.ones(3), torch.ones(2)]

    with pytest.raises(CustomHookError, match=r"rollout_data\['advantages'\]\[1\] has 1 values, sample 1 has 2"):
        run_custom_advantages(short, "m.short", None, {"loss_masks": masks}, masks)
    with pytest.raises(CustomHookError, match=r"must set rollout_data\['advantages'\] to a list of 2"):
        run_custom_advantages(lambda args, data: None, "m.none", None, {"loss_masks": masks}, masks)

    def good(args, data):
        data["advantages"] = [[1.0, 2.0, 3.0], [4.0, 5.0]]
        data["returns"] = [torch.zeros(3, dtype=torch.float64), torch.zeros(2)]

    advantages, returns = run_custom_advantages(good, "m.good", None, {"loss_masks": masks}, masks)
    assert torch.equal(advantages[1], torch.tensor([4.0, 5.0])) and returns[0].dtype == torch.float32


def test_loss_results_are_checked() -> None:
    weight = torch.ones(2, requires_grad=True)
    loss, metrics = check_custom_loss_result((weight.sum(), {"x": 1.0}), "m.f")
    assert loss.shape == () and metrics["x"].item() == 1.0
    with pytest.raises(CustomHookError, match=r"must return \(loss, metrics dict\)"):
        check_custom_loss_result(weight.sum(), "m.f")
    with pytest.raises(CustomHookError, match="the loss has no gradient"):
        check_custom_loss_result((torch.tensor(1.0), {}), "m.f")
    with pytest.raises(CustomHookError, match=r"one-element tensor; got Tensor of shape \(2,\)"):
        check_custom_loss_result((weight * 2, {}), "m.f")
