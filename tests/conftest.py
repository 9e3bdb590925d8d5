"""Shared fixtures. Every test's state (BATCHLLM_HOME, outputs) lives in a temp folder."""

from __future__ import annotations

import gc
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


SLOW_MARKS = ("engine", "ray", "endpoint")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items) -> None:
    """The tests that start real engines, servers or a Ray cluster run on one worker, in order, so
    they share one engine or server per module or session as they do without workers; the fast
    tests spread over the other workers (`-n auto --dist loadgroup` in pyproject.toml)."""
    for item in items:
        if any(item.get_closest_marker(mark) for mark in SLOW_MARKS):
            item.add_marker(pytest.mark.xdist_group("real-engines"))


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
