"""NodeWork bookkeeping: which (row, step) units exist, when they are ready, what they render."""

from __future__ import annotations

from batchllm.io.inputs import load_input
from batchllm.io.journal import ResultRecord
from batchllm.runtime.node_work import NodeWork
from batchllm.dag.loader import load_dag


def done_record(row: str, step: int, text: str) -> ResultRecord:
    return ResultRecord(row, step, (text,), 1, 1, "stop")


def finish(work: NodeWork, done: dict, requests, text=lambda r: f"out {r.prompt}") -> None:
    for request in requests:
        rec = work.record_for(request.request_id, (text(request),), 1, 1, "stop")
        done[rec.key] = rec


def test_fan_in_and_routing_select_rows(workspace):
    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          route: {model: ./tiny-model, prompt: "{{ question }}"}
          other: {model: ./tiny-model, prompt: "{{ question }}"}
          expert:
            model: ./tiny-model
            where: "route = 'TECH' AND question LIKE '%SQL%' OR row_id = 'q1'"
            prompt: "{{ question }} / {{ route }} / {{ other }}"
    """))
    data = load_input(dag.inputs["questions"])
    upstream = {"route": {"q1": "TECH", "q2": "TECH", "q4": "TECH"}, "other": {"q1": "x", "q4": "y", "q3": "z"}}
    work = NodeWork(dag.nodes["expert"], data, upstream, {})
    requests = work.ready_requests()
    # q2 lacks `other`, q3 lacks `route`: only rows with every upstream output take part.
    assert [r.prompt for r in requests] == ["What is a prime number? / TECH / x", "What does SQL stand for? / TECH / y"]
    assert work.total_units == 2
    assert work.ready_requests() == []  # nothing is handed out twice


def test_iteration_steps_become_ready_one_at_a_time(workspace):
    dag = load_dag(workspace.dag("""
        inputs:
          documents: {path: documents.parquet, id_column: doc_id}
        nodes:
          summary:
            model: ./tiny-model
            iterate: {over: chunks, as: chunk}
            prompt: "{{ step }}:{{ chunk }}:{{ previous }}"
    """))
    done: dict = {}
    work = NodeWork(dag.nodes["summary"], load_input(dag.inputs["documents"]), {}, done)
    assert work.total_units == 4  # 3 + 1 + 0 chunks
    first = work.ready_requests()
    assert [r.prompt for r in first] == ["0:alpha one:None", "0:beta one:None"]
    finish(work, done, first)
    second = work.ready_requests()
    assert [r.prompt for r in second] == ["1:alpha two:out 0:alpha one:None"]
    finish(work, done, second)
    finish(work, done, work.ready_requests())
    assert work.is_finished()
    assert work.final_records()["d1"].text == "out 2:alpha three:out 1:alpha two:out 0:alpha one:None"
    assert "d3" not in work.final_records()  # an empty list has no steps and no output


def test_resume_hands_out_only_missing_units(workspace):
    dag = load_dag(workspace.dag("""
        inputs:
          documents: {path: documents.parquet, id_column: doc_id}
        nodes:
          summary:
            model: ./tiny-model
            iterate: {over: chunks}
            prompt: "{{ item }}|{{ previous }}"
    """))
    done = {("d1", 0): done_record("d1", 0, "S0"), ("d2", 0): done_record("d2", 0, "B")}
    work = NodeWork(dag.nodes["summary"], load_input(dag.inputs["documents"]), {}, done)
    assert work.done_units == 2
    assert [(r.request_id, r.prompt) for r in work.ready_requests()] == [("summary:d1:1", "alpha two|S0")]


def test_requeue_after_a_lost_engine(workspace):
    from tests.conftest import ENSEMBLE_DAG

    dag = load_dag(workspace.dag(ENSEMBLE_DAG))
    work = NodeWork(dag.nodes["a"], load_input(dag.inputs["questions"]), {}, {})
    assert len(work.ready_requests()) == 4
    work.requeue_in_flight()
    assert len(work.ready_requests()) == 4
