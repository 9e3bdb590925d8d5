"""Reuse across runs through the result store, with the scripted engine: after an edit only the
requests whose key changed reach an engine, in another run folder or DAG too; a run whose every
request is stored starts no engine; exactly once across a crash of a reusing run; a damaged
entry is recomputed; two runs at once over one store."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import DeviceSet
from batchllm.io.result_store import ResultStore
from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.ledger import UNIT_BITS, UNIT_MASK
from tests.conftest import ENSEMBLE_DAG, QUESTIONS
from tests.fakes import DriverCrash, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))
ORDER = ["a", "b", "judge"]
EDITED_JUDGE = ENSEMBLE_DAG.replace('prompt: "J {{ a }} | {{ b }}"', 'prompt: "Judge: {{ a }} or {{ b }}?"')


def run(workspace, factory, out: Path, dag_text=ENSEMBLE_DAG, store: Path | None = None, fresh=False, name="dag.yaml"):
    return run_dag_file(workspace.dag(dag_text, name), out, CPU2, console=Console(quiet=True), engine_factory=factory,
                        prefix_order=False, schedule="sequential", fresh=fresh,
                        store=store if store is not None else workspace.root / "store.sqlite")


def sent(factory: FakeEngineFactory, order=ORDER) -> list[tuple[str, str]]:
    """(node, row_id) of every request the engines were given."""
    return sorted((order[r.request_id >> UNIT_BITS], QUESTIONS[r.request_id & UNIT_MASK][0]) for r in factory.requests)


def node_rows(out: Path, node: str) -> list[dict]:
    return pq.read_table(out / "nodes" / f"{node}.parquet").to_pylist()


def test_an_edited_judge_alone_is_computed_and_equals_a_run_from_scratch(workspace):
    assert EDITED_JUDGE != ENSEMBLE_DAG
    run(workspace, FakeEngineFactory(), workspace.out)
    edited = FakeEngineFactory()
    run(workspace, edited, workspace.out, EDITED_JUDGE, fresh=True)
    assert sent(edited) == [("judge", q) for q, _ in QUESTIONS]
    scratch = FakeEngineFactory()
    run_dag_file(workspace.dag(EDITED_JUDGE, "scratch.yaml"), workspace.root / "scratch", CPU2, console=Console(quiet=True),
                 engine_factory=scratch, prefix_order=False, schedule="sequential")  # no store: everything computed
    assert len(scratch.requests) == 3 * len(QUESTIONS)
    for node in ORDER:
        assert node_rows(workspace.out, node) == node_rows(workspace.root / "scratch", node), node
    provenance = [json.loads(line) for line in (workspace.out / ".batchllm" / "journal" / "a" / "reused.jsonl").read_text().splitlines()]
    assert sum(len(p["rows_steps"]) for p in provenance) == len(QUESTIONS)
    assert {p["computed_by"].split(" ")[0] for p in provenance} == {str(workspace.out)}


def test_nothing_changed_in_another_folder_starts_no_engine(workspace):
    run(workspace, FakeEngineFactory(), workspace.out)
    again = FakeEngineFactory()
    result, progress = run(workspace, again, workspace.root / "elsewhere")
    assert result.engines_started == 0 and again.requests == []
    assert node_rows(workspace.root / "elsewhere", "judge") == node_rows(workspace.out, "judge")
    assert {name: stats.reused for name, stats in progress.stats.items()} == {n: len(QUESTIONS) for n in ORDER}
    status = json.loads((workspace.root / "elsewhere" / ".batchllm" / "status.json").read_text())
    assert {n: status["nodes"][n]["reused"] for n in ORDER} == {n: len(QUESTIONS) for n in ORDER}


def test_without_a_store_everything_is_computed(workspace):
    run(workspace, FakeEngineFactory(), workspace.out)
    again = FakeEngineFactory()
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.root / "again", CPU2, console=Console(quiet=True), engine_factory=again,
                 prefix_order=False, schedule="sequential", store=None)
    assert len(again.requests) == 3 * len(QUESTIONS)


def test_one_changed_input_row_computes_that_rows_requests_only(workspace):
    run(workspace, FakeEngineFactory(), workspace.out)
    table = pq.read_table(workspace.root / "questions.parquet").to_pylist()
    table[2]["question"] = "What is a composite number?"
    pq.write_table(pa.Table.from_pylist(table), workspace.root / "questions.parquet")
    changed = FakeEngineFactory()
    run(workspace, changed, workspace.root / "changed")
    row = table[2]["id"]
    assert sent(changed) == [("a", row), ("b", row), ("judge", row)]


def test_a_second_dag_with_one_identical_node_reuses_it(workspace):
    run(workspace, FakeEngineFactory(), workspace.out)
    other = """
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          first:
            model: ./tiny-model
            prompt: "A {{ question }}"
          second:
            model: ./tiny-model
            prompt: "Twice: {{ first }}"
    """
    factory = FakeEngineFactory()
    run(workspace, factory, workspace.root / "other", other, name="other.yaml")
    assert sent(factory, ["first", "second"]) == [("second", q) for q, _ in QUESTIONS]


def test_a_changed_sampling_key_is_another_request_and_an_unchanged_answer_below_it_is_reused(workspace):
    """The seed is a sampling key: node a runs again; the scripted engine's answers do not depend
    on it, so the judge's prompts come out the same and are answered from the store as a commits."""
    run(workspace, FakeEngineFactory(), workspace.out)
    seeded = ENSEMBLE_DAG.replace('prompt: "A {{ question }}"', 'prompt: "A {{ question }}"\n        sampling: {seed: 3}')
    assert seeded != ENSEMBLE_DAG
    factory = FakeEngineFactory()
    run(workspace, factory, workspace.root / "seeded", seeded)
    assert sent(factory) == [("a", q) for q, _ in QUESTIONS]


def test_a_crash_of_a_reusing_run_resumes_with_every_unit_once(workspace):
    run(workspace, FakeEngineFactory(), workspace.out)
    with pytest.raises(DriverCrash):
        run(workspace, FakeEngineFactory(crash_after_results=2), workspace.out, EDITED_JUDGE, fresh=True)
    resumed = FakeEngineFactory()
    run(workspace, resumed, workspace.out, EDITED_JUDGE)
    assert len(resumed.requests) == len(QUESTIONS) - 2
    for node in ORDER:
        assert sorted(r["row_id"] for r in node_rows(workspace.out, node)) == sorted(q for q, _ in QUESTIONS), node


def test_a_damaged_entry_is_computed_again_never_returned(workspace):
    store = workspace.root / "store.sqlite"
    run(workspace, FakeEngineFactory(), workspace.out)
    with sqlite3.connect(store) as db:
        (count,) = db.execute("SELECT COUNT(*) FROM results").fetchone()
        assert count == 3 * len(QUESTIONS)
        db.execute("UPDATE results SET payload = CAST(replace(CAST(payload AS TEXT), 'prime', 'prim3') AS BLOB)")
    damaged = sum(1 for _, text in QUESTIONS if "prime" in text)
    assert damaged
    again = FakeEngineFactory()
    run(workspace, again, workspace.root / "again")
    assert len(again.requests) >= damaged  # the damaged ones (and whatever reads their answers) are computed again
    assert node_rows(workspace.root / "again", "judge") == node_rows(workspace.out, "judge")
    with ResultStore(store) as reopened:
        assert reopened.usage().damaged >= damaged


def _run_in_process(root: str, out: str) -> None:
    from tests.conftest import Workspace

    workspace = Workspace(Path(root))
    run(workspace, FakeEngineFactory(), Path(out))


def test_two_runs_at_once_over_one_store_both_finish_with_every_row_once(workspace):
    context = multiprocessing.get_context("spawn")
    runs = [context.Process(target=_run_in_process, args=(str(workspace.root), str(workspace.root / f"out{k}"))) for k in range(2)]
    for process in runs:
        process.start()
    for process in runs:
        process.join(timeout=120)
        assert process.exitcode == 0
    for k in range(2):
        for node in ORDER:
            assert sorted(r["row_id"] for r in node_rows(workspace.root / f"out{k}", node)) == sorted(q for q, _ in QUESTIONS)
    with sqlite3.connect(workspace.root / "store.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT COUNT(*) FROM results").fetchone() == (3 * len(QUESTIONS),)


def test_run_batch_of_the_same_file_into_a_new_run_folder_starts_no_engine(tmp_path):
    from batchllm.openai_batch.run import run_batch
    from tests.conftest import make_model_dir

    make_model_dir(tmp_path / "model-a")
    lines = [{"custom_id": f"c{k}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gpt-a", "messages": [{"role": "user", "content": text}], "max_tokens": 8}}
             for k, (_, text) in enumerate(QUESTIONS)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs = []
    for attempt in ("first", "second"):
        factory = FakeEngineFactory()
        done = run_batch(requests, tmp_path / f"{attempt}.jsonl", {"gpt-a": str(tmp_path / "model-a")}, run_dir=tmp_path / attempt,
                         devices=CPU2, prefix_order=False, schedule="sequential", engine_factory=factory, console=Console(quiet=True),
                         store=tmp_path / "store.sqlite")
        assert done.counts.succeeded == len(QUESTIONS)
        outputs.append([json.loads(line)["response"]["body"]["choices"] for line in (tmp_path / f"{attempt}.jsonl").read_text().splitlines()])
        if attempt == "second":
            assert factory.requests == [] and not factory.started
    assert outputs[0] == outputs[1]


def test_the_scan_before_the_engines_stops_at_a_window_mostly_new_and_the_rest_is_looked_up_as_fed(workspace, monkeypatch):
    """Windows of two units: the first rows changed, so the first window is all new and the scan
    before the first stage stops there; the unchanged rows after it are still taken from the store,
    as the feed renders them."""
    from batchllm.runtime import reuse

    run(workspace, FakeEngineFactory(), workspace.out)
    table = pq.read_table(workspace.root / "questions.parquet").to_pylist()
    for row in table[:2]:
        row["question"] += " (changed)"
    pq.write_table(pa.Table.from_pylist(table), workspace.root / "questions.parquet")
    monkeypatch.setattr(reuse, "SCAN_WINDOW_UNITS", 2)
    scanned = []
    take = reuse.RunReuse.take_before_start
    monkeypatch.setattr(reuse.RunReuse, "take_before_start", lambda self, nodes, whole=False: scanned.append(take(self, nodes, whole)) or scanned[-1])
    changed = FakeEngineFactory()
    run(workspace, changed, workspace.root / "changed")
    assert scanned == [{}, {}]  # the launch's question (is the DAG answered whole?), then the run's first step: a's first window 0 of 2
    assert sent(changed) == sorted((node, row["id"]) for node in ORDER for row in table[:2])


def test_a_full_store_stops_the_filing_with_its_reason_and_the_runs_own_results_are_whole(workspace, monkeypatch):
    from batchllm.core.errors import UserError
    from batchllm.io import result_store

    def full(self, entries, run):
        raise UserError(f"the result store {self.path} is full (the disk has no room)", hint="batchllm store prune")

    monkeypatch.setattr(result_store.ResultStore, "put_many", full)
    notes: list[str] = []
    console = Console(quiet=True)
    console.print = lambda *a, **k: notes.append(" ".join(map(str, a)))  # type: ignore[method-assign]
    result, _ = run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=console, engine_factory=FakeEngineFactory(),
                             prefix_order=False, schedule="sequential", store=workspace.root / "store.sqlite")
    assert result.nodes_failed == {}
    for node in ORDER:
        assert sorted(r["row_id"] for r in node_rows(workspace.out, node)) == sorted(q for q, _ in QUESTIONS)
    filing = [n for n in notes if "no longer filed in the result store" in n]
    assert len(filing) == 1 and "is full" in filing[0]


def test_a_run_the_store_answers_whole_fits_no_length_model_and_makes_no_plan(workspace, monkeypatch, profiles):
    """Planned on a profile: the first run plans; the same DAG into another folder is answered whole
    by the store, so neither the length models nor the planner are asked."""
    from batchllm.runtime import launch

    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=Console(quiet=True), engine_factory=FakeEngineFactory(),
                 prefix_order=False, schedule="plan", profiles_root=profiles, store=workspace.root / "store.sqlite")
    asked: list[str] = []
    monkeypatch.setattr(launch, "_length_models", lambda *a: asked.append("lengths"))
    monkeypatch.setattr(launch, "_calibrated_planning", lambda *a, **k: asked.append("plan"))
    again = FakeEngineFactory()
    result, _ = run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.root / "again", CPU2, console=Console(quiet=True),
                             engine_factory=again, prefix_order=False, schedule="plan", profiles_root=profiles,
                             store=workspace.root / "store.sqlite")
    assert asked == [] and result.engines_started == 0
    assert node_rows(workspace.root / "again", "judge") == node_rows(workspace.out, "judge")


@pytest.mark.engine
@pytest.mark.starts_no_engine
def test_an_embedded_models_keys_come_from_what_its_package_ships_without_converting_it(tmp_path):
    """The key's model identity of an embedded model is its shipped checkpoint's (and the config it
    is converted to): plan, validate and a run all answered from the store never convert a model."""
    from batchllm.dag.loader import load_dag
    from batchllm.runtime.request_keys import NodeKeys

    pq.write_table(pa.table({"id": ["a"], "question": ["hi"]}), tmp_path / "q.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  q: {path: q.parquet, id_column: id}\nnodes:\n  answer:\n    model: smollm2-135m\n    prompt: '{{ question }}'\n")
    spec = load_dag(dag)
    home = tmp_path / "home"
    first = NodeKeys.of(spec, spec.nodes["answer"], "cpu", home)
    assert not (home / "models").exists()  # not converted
    assert NodeKeys.of(spec, spec.nodes["answer"], "cpu", home).scope == first.scope  # the remembered digest gives the same


def test_a_store_path_that_is_a_folder_is_refused_before_anything_is_written(workspace):
    from batchllm.core.errors import UserError

    (workspace.root / "a-folder").mkdir()
    with pytest.raises(UserError, match="a folder is in the way of the result store"):
        run(workspace, FakeEngineFactory(), workspace.out, store=workspace.root / "a-folder")
    assert not workspace.out.exists()
