"""The benchmarks, the package and the helpers they share stand apart from the test suite: no
module under benchmarks/, batchllm/ or testkit/ imports `tests` (what both need lives in testkit/).
Every import is read, at any depth (inside functions too), with `ast`; the check is shown to catch
the imports it looks for, so it is not one that cannot fail."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
APART = ("benchmarks", "batchllm", "testkit")


def imports_of_tests(source: str) -> list[str]:
    """The imports of `tests` (or a module in it) in a module's source, as written, with line numbers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_no_benchmark_or_package_module_imports_tests():
    offenders = {}
    modules = [path for folder in APART for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(modules) > 100  # the walk found the trees
    for path in modules:
        if found := imports_of_tests(path.read_text()):
            offenders[str(path.relative_to(REPO))] = found
    assert not offenders, f"these import the test suite (move what they need to testkit/): {offenders}"


@pytest.mark.parametrize("source", [
    "import tests\n",
    "import tests.lora_adapters as adapters\n",
    "from tests.lora_adapters import make_lora_adapter  # noqa: E402\n",
    "from tests import scripted_server\n",
    "def later():\n    from tests.scripted_server import FAST\n",
])
def test_the_check_finds_an_import_of_tests(source):
    assert imports_of_tests(source)


@pytest.mark.parametrize("source", [
    "from testkit.lora_adapters import make_lora_adapter\n",
    "import testsuite\n",
    "from . import tests\n",
    "from batchllm.core import tests_of_this\n",
])
def test_the_check_leaves_other_imports(source):
    assert not imports_of_tests(source)
