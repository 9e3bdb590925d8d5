"""Shared fixtures. Every test's state (BATCHLLM_HOME, outputs) lives in a temp folder."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def pytest_collection_finish(session) -> None:
    """Everything imported by collection (the test modules, numpy, scipy, ...) lives to the end: kept
    out of the collector's scans, so a run's `gc.collect()` costs what the test made, not the whole
    suite's heap (0.2-0.3 s a call before: test_executor.py took 37 s, now 23 s)."""
    gc.freeze()


def _hermetic_home() -> None:
    """The suite reads no per-user state: HOME (Ray's ~/.ray/auth_token, ~/.cache) and the caches
    of Hugging Face and vLLM point at a folder of this test process's own, before any
    package reads them (engines and servers the tests start inherit it). Models come from the
    repository's .batchllm-home, prepared by `make test`, and from packages, never from a cache."""
    home = tempfile.mkdtemp(prefix="batchllm-tests-home-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ.update({"HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache"), "HF_HOME": os.path.join(home, ".cache", "hf"),
                       "VLLM_CACHE_ROOT": os.path.join(home, ".cache", "vllm")})


_hermetic_home()

SLOW_MARKS = ("engine", "ray", "endpoint")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items) -> None:
    """The tests that start real engines, servers or a Ray cluster run on one worker, in order, so
    they share one engine or server per module or session as they do without workers; those that
    need the engine's parts but start nothing (`starts_no_engine`: mostly imports of vLLM or
    transformers) run in order on another worker beside them; the fast tests spread over the
    workers (`-n auto --dist loadgroup` in pyproject.toml: the largest group goes out first)."""
    for item in items:
        if any(item.get_closest_marker(mark) for mark in SLOW_MARKS):
            group = "engine-parts" if item.get_closest_marker("starts_no_engine") else "real-engines"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def shared_engines():
    """An engine factory that keeps real engines alive between the tests that run on the real
    engine (marked `engine`): one per sharing key, at most two of them idle (tests/engine_pool.py)."""
    from batchllm.engines.process_engine import start_vllm_engine
    from tests.engine_pool import EnginePool

    pool = EnginePool(start_vllm_engine, keep=2)
    yield pool
    pool.close()


QUESTIONS = [
    ("q1", "What is a prime number?"),
    ("q2", "How do I sort a list in Python?"),
    ("q3", "Why is the sky blue?"),
    ("q4", "What does SQL stand for?"),
]
DOCUMENTS = [
    ("d1", ["alpha one", "alpha two", "alpha three"]),
    ("d2", ["beta one"]),
    ("d3", []),
]


@dataclass
class Workspace:
    root: Path

    def dag(self, body: str, name: str = "dag.yaml") -> Path:
        path = self.root / name
        path.write_text(textwrap.dedent(body).lstrip())
        return path

    @property
    def out(self) -> Path:
        return self.root / "out"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    """No test reads or writes the user's ~/.cache/batchllm."""
    home = tmp_path / "batchllm-home"
    monkeypatch.setenv("BATCHLLM_HOME", str(home))
    monkeypatch.setenv("BATCHLLM_STORE", str(tmp_path / "results.sqlite"))  # a test's runs reuse only their own results
    return home


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    root = tmp_path / "ws"
    root.mkdir()
    pq.write_table(pa.table({"id": [q for q, _ in QUESTIONS], "question": [t for _, t in QUESTIONS]}), root / "questions.parquet")
    pq.write_table(
        pa.table({"doc_id": [d for d, _ in DOCUMENTS], "chunks": pa.array([c for _, c in DOCUMENTS], pa.list_(pa.string()))}),
        root / "documents.parquet",
    )
    make_model_dir(root / "tiny-model")  # for orchestration tests; the fake engine never loads it
    return Workspace(root)


@pytest.fixture
def profiles(tmp_path) -> Path:
    """A profiles folder with the embedded model's measured CPU profile filed for the fake model
    directory `tiny-model` on this machine's hardware name."""
    from batchllm.engines.devices import hardware_name

    root = tmp_path / "profiles"
    shutil.copytree(Path(__file__).resolve().parent.parent / "profiles" / "cpu-intel-xeon" / "smollm2-135m",
                    root / hardware_name("cpu") / "tiny-model", ignore=shutil.ignore_patterns("logs"))
    return root


def load_refused(dag: Path):
    """The UserError loading a DAG file gives (the test fails if it loads)."""
    from batchllm.core.errors import UserError
    from batchllm.dag.loader import load_dag

    with pytest.raises(UserError) as refused:
        load_dag(dag)
    return refused.value


def make_model_dir(path: Path) -> Path:
    """A model directory with the files an engine needs (config, weights, tokenizer), empty:
    for tests whose fake engines never load it."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


ENSEMBLE_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      a:
        model: ./tiny-model
        prompt: "A {{ question }}"
      b:
        model: ./tiny-model
        prompt: "B {{ question }}"
      judge:
        model: ./tiny-model
        prompt: "J {{ a }} | {{ b }}"
    outputs:
      judged:
        columns: {question: question, verdict: judge, a_tokens: a.num_output_tokens}
"""
