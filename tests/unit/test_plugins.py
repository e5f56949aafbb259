"""Plug-in loading by dotted path or file path, with signature checks and clear errors."""

import textwrap
from pathlib import Path

import pytest

from hpc_rl.plugins import PluginError, load_callable, split_plugin_path


@pytest.fixture()
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def reward(args, sample):
                return 1.0

            async def async_reward(args, sample, extra=None):
                return 1.0

            def needs_three(a, b, c):
                return 0

            def kw_only(args, sample, *, must):
                return 0

            class Scorer:
                @staticmethod
                def score(args, sample):
                    return 2.0
            """
        )
    )
    return path


def test_split_plugin_path() -> None:
    assert split_plugin_path("a.b.fn") == ("a.b", "fn")
    assert split_plugin_path("a.b:fn") == ("a.b", "fn")
    assert split_plugin_path("dir/f.py:fn") == ("dir/f.py", "fn")
    for bad in ("", "fn", "f.py", "mod:"):
        with pytest.raises(PluginError):
            split_plugin_path(bad)


def test_load_from_file_and_check_signature(plugin_file: Path) -> None:
    fn = load_callable(f"{plugin_file}:reward", ["args", "sample"], check_names=True, require_async=False)
    assert fn(None, None) == 1.0
    afn = load_callable(f"{plugin_file}:async_reward", ["args", "sample"], require_async=True)
    assert afn.__name__ == "async_reward"
    assert load_callable(f"{plugin_file}:Scorer.score", ["args", "sample"])(None, None) == 2.0


def test_relative_file_path_uses_base_dir(plugin_file: Path) -> None:
    fn = load_callable("my_rewards.py:reward", ["args", "sample"], base_dir=str(plugin_file.parent))
    assert fn(1, 2) == 1.0


def test_dotted_paths() -> None:
    import os.path

    assert load_callable("os.path.join", ["a", "b"]) is os.path.join
    assert load_callable("hpc_rl.training.losses:sum_of_sample_mean", ["values", "loss_masks"])


def test_errors_name_the_path_and_the_problem(plugin_file: Path) -> None:
    with pytest.raises(PluginError, match=r"needs_three.*2 positional argument"):
        load_callable(f"{plugin_file}:needs_three", ["args", "sample"], what="--custom-rm-path")
    with pytest.raises(PluginError, match="--custom-rm-path"):
        load_callable(f"{plugin_file}:needs_three", ["args", "sample"], what="--custom-rm-path")
    with pytest.raises(PluginError, match="not a callable"):
        load_callable(f"{plugin_file}:NOT_CALLABLE")
    with pytest.raises(PluginError, match="no attribute 'rewrd'"):
        load_callable(f"{plugin_file}:rewrd")
    with pytest.raises(PluginError, match="does not exist"):
        load_callable(f"{plugin_file.parent}/nope.py:reward")
    with pytest.raises(PluginError, match="not found"):
        load_callable("no_such_pkg_xyz.mod.fn")
    with pytest.raises(PluginError, match="async def"):
        load_callable(f"{plugin_file}:reward", ["args", "sample"], require_async=True)
    with pytest.raises(PluginError, match="non-async"):
        load_callable(f"{plugin_file}:async_reward", ["args", "sample"], require_async=False)
    with pytest.raises(PluginError, match="keyword-only"):
        load_callable(f"{plugin_file}:kw_only", ["args", "sample"])
    with pytest.raises(PluginError, match="named"):
        load_callable(f"{plugin_file}:reward", ["args", "samples"], check_names=True)


def test_import_error_inside_plugin_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match="boom"):
        load_callable(f"{bad}:fn")


def test_slime_file_forms(tmp_path: Path) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_rm.py").write_text("async def score(args, sample):\n    return 1.0\n")
    by_file = load_callable("rewards/my_rm.py.score", ["args", "sample"], require_async=True, base_dir=str(tmp_path))
    by_module = load_callable("rewards.my_rm.score", ["args", "sample"], require_async=True, base_dir=str(tmp_path))
    assert by_file is by_module


def test_missing_dependency_is_not_reported_as_a_missing_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_dep.py").write_text("import hpc_rl_no_such_dependency\n\ndef f(args, sample):\n    pass\n")
    with pytest.raises(PluginError, match="imports 'hpc_rl_no_such_dependency', which is not installed"):
        load_callable("needs_dep.py:f", base_dir=str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="'needs_dep' was found but imports 'hpc_rl_no_such_dependency'"):
        load_callable("needs_dep.f")
