"""Reuse across runs on the real engine (slow: marked `engine`): the example ensemble's judge
edited, then run again into another folder over the same result store: only the judge's
requests reach the engine, and its answers are those of a from-scratch run of the edited DAG."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import parse_devices
from batchllm.runtime.launch import run_dag_file
from tests.example_rows import example_dag

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"
ROWS = 6
JUDGE_LINE = "Which answer is more helpful? Reply with A or B and one sentence why."


class Counting:
    """The session's shared engines, counting the requests each node's engine is given."""

    def __init__(self, shared_engines):
        self._factory, self.requests = shared_engines, 0

    def __call__(self, config):
        engine, counter = self._factory(config), self

        class Counted:
            config, ready = engine.config, engine.ready
            drain_steps, poll, in_flight_limit, note, stop = engine.drain_steps, engine.poll, engine.in_flight_limit, engine.note, engine.stop

            def submit(self, requests):
                counter.requests += len(requests)
                engine.submit(requests)

        return Counted()


def texts(out: Path, node: str) -> dict[str, str]:
    table = pq.read_table(out / "nodes" / f"{node}.parquet", columns=["row_id", "text"]).to_pylist()
    return {row["row_id"]: row["text"] for row in table}


def test_an_edited_judge_alone_reaches_the_engine_and_answers_as_a_run_from_scratch(tmp_path, monkeypatch, shared_engines):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    dag = example_dag("ensemble_judge", tmp_path, ROWS)
    edited = tmp_path / "edited.yaml"
    text = dag.read_text()
    assert JUDGE_LINE in text
    edited.write_text(text.replace(JUDGE_LINE, "Which answer is better? Reply with A or B only."))
    store, devices = tmp_path / "store.sqlite", parse_devices("cpu:2")

    def run(path: Path, out: Path, factory, with_store: bool = True):
        result, _ = run_dag_file(path, out, devices, console=Console(quiet=True), engine_factory=factory,
                                 store=store if with_store else None)
        assert result.nodes_failed == {}
        return result

    first = Counting(shared_engines)
    run(dag, tmp_path / "first", first)
    assert first.requests == 3 * ROWS
    again = Counting(shared_engines)
    run(edited, tmp_path / "edited", again)
    assert again.requests == ROWS  # the judge's, and nothing of the two generators
    scratch = Counting(shared_engines)
    run(edited, tmp_path / "scratch", scratch, with_store=False)
    assert scratch.requests == 3 * ROWS
    assert texts(tmp_path / "edited", "concise") == texts(tmp_path / "scratch", "concise")
    assert texts(tmp_path / "edited", "judge") == texts(tmp_path / "scratch", "judge")
    nothing = Counting(shared_engines)
    result = run(edited, tmp_path / "nothing", nothing)
    assert nothing.requests == 0 and result.engines_started == 0
