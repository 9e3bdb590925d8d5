"""The layers import one way: the contract in pyproject.toml holds for the code, and it
fails for code that imports up a layer (so the check is not one that cannot fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert "Contracts: 1 kept, 0 broken." in result.stdout


def test_an_import_up_a_layer_breaks_them(tmp_path):
    root = copy_of_the_tree(tmp_path)
    paths = root / "batchllm" / "core" / "paths.py"
    paths.write_text(paths.read_text() + "\n\ndef _later():\n    from batchllm.runtime import ledger  # noqa: F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "batchllm.core.paths -> batchllm.runtime.ledger" in result.stdout


def test_io_and_engines_stay_apart(tmp_path):
    root = copy_of_the_tree(tmp_path)
    journal = root / "batchllm" / "io" / "node_journal.py"
    journal.write_text(journal.read_text() + "\nfrom batchllm.engines import devices  # noqa: E402,F401\n")
    result = lint_imports(root)
    assert result.returncode != 0 and "batchllm.io.node_journal -> batchllm.engines.devices" in result.stdout
