"""`hpc_rl/weights/` (name mapping, export, HF import, the weight-update group and sender) sits below
`hpc_rl/training/`: training imports weights, never the reverse (issue 13: they imported each
other). Checked on the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parents[2] / "hpc_rl" / "weights"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_weights_never_imports_training() -> None:
    files = sorted(WEIGHTS.glob("*.py"))
    assert len(files) > 5
    upward = {f"{path.name}: {name}" for path in files for name in imported_modules(path)
              if name == "hpc_rl.training" or name.startswith("hpc_rl.training.")}
    assert not upward, f"hpc_rl/weights imports hpc_rl/training: {sorted(upward)}"


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from hpc_rl.training import checkpoint\n    import hpc_rl.training.step\n")
    assert {"hpc_rl.training.checkpoint", "hpc_rl.training.step"} <= imported_modules(sample)
