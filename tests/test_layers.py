"""The layers import one way and sibling modules import without cycles: the contracts in
pyproject.toml hold for the code, and fail for code that imports up a layer or closes a circle
(so the checks are not ones that cannot fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def copy_of_the_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(REPO / "batchllm", root / "batchllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_code_keeps_the_layers(tmp_path):
    result = lint_imports(copy_of_the_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, added, broken", [
    ("core/paths.py", "\n\ndef _later():\n    from batchllm.runtime import ledger  # noqa: F401\n",
     "batchllm.core.paths -> batchllm.runtime.ledger"),  # up a layer, inside a function
    ("io/node_journal.py", "\nfrom batchllm.engines import devices  # noqa: E402,F401\n",
     "batchllm.io.node_journal -> batchllm.engines.devices"),  # between the two sides of one layer
])
def test_a_forbidden_import_breaks_them(tmp_path, module, added, broken):
    root = copy_of_the_tree(tmp_path)
    path = root / "batchllm" / module
    path.write_text(path.read_text() + added)
    result = lint_imports(root)
    assert result.returncode != 0
    assert broken in result.stdout


def test_an_import_that_closes_a_circle_between_siblings_breaks_the_second(tmp_path):
    """The run-state records once lived beside the stage chooser, which imports the observers that
    read them: a circle, typing-only but a circle. Put one back."""
    root = copy_of_the_tree(tmp_path)
    path = root / "batchllm" / "runtime" / "run_state.py"
    path.write_text(path.read_text() + "\nfrom batchllm.runtime import stage_chooser  # noqa: E402,F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "No cycles are allowed in batchllm.runtime." in result.stdout
    assert "Contracts: 1 kept, 1 broken." in result.stdout
