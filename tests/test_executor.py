"""The one executor with a scripted engine: sequential and planned stages, engine sharing
and hand-over, exactly-once results across driver crashes and engine deaths, run.json."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.core.errors import RunIncomplete, UserError
from batchllm.engines.devices import DeviceSet
from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.ledger import UNIT_BITS, UNIT_MASK
from tests.conftest import ENSEMBLE_DAG, QUESTIONS, make_model_dir
from tests.fakes import DriverCrash, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))
REPO = Path(__file__).resolve().parent.parent
ORDER = ["a", "b", "judge"]  # ENSEMBLE_DAG's nodes in topological order: a request id is request_id(<index>, <unit>)
ALL_KEYS = [(q, 0) for q, _ in QUESTIONS]


def run(workspace, factory, schedule="sequential", dag_text=ENSEMBLE_DAG, out=None, fresh=False, profiles=None):
    """The fake model directory has no tokenizer, so requests go in the given order here;
    the prefix order is tested in test_prefix_order.py and by the real-engine tests."""
    kwargs = {"profiles_root": profiles} if profiles else {}
    return run_dag_file(workspace.dag(dag_text), out or workspace.out, CPU2, console=Console(quiet=True), fresh=fresh,
                        engine_factory=factory, prefix_order=False, schedule=schedule, **kwargs)


def node_keys(out: Path, node: str) -> list[tuple[str, int]]:
    table = pq.read_table(out / "nodes" / f"{node}.parquet", columns=["row_id", "step"])
    return list(zip(table.column("row_id").to_pylist(), table.column("step").to_pylist()))


def sent(factory: FakeEngineFactory) -> list[tuple[str, str]]:
    """(node, row_id) of every request the engines were given."""
    return [(ORDER[r.request_id >> UNIT_BITS], QUESTIONS[r.request_id & UNIT_MASK][0]) for r in factory.requests]


# -- sequential ----------------------------------------------------------------------------
def test_ensemble_outputs_and_one_shared_engine(workspace):
    factory = FakeEngineFactory()
    result, _ = run(workspace, factory)
    assert result.engines_started == 1  # three nodes, one model: loaded once
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert judged[0] == {"row_id": "q1", "question": "What is a prime number?",
                         "verdict": "<J <A What is a prime number?> | <B What is a prime number?>>",
                         "a_tokens": len("<A What is a prime number?>")}
    nodes = pq.read_table(workspace.out / "nodes" / "a.parquet")
    assert nodes.column_names == ["row_id", "step", "text", "num_prompt_tokens", "num_output_tokens", "finish_reason"]
    assert node_keys(workspace.out, "a") == ALL_KEYS
    report = json.loads((workspace.out / "run.json").read_text())
    assert [list(s["nodes"]) for s in report["stages"]] == [["a"], ["b"], ["judge"]]
    assert report["schedule"] == "sequential"


def test_no_ledger_or_feed_is_alive_while_the_outputs_are_written(workspace, monkeypatch):
    """The ledger's arrays (two bytes a row per node) are freed before the writes allocate:
    nothing, not even a loop variable of the run, keeps a feed or a ledger."""
    import gc

    from batchllm.runtime import output_writer
    from batchllm.runtime.ledger import NodeLedger
    from batchllm.runtime.node_feed import NodeFeed

    alive: list[int] = []
    write = output_writer.write_node_file

    def counting_write(*args, **kwargs):
        gc.collect()
        alive.append(sum(isinstance(o, (NodeLedger, NodeFeed)) for o in gc.get_objects()))
        return write(*args, **kwargs)

    monkeypatch.setattr(output_writer, "write_node_file", counting_write)
    run(workspace, FakeEngineFactory())
    assert alive == [0, 0, 0]


def test_a_finished_run_starts_no_engine_when_run_again(workspace):
    run(workspace, FakeEngineFactory())
    again = FakeEngineFactory()
    result, _ = run(workspace, again)
    assert result.engines_started == 0 and again.started == []


def test_resume_after_a_driver_crash_is_exactly_once(workspace):
    with pytest.raises(DriverCrash):
        run(workspace, FakeEngineFactory(crash_after_results=6))  # dies inside node b
    resumed = FakeEngineFactory()
    run(workspace, resumed)
    assert sorted(sent(resumed)) == [("b", "q3"), ("b", "q4")] + [("judge", q) for q, _ in QUESTIONS]
    for node in ORDER:
        assert node_keys(workspace.out, node) == ALL_KEYS, node
    status = json.loads((workspace.out / ".batchllm" / "status.json").read_text())
    for node in ["b", "judge"]:  # the nodes the resumed run worked on: their counts include what the first run did
        results = pq.read_table(workspace.out / "nodes" / f"{node}.parquet")
        assert {k: status["nodes"][node][k] for k in ("committed", "failed", "prompt_tokens", "output_tokens")} == {
            "committed": 4, "failed": 0, "prompt_tokens": sum(results.column("num_prompt_tokens").to_pylist()),
            "output_tokens": sum(results.column("num_output_tokens").to_pylist())}, node


def test_a_journal_damaged_in_its_middle_is_resumed_with_every_unit_once(workspace):
    with pytest.raises(DriverCrash):
        run(workspace, FakeEngineFactory(crash_after_results=7))  # a finished, b three results in
    tail = workspace.out / ".batchllm" / "journal" / "a" / "tail-000000.jsonl"
    lines = tail.read_bytes().split(b"\n")
    damaged_row = json.loads(lines[1])["row"]
    lines[1] = lines[1][:20] + b"\xff\x00" + lines[1][22:]
    tail.write_bytes(b"\n".join(lines))
    resumed, notes = FakeEngineFactory(), []
    console = Console(quiet=True)
    console.print = lambda *a, **k: notes.append(" ".join(map(str, a)))  # type: ignore[method-assign]
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=console, engine_factory=resumed, prefix_order=False,
                 schedule="sequential")
    assert ("a", QUESTIONS[damaged_row][0]) in sent(resumed)  # the damaged unit ran again
    assert sum(1 for node, _ in sent(resumed) if node == "a") == 1
    assert any("journal damaged:" in n and "1 damaged line(s) set aside" in n for n in notes), notes
    for node in ORDER:
        assert node_keys(workspace.out, node) == ALL_KEYS, node


def test_engine_death_is_retried_then_the_node_fails_and_independent_nodes_finish(workspace):
    dag = ENSEMBLE_DAG.replace("judge:\n        model: ./tiny-model", "judge:\n        model: ./other-model")
    make_model_dir(workspace.root / "other-model")
    # a: its first engine dies after 1 result, the second after 1 more, the third after 1 more
    # -> node a fails; b gets a fresh engine and succeeds; judge needs a, so it fails too.
    factory = FakeEngineFactory(die_after=[1, 1, 1])
    with pytest.raises(RunIncomplete, match="node a: fake engine: died; node judge: upstream node 'a' failed"):
        run(workspace, factory, dag_text=dag)
    assert len(node_keys(workspace.out, "a")) == 3
    assert node_keys(workspace.out, "b") == ALL_KEYS
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert [row["verdict"] for row in judged] == [None] * 4
    report = json.loads((workspace.out / "run.json").read_text())  # the data set says it is incomplete
    assert report["outputs"] == {"judged": {"path": str(workspace.out / "judged.parquet"), "complete": False}}
    run(workspace, FakeEngineFactory(), dag_text=dag)  # the run that completes replaces it
    report = json.loads((workspace.out / "run.json").read_text())
    assert report["failed"] == {} and report["outputs"]["judged"]["complete"] is True
    assert pq.read_table(workspace.out / "judged.parquet").column("verdict").null_count == 0


def test_an_engine_that_cannot_start_fails_its_node_with_the_cause_and_no_empty_data_set_is_written(workspace):
    from batchllm.engines.engine import EngineFailed

    cause = "ValueError: User-specified max_model_len (100000) is greater than the derived max_model_len (8192)"

    def refusing(config):
        raise EngineFailed(f"engine for {config.model} failed to start", cause, log_path="/logs/engine-a.log")

    dag = ENSEMBLE_DAG.replace("columns: {question: question, verdict: judge, a_tokens: a.num_output_tokens}",
                               "columns: {question: question, verdict: judge}")
    with pytest.raises(RunIncomplete) as incomplete:
        run(workspace, refusing, dag_text=dag)
    model = str(workspace.root / "tiny-model")
    expected = f"engine for {model} failed to start: {cause} (engine log: /logs/engine-a.log)"
    assert str(incomplete.value) == f"node a: {expected}; node judge: upstream node 'a' failed; node b: {expected}"
    assert incomplete.value.outputs == {}
    assert sorted(p.name for p in workspace.out.iterdir()) == [".batchllm", "run.html", "run.json"]  # no data set, no node file
    report = json.loads((workspace.out / "run.json").read_text())
    assert report["failed"] == {"a": expected, "judge": "upstream node 'a' failed", "b": expected}
    assert report["outputs"] == {}
    status = json.loads((workspace.out / ".batchllm" / "status.json").read_text())
    assert status["state"] == "incomplete" and status["nodes"]["a"]["failure"] == expected
    from batchllm.runtime.status import read_status, status_json, status_lines

    assert status_json(read_status(workspace.out))["nodes"]["a"]["failure"] == expected
    lines = status_lines(workspace.out, read_status(workspace.out))
    assert lines[lines.index("a: 0/4 units (0%)") + 2] == f"  failed: {expected}"


def test_a_changed_node_refuses_old_results_unless_fresh(workspace):
    run(workspace, FakeEngineFactory())
    changed = ENSEMBLE_DAG.replace('"B {{ question }}"', '"B2 {{ question }}"')
    with pytest.raises(UserError, match="different version of node 'b'"):
        run(workspace, FakeEngineFactory(), dag_text=changed)
    factory = FakeEngineFactory()
    run(workspace, factory, dag_text=changed, fresh=True)
    assert len(factory.requests) == 12


def test_sampling_n_keeps_every_completion(workspace):
    factory = FakeEngineFactory()
    run(workspace, factory, dag_text=ENSEMBLE_DAG.replace('prompt: "A {{ question }}"',
                                                          'prompt: "A {{ question }}"\n        sampling: {n: 2, seed: 3}'))
    table = pq.read_table(workspace.out / "nodes" / "a.parquet")
    assert table.column("texts").to_pylist()[0] == ["<A What is a prime number?>"] * 2
    assert {r.sampling.seed for r in factory.requests if r.request_id >> UNIT_BITS == 0} == {3}


def test_ctrl_c_keeps_committed_results_and_says_how_to_resume(workspace, monkeypatch):
    from typer.testing import CliRunner

    from batchllm import cli
    from batchllm.runtime import launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_dag", interrupted)
    result = CliRunner().invoke(cli.app, ["run", str(workspace.dag(ENSEMBLE_DAG)), "--out", str(workspace.out)])
    assert result.exit_code == 130
    assert result.output == "interrupted: finished results are kept; run the same command again to resume.\n"


ROUTED_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      route: {model: ./tiny-model, prompt: "{{ question }}"}
      expert:
        model: ./tiny-model
        where: "question LIKE '%SQL%' OR row_id = 'q1'"
        prompt: "E {{ route }}"             # `question` is read by `where:` only
      nobody:
        model: ./tiny-model
        where: "route = 'never'"
        prompt: "N {{ question }}"
      judge:
        model: ./tiny-model
        prompt: "J {{ expert }}"
"""


def test_where_routes_rows_and_a_node_no_row_reaches_starts_no_work(workspace):
    factory = FakeEngineFactory()
    result, progress = run(workspace, factory, dag_text=ROUTED_DAG)
    assert node_keys(workspace.out, "expert") == [("q1", 0), ("q4", 0)]
    assert node_keys(workspace.out, "judge") == [("q1", 0), ("q4", 0)]
    assert node_keys(workspace.out, "nobody") == []
    report = json.loads((workspace.out / "run.json").read_text())
    assert [list(s["nodes"]) for s in report["stages"]] == [["route"], ["expert"], ["judge"]]
    assert progress.stats["nobody"].units_total == 0  # listed in the summary, with nothing to do


def test_iterating_node_runs_each_rows_steps_in_order_with_the_previous_output(workspace):
    factory = FakeEngineFactory()
    run(workspace, factory, dag_text="""
        inputs:
          documents: {path: documents.parquet, id_column: doc_id}
        nodes:
          summarize:
            model: ./tiny-model
            iterate: {over: chunks, as: chunk}
            prompt: "{{ previous or '' }}+{{ chunk }}@{{ step }}"
        outputs:
          summaries: {columns: {summary: summarize}}
        """)
    assert node_keys(workspace.out, "summarize") == [("d1", 0), ("d1", 1), ("d1", 2), ("d2", 0)]
    summaries = pq.read_table(workspace.out / "summaries.parquet").to_pylist()
    assert summaries == [{"row_id": "d1", "summary": "<<<+alpha one@0>+alpha two@1>+alpha three@2>"},
                         {"row_id": "d2", "summary": "<+beta one@0>"}, {"row_id": "d3", "summary": None}]


# -- planned stages -----------------------------------------------------------------------
def test_plan_runs_the_two_generators_side_by_side_then_the_judge(workspace, profiles):
    factory = FakeEngineFactory()
    run(workspace, factory, schedule="plan", profiles=profiles)
    report = json.loads((workspace.out / "run.json").read_text())
    first = report["stages"][0]["nodes"]
    assert set(first) == {"a", "b"} and first["a"]["devices"] != first["b"]["devices"]
    assert {d for n in first.values() for d in n["devices"]} == {0, 1}
    assert report["schedule"] == "plan" and report["estimated_s"] > 0
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert judged[0]["verdict"] == "<J <A What is a prime number?> | <B What is a prime number?>>"
    for node in ORDER:
        assert node_keys(workspace.out, node) == ALL_KEYS
    # every engine ran on one core, and the judge took over the generators' engines
    assert all(len(e.config.replica.device_ids) == 1 for e in factory.started)
    assert len(factory.started) == 2


def test_max_heuristic_runs_one_node_at_a_time_on_both_cores(workspace, profiles):
    run(workspace, FakeEngineFactory(), schedule="max", profiles=profiles)
    report = json.loads((workspace.out / "run.json").read_text())
    assert [list(s["nodes"]) for s in report["stages"]] == [["a"], ["b"], ["judge"]]
    assert all(n["devices"] == [0, 1] for s in report["stages"] for n in s["nodes"].values())


def test_driver_killed_at_random_points_then_resumed_gives_an_uninterrupted_runs_output(workspace, profiles, tmp_path):
    clean = tmp_path / "clean"
    run(workspace, FakeEngineFactory(), schedule="plan", profiles=profiles, out=clean)
    rng = random.Random(5)
    crashes = 0
    while True:  # killed after 1-3 results of some engine, again and again, until a run gets through
        try:
            run(workspace, FakeEngineFactory(crash_after_results=rng.randint(1, 3)), schedule="plan", profiles=profiles)
            break
        except DriverCrash:
            crashes += 1
    assert crashes >= 3
    for node in ORDER:
        assert node_keys(workspace.out, node) == ALL_KEYS, node
    assert pq.read_table(workspace.out / "judged.parquet").equals(pq.read_table(clean / "judged.parquet"))


def test_a_worker_that_dies_mid_stage_is_restarted_and_nothing_is_lost_or_repeated(workspace, profiles):
    factory = FakeEngineFactory(die_after=[1])  # the first engine started dies after one result
    run(workspace, factory, schedule="plan", profiles=profiles)
    for node in ORDER:
        assert node_keys(workspace.out, node) == ALL_KEYS, node
    assert len(factory.started) == 3  # one restart


def test_an_engine_is_handed_no_more_requests_than_it_runs_at_once(workspace, profiles):
    rows = 40
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(rows)], "question": [f"Question {i}?" for i in range(rows)]}),
                   workspace.root / "questions.parquet")
    factory = FakeEngineFactory()
    run(workspace, factory, schedule="plan", profiles=profiles)
    assert {e.ready.max_num_seqs for e in factory.started} == {8}
    assert max(e.most_queued for e in factory.started) == 8  # the rest waited in the driver's backlog
    for node in ORDER:
        assert node_keys(workspace.out, node) == [(f"r{i:02d}", 0) for i in range(rows)]


# -- pilots -------------------------------------------------------------------------------------
def many_questions(workspace, rows: int) -> list[str]:
    ids = [f"r{i:03d}" for i in range(rows)]
    pq.write_table(pa.table({"id": ids, "question": [f"Question {i}?" for i in range(rows)]}), workspace.root / "questions.parquet")
    return ids


def fingerprints(workspace) -> dict[str, str]:
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.runtime.fingerprint import node_fingerprints

    dag = load_dag(workspace.dag(ENSEMBLE_DAG))
    return node_fingerprints(dag, check_dag(dag, workspace.root))


def sent_rows(factory: FakeEngineFactory, node: str, engines: slice = slice(None)) -> list[int]:
    """The node's rows the engines were sent (engine by engine, in the order each was sent them)."""
    return [r.request_id & UNIT_MASK for e in factory.started[engines] for r in e.seen if ORDER[r.request_id >> UNIT_BITS] == node]


def test_a_new_prompt_set_starts_with_its_pilot_then_the_rest_is_planned(workspace, profiles):
    from batchllm.runtime.pilot import PilotSize, pilot_rows, seed_of

    ids = many_questions(workspace, 300)
    factory = FakeEngineFactory()
    run(workspace, factory, schedule="plan", profiles=profiles)
    prints = fingerprints(workspace)
    for node in ("a", "b"):  # each generator's pilot rows (0.5 % of 300 is below the 64-row floor) are the first it sends
        sampled = pilot_rows(300, PilotSize(), seed_of(prints[node])).tolist()  # to each engine (its pilot may run on several)
        earliest = {row for k in range(len(factory.started)) for row in sent_rows(factory, node, slice(k, k + 1))[:64]}
        assert len(sampled) == 64 and set(sampled) <= earliest and len(earliest) < 2 * 64 + 1
        assert sampled != list(range(64)) and sorted(sent_rows(factory, node)) == list(range(300))  # every row sent once
    assert sorted(sent_rows(factory, "judge")) == list(range(300))  # it reads upstream nodes: no pilot of its own
    stages = json.loads((workspace.out / "run.json").read_text())["stages"]
    assert any(stages[0]["nodes"].get(node, {}).get("units_after") == 64 for node in ("a", "b"))  # a pilot ended it
    assert len(stages) >= 3
    for node in ORDER:
        assert node_keys(workspace.out, node) == [(i, 0) for i in ids]


def test_no_pilot_for_a_small_node_or_when_switched_off(workspace, profiles):
    many_questions(workspace, 100)  # a pilot of 64 of 100 rows would be most of the node
    run(workspace, FakeEngineFactory(), schedule="plan", profiles=profiles)
    assert [list(s["nodes"]) for s in json.loads((workspace.out / "run.json").read_text())["stages"]] == [["a", "b"], ["judge"]]

    many_questions(workspace, 300)
    off = FakeEngineFactory()
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=Console(quiet=True), fresh=True, engine_factory=off,
                 prefix_order=False, schedule="plan", profiles_root=profiles, pilot=None)
    assert sent_rows(off, "a")[:5] == [0, 1, 2, 3, 4]  # in row order from the start


def test_a_pilot_interrupted_then_resumed_runs_no_committed_row_again(workspace, profiles):
    from batchllm.io.node_journal import ResultJournal
    from batchllm.runtime.run_dir import RunDir

    ids = many_questions(workspace, 300)
    with pytest.raises(DriverCrash):
        run(workspace, FakeEngineFactory(crash_after_results=20), schedule="plan", profiles=profiles)
    prints = fingerprints(workspace)
    committed = {}
    for node in ("a", "b"):
        journal = ResultJournal(RunDir(workspace.out).journal_folder(node), prints[node], node)
        committed[node] = {int(r) for rows, _ in journal.committed_key_batches() for r in rows.tolist()}
        journal.close()
    assert sum(map(len, committed.values())) >= 20
    resumed = FakeEngineFactory()
    run(workspace, resumed, schedule="plan", profiles=profiles)
    for node in ("a", "b"):
        assert not committed[node] & set(sent_rows(resumed, node))
    for node in ORDER:
        assert node_keys(workspace.out, node) == [(i, 0) for i in ids]


def test_pilots_only_runs_the_pilots_estimates_the_rest_and_a_run_goes_on_from_them(workspace, profiles):
    ids = many_questions(workspace, 300)
    pilots = FakeEngineFactory()
    result, _ = run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=Console(quiet=True), engine_factory=pilots,
                             prefix_order=False, schedule="plan", profiles_root=profiles, pilots_only=True)
    assert result.outputs == {} and result.rest_estimate_s is not None and result.rest_estimate_s > 0
    assert {n: len(sent_rows(pilots, n)) for n in ORDER} == {"a": 64, "b": 64, "judge": 0}
    rest = FakeEngineFactory()
    run(workspace, rest, schedule="plan", profiles=profiles)
    for node in ("a", "b"):
        assert sorted(sent_rows(pilots, node) + sent_rows(rest, node)) == list(range(300))
    for node in ORDER:
        assert node_keys(workspace.out, node) == [(i, 0) for i in ids]


def test_a_run_after_a_pilots_only_command_learns_its_lengths_from_the_pilots_answers(workspace, profiles):
    """The pilots' rows, committed by the earlier command, teach each generator's lengths as a
    pilot's end does (the rest is planned on them, not at the prior's level)."""
    many_questions(workspace, 300)
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=Console(quiet=True), engine_factory=FakeEngineFactory(),
                 prefix_order=False, schedule="plan", profiles_root=profiles, pilots_only=True)
    console = Console(record=True, width=400)
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, CPU2, console=console, engine_factory=FakeEngineFactory(),
                 prefix_order=False, schedule="plan", profiles_root=profiles)
    notes = [line for line in console.export_text().splitlines() if "ran in an earlier command" in line]
    assert len(notes) == 2 and all("(its pilot's 64 rows ran in an earlier command)" in line for line in notes)
    assert {line.split("pilot of ")[1].split(" ")[0] for line in notes} == {"a", "b"}


ROUTER_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      tuned_a: {model: ./m_a, where: "route = 0", prompt: "A {{ question }}"}
      tuned_b: {model: ./m_b, where: "route = 1", prompt: "B {{ question }}"}
      tuned_c: {model: ./m_c, where: "route = 2", prompt: "C {{ question }}"}
"""


def three_routed_models(workspace, profiles) -> None:
    """ROUTER_DAG's 600 questions (routed in turn) and its three models, each with the tiny model's profile."""
    import shutil

    from batchllm.engines.devices import hardware_name

    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(600)], "question": [f"Question {i}?" for i in range(600)],
                             "route": [i % 3 for i in range(600)]}), workspace.root / "questions.parquet")
    for name in ("m_a", "m_b", "m_c"):
        make_model_dir(workspace.root / name)
        shutil.copytree(profiles / hardware_name("cpu") / "tiny-model", profiles / hardware_name("cpu") / name)


def test_pilots_only_over_more_models_than_devices_runs_every_pilot_and_ends(workspace, profiles):
    """Three models routed by row on two cores: a stage holds two of them, and once their pilots
    end the next stage must hold the third one's, not the pilots' models again with nothing left
    to run (`plan --pilot` waited for ever there)."""
    three_routed_models(workspace, profiles)
    factory = FakeEngineFactory()
    result, _ = run_dag_file(workspace.dag(ROUTER_DAG), workspace.out, CPU2, console=Console(quiet=True), engine_factory=factory,
                             prefix_order=False, schedule="plan", profiles_root=profiles, pilots_only=True)
    assert result.rest_estimate_s is not None and result.rest_estimate_s > 0
    routed = {"tuned_a": 0, "tuned_b": 1, "tuned_c": 2}
    sent = {name: sorted({r.request_id & UNIT_MASK for e in factory.started for r in e.seen if r.request_id >> UNIT_BITS == k})
            for k, name in enumerate(sorted(routed))}
    assert all(sent[name] and all(row % 3 == route for row in sent[name]) for name, route in routed.items())
    assert {e.config.model.rsplit("/", 1)[-1] for e in factory.started} == {"m_a", "m_b", "m_c"}


def test_pilots_only_ends_when_a_node_fails_in_its_pilot(workspace, profiles):
    """A pilot whose node fails never ends: a run of pilots only waited for it for ever, its engines
    stopped, where the other nodes' pilots were done."""
    from batchllm.engines.protocol import EngineConfig

    three_routed_models(workspace, profiles)

    class MCDies(FakeEngineFactory):
        def __call__(self, config: EngineConfig):
            self._die_after = [1] if config.model.endswith("m_c") else []  # its engines die after one answer
            return super().__call__(config)

    def waited_for_ever(signum, frame):
        raise TimeoutError("the run of pilots only did not end within 60 s")

    factory = MCDies()
    signal.signal(signal.SIGALRM, waited_for_ever)
    signal.alarm(60)  # it ends in a few seconds; before the fix it never did
    try:
        with pytest.raises(RunIncomplete, match="node tuned_c: fake engine: died"):
            run_dag_file(workspace.dag(ROUTER_DAG), workspace.out, CPU2, console=Console(quiet=True), engine_factory=factory,
                         prefix_order=False, schedule="plan", profiles_root=profiles, pilots_only=True)
    finally:
        signal.alarm(0)
    answered = {e.config.model.rsplit("/", 1)[-1] for e in factory.started if e.seen}
    assert answered == {"m_a", "m_b", "m_c"}  # every pilot went out; tuned_c's engines died, twice restarted


def test_a_run_files_answer_lengths_and_a_prompt_set_the_store_has_seen_gets_no_pilot(workspace, profiles, isolated_home,
                                                                                       tmp_path, monkeypatch):
    import batchllm.runtime.launch as launch
    from batchllm.costmodel.length_model.observations import ObservationStore
    from batchllm.runtime.length_learning import SAMPLE_PER_NODE

    many_questions(workspace, 300)
    store = ObservationStore.at_home(isolated_home, "./tiny-model")
    monkeypatch.setattr(launch, "installed_engine_version", lambda: "vllm 0.32.0")
    run(workspace, FakeEngineFactory(), schedule="plan", profiles=profiles, out=tmp_path / "fake")
    assert not store.path.exists()  # engines that report 'fake', not the installed engine: their lengths teach nothing

    monkeypatch.setattr(launch, "installed_engine_version", lambda: "fake")  # as if the fake were the installed engine
    run(workspace, FakeEngineFactory(), schedule="plan", profiles=profiles)
    prints = fingerprints(workspace)
    assert store.prompt_sets() == set(prints.values())  # a, b and judge: each node's fingerprint keys its prompt set
    seen = store.load()
    assert len(seen) == 3 * min(300, SAMPLE_PER_NODE) and (seen.lengths >= 1).all()
    assert {p.template for p in seen.prompts} == set(ORDER) and "A Question 7?" in {p.last_user for p in seen.prompts}

    again = FakeEngineFactory()  # the same data in a new folder: its lengths are known, so it starts in row order
    run(workspace, again, schedule="plan", profiles=profiles, out=tmp_path / "again")
    assert sent_rows(again, "a")[:5] == [0, 1, 2, 3, 4]


ONE_NODE_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      a:
        model: ./tiny-model
        prompt: "A {{ question }}"
    outputs:
      out: {columns: {a: a}}
"""


def test_after_its_pilot_a_node_has_run_only_since_the_rest_began(workspace, profiles, monkeypatch):
    """The rest of a node after its pilot is timed from its own start: the pilot's time on the
    same plan, counted as time along the whole node's run, made the time left too short."""
    import batchllm.runtime.calibrated_stages as calibrated_stages

    many_questions(workspace, 300)
    monkeypatch.setattr(calibrated_stages, "ETA_INTERVAL_S", 0.0)  # re-estimate at every turn, however long it takes
    monkeypatch.setattr(calibrated_stages, "ETA_BUDGET_SHARE", float("inf"))
    seen = []  # (run clock, a's running_s) at every re-estimate
    original = calibrated_stages.RunEstimates.tick

    def tick(self, now_s, progress, state):
        nodes, _ = state()
        if "a" in nodes:
            seen.append((now_s, nodes["a"].running_s))
        return original(self, now_s, progress, state)

    monkeypatch.setattr(calibrated_stages.RunEstimates, "tick", tick)
    run(workspace, FakeEngineFactory(), schedule="plan", profiles=profiles, dag_text=ONE_NODE_DAG)
    stages = json.loads((workspace.out / "run.json").read_text())["stages"]
    assert [s["nodes"]["a"]["plan"] for s in stages[:2]] == [stages[0]["nodes"]["a"]["plan"]] * 2  # the plan was kept
    rest_start_s = stages[1]["start_s"]
    after = [(now_s, running_s) for now_s, running_s in seen if now_s >= rest_start_s]
    assert after and after[0][1] <= after[0][0] - rest_start_s + stages[0]["duration_s"] / 2  # not the pilot's time on top


def test_a_replica_holding_its_calls_back_hands_what_waits_for_it_to_the_other(workspace, profiles):
    """A server whose latency guard cut it to 0 holds the calls it has (aborted, sent again
    once allowed): they count as on it, but it runs none of them, so what waits for it goes
    to the other replica instead of waiting for the guard."""
    from tests.fakes import FakeEngine

    class HoldingEngine(FakeEngine):
        """Takes its first batch, then allows 0 and answers nothing for `hold_polls` polls."""

        def __init__(self, config, hold_polls: int):
            super().__init__(config)
            self.hold_polls = hold_polls

        def in_flight_limit(self) -> int:
            return 0 if self.seen and self.hold_polls > 0 else super().in_flight_limit()

        def poll(self, timeout_s: float):
            if self.seen and self.hold_polls > 0:
                self.hold_polls -= 1
                return []
            return super().poll(timeout_s)

    class Factory(FakeEngineFactory):
        def __call__(self, config):
            engine = HoldingEngine(config, hold_polls=200) if config.replica.device_ids == (1,) else FakeEngine(config)
            self.started.append(engine)
            return engine

    many_questions(workspace, 28)  # 14 a replica: 8 go into each engine, 6 wait
    factory = Factory()
    run(workspace, factory, schedule="max", profiles=profiles, dag_text=ONE_NODE_DAG)
    held = next(e for e in factory.started if isinstance(e, HoldingEngine))
    free = next(e for e in factory.started if not isinstance(e, HoldingEngine))
    assert len(held.seen) == 8 and len(free.seen) == 20  # the 6 that waited for the held one ran on the other
    assert node_keys(workspace.out, "a") == [(f"r{i:03d}", 0) for i in range(28)]
