"""The layer order of hpc_rl's packages (README "Where things live"), read from every import statement.

    4  launch, submit, status            start processes, talk to Slurm and to a running controller
    3  controller                        the asyncio control plane; never loads torch; transformers only for
                                      the prompt tokenizer (data/prompt_tokenizer.py, torch-free)
    2  training, engines, weights, tiny_model, sim   trainer ranks, engines, the weight path (sim: simulated ones)
    1  rollout, rewards                  generation client, sampling, buffers, reward functions
    0  config, data, protocol, plugins, telemetry, retry_policy, process_gc   what every process shares

A module may import its own tier or lower ones (function-level imports included: a lazy import is
still a dependency), and packages do not import each other in a cycle (within tier 2 today: training ->
weights, training -> engines, engines -> weights). KNOWN_* would list a break someone owns the fix of;
none is left, and the test fails on any new one.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hpc_rl"
TIERS = {
    "config": 0, "data": 0, "protocol": 0, "plugins": 0, "telemetry": 0, "retry_policy": 0,
    "process_gc": 0,
    "rollout": 1, "rewards": 1,
    "training": 2, "engines": 2, "weights": 2, "tiny_model": 2, "sim": 2,
    "controller": 3,
    "launch": 4, "submit": 4, "status": 4,
}
TORCH_STACK = ("torch", "transformers", "megatron", "sglang", "tensorboard")
"""Top-level modules the controller never imports (it runs in the driver, on the login/batch node)."""

KNOWN_UPWARD_IMPORTS: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported hpc_rl module or top-level library, line) for every import statement in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_every_part_has_a_tier() -> None:
    parts = {part_of(name) for name in modules() if name != "hpc_rl"}
    assert parts <= set(TIERS), f"put {sorted(parts - set(TIERS))} in a tier (here and in the README)"


def test_imports_point_down() -> None:
    wrong = []
    for name, path in modules().items():
        if name == "hpc_rl":
            continue
        mine = part_of(name)
        for imported, line in imports_of(path):
            if not imported.startswith("hpc_rl.") or part_of(imported) == mine:
                continue
            if TIERS[part_of(imported)] > TIERS[mine] and (name, imported) not in KNOWN_UPWARD_IMPORTS:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {mine} (tier {TIERS[mine]}) imports "
                             f"{imported} (tier {TIERS[part_of(imported)]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def strongly_connected(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components with more than one part (the import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_three_part_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_new_import_cycles_between_parts() -> None:
    edges: dict[str, set[str]] = {}
    for name, path in modules().items():
        for imported, _ in imports_of(path):
            if (imported.startswith("hpc_rl.") and part_of(imported) != part_of(name) and name != "hpc_rl"
                    and (name, imported) not in KNOWN_UPWARD_IMPORTS):  # (reported once, above)
                edges.setdefault(part_of(name), set()).add(part_of(imported))
    new = [sorted(cycle) for cycle in strongly_connected(edges) if not any(cycle <= known for known in KNOWN_CYCLES)]
    assert not new, f"new import cycles between parts: {new}"


def test_controller_source_never_names_the_torch_stack() -> None:
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {imported}"
             for name, path in modules().items() if part_of(name) == "controller"
             for imported, line in imports_of(path) if imported.split(".")[0] in TORCH_STACK]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", ["hpc_rl.controller.app", "hpc_rl.status", "hpc_rl.launch.driver"])
def test_control_plane_imports_load_no_torch(module: str) -> None:
    probe = (f"import sys, {module}; "
             f"print(' '.join(m for m in {TORCH_STACK!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"importing {module} loads {result.stdout.strip()}"


BUILD_PROBE = '''
import asyncio, json, os, sys, tempfile, traceback
from pathlib import Path

looked_up_from = {}

class Witness:
    """Records from which hpc_rl files each library of the torch stack was looked up (an import, lazy ones
    included, or an availability probe such as transformers' find_spec("torch"))."""

    def find_spec(self, name, path=None, target=None):
        if name in TORCH_STACK:
            frames = [os.path.realpath(f.filename) for f in traceback.extract_stack()]
            frames = [name for name in frames if name.startswith(PACKAGE_DIR)]
            where = frames[-1][len(PACKAGE_DIR):] if frames else "?"
            looked_up_from.setdefault(name, [])
            if where not in looked_up_from[name]:
                looked_up_from[name].append(where)
        return None

PACKAGE_DIR = os.path.join(os.path.realpath(sys.argv[1]), "hpc_rl") + os.sep  # the clone may itself be named hpc_rl
sys.meta_path.insert(0, Witness())
from hpc_rl.config import load_config
from hpc_rl.controller.app import Controller
from hpc_rl.protocol.secret import create_secret

async def build(repo, tmp):
    config = load_config([repo / "configs" / "tiny_cpu.yaml"])
    config.run_dir = tmp
    config.rollout.prompt_data = str(repo / "data" / "tiny_copy_train.jsonl")
    controller = Controller(config, secret=create_secret(Path(tmp) / "secret"), router=None, router_url=None)
    try:
        await controller.start()
        await controller.ready()  # tokenizer, prompts, engine client, scheduler, the loop
    finally:
        await controller.close()

with tempfile.TemporaryDirectory() as tmp:
    asyncio.run(build(Path(sys.argv[1]), tmp))
print(json.dumps({name: looked_up_from.get(name) for name in TORCH_STACK if name in sys.modules}))
'''


def test_controller_build_path_loads_no_torch_and_transformers_only_for_the_tokenizer() -> None:
    """What the controller process loads when it starts and builds its rollout stack (function-level
    imports included, which the source scan above cannot follow): never torch; transformers only from
    data/prompt_tokenizer.py, whose `PreTrainedTokenizerFast` path is torch-free (the prompts' chat
    template is rendered by transformers, as the trainer's and SGLang's are)."""
    probe = f"TORCH_STACK = {TORCH_STACK!r}\n" + BUILD_PROBE
    result = subprocess.run([sys.executable, "-c", probe, str(PACKAGE.parent)], capture_output=True, text=True,
                            check=True)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {"transformers": ["data/prompt_tokenizer.py"]}, loaded
