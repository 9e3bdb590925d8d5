"""`batchllm run` as a user sees it in an 80-column terminal or a log file (CliRunner; the
scripted fake engine stands in for vLLM, so only the times vary: they are masked)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from batchllm.cli import app
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import FakeEngineFactory

ROUTED_DAG = ENSEMBLE_DAG.replace('prompt: "B {{ question }}"', """prompt: "B {{ question }}"
        where: "question LIKE '%nothing matches this%'\"""")


def run_cli(workspace, monkeypatch, dag_text: str, *extra: str):
    monkeypatch.setattr("batchllm.runtime.launch.start_vllm_engine", FakeEngineFactory())
    monkeypatch.setattr("batchllm.runtime.launch.check_engine_settings", lambda dag, home, kind: None)  # vLLM's check: its own tests
    monkeypatch.chdir(workspace.root)
    return CliRunner().invoke(app, ["run", str(workspace.dag(dag_text)), "--out", "out", "--devices", "cpu:2",
                                    "--schedule", "sequential", "--no-prefix-order", *extra], env={"COLUMNS": "80"})


def masked(text: str) -> list[str]:
    """Times and rates (they vary run to run) as N."""
    return [re.sub(r"\d[\d,]*\.\d+", "N", line) for line in text.splitlines()]


def test_the_end_of_run_summary_fits_80_columns_with_every_node(workspace, monkeypatch):
    result = run_cli(workspace, monkeypatch, ROUTED_DAG)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "…" not in result.output and max(map(len, lines)) <= 80
    summary = masked(result.output[result.output.index("batchllm run summary"):])
    assert summary == [
        "batchllm run summary",
        "b (tiny-model): 0 units, no row reached it",  # nodes in the order they started
        "  (its `where:` held nowhere, or an upstream node had no output)",
        "a (tiny-model): 4/4 units",
        "  tokens: prompt 106, output 114, N output tok/s",
        "  prefix cache: 0 tok (0%), ideal 0",
        "  time: load N s, engine N s, total N s",
        "judge (tiny-model): 0 units, no row reached it",
        "  (its `where:` held nowhere, or an upstream node had no output)",
        "1 stage (sequential): N s, overhead N s (N%)",
        "engines: 1 model load for 1 node on devices",
        "before them: N s, the command's start (imports, checks, planning)",
        "  imports N s, checks N s (vLLM kept), planning N s, rest N s",
        "details: out/run.json",
        "judged: out/judged.parquet",
    ]


def test_a_finished_run_run_again_says_nothing_to_do(workspace, monkeypatch):
    run_cli(workspace, monkeypatch, ENSEMBLE_DAG)
    again = run_cli(workspace, monkeypatch, ENSEMBLE_DAG)
    assert again.exit_code == 0
    assert again.output.splitlines()[-2:] == [
        "Nothing to do: every node's results in out are complete; no engine was started.",
        "judged: out/judged.parquet",
    ]


def run_cli_with(workspace, monkeypatch, factory: FakeEngineFactory, *args: str):
    monkeypatch.setattr("batchllm.runtime.launch.start_vllm_engine", factory)
    monkeypatch.setattr("batchllm.runtime.launch.check_engine_settings", lambda dag, home, kind: None)
    monkeypatch.chdir(workspace.root)
    return CliRunner().invoke(app, ["run", str(workspace.dag(ENSEMBLE_DAG)), "--devices", "cpu:2", "--schedule", "sequential",
                                    "--no-prefix-order", *args], env={"COLUMNS": "80"})


def test_a_try_out_on_the_first_rows_then_the_whole_run_computes_only_the_rest(workspace, monkeypatch):
    """`--rows 2`: the first two questions through every node, in runs/dag-first2; the whole run
    after it takes their answers from the result store and computes the other two rows'."""
    from batchllm.runtime.ledger import UNIT_BITS, UNIT_MASK
    from tests.conftest import QUESTIONS

    tried = FakeEngineFactory()
    result = run_cli_with(workspace, monkeypatch, tried, "--rows", "2")
    assert result.exit_code == 0, result.output
    assert sorted(r.request_id & UNIT_MASK for r in tried.requests) == [0, 0, 0, 1, 1, 1]
    assert (workspace.root / "runs" / "dag-first2" / "judged.parquet").is_file()
    whole = FakeEngineFactory()
    result = run_cli_with(workspace, monkeypatch, whole, "--out", "whole")
    assert result.exit_code == 0, result.output
    assert sorted((r.request_id >> UNIT_BITS, r.request_id & UNIT_MASK) for r in whole.requests) == [
        (node, row) for node in range(3) for row in range(2, len(QUESTIONS))]
    assert "a (tiny-model): 4/4 units, 2 taken from the result store" in result.output


def test_a_try_out_of_no_rows_is_refused_and_writes_nothing(workspace, monkeypatch):
    result = run_cli_with(workspace, monkeypatch, FakeEngineFactory(), "--rows", "0")
    assert result.exit_code == 2
    assert "--rows 0 is not a number of rows" in result.output
    assert not (workspace.root / "runs").exists()


def test_validate_says_what_the_result_store_answers_of_each_node(workspace, monkeypatch):
    """After a run, the DAG with its judge edited: the generators' requests are stored, the judge's
    prompts are new (counted through the stored answers above them, as a run renders them)."""
    assert run_cli_with(workspace, monkeypatch, FakeEngineFactory(), "--out", "out").exit_code == 0
    monkeypatch.setattr("batchllm.engines.settings_check.check_engine_settings", lambda dag, home, kind: None)
    edited = workspace.dag(ENSEMBLE_DAG.replace('prompt: "J {{ a }} | {{ b }}"', 'prompt: "Judge {{ a }} or {{ b }}"'), "edited.yaml")
    result = CliRunner().invoke(app, ["validate", str(edited)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [
        f"the result store ({workspace.root.parent / 'results.sqlite'}) answers, of each node's requests:",
        "  a: 4 of 4 requests stored",
        "  b: 4 of 4 requests stored",
        "  judge: 0 of 4 requests stored",
    ]


def test_the_parts_of_a_commands_start_fit_80_columns_after_a_long_start():
    """A driver inside a long-lived process (a test worker, a notebook) has a large 'imports' part."""
    from batchllm.runtime.run_report import CommandStart

    line = "  " + CommandStart(1234.5, 12.25, 11.4, 10.25).text(1300.0)
    assert line == "  imports 1234.5 s, checks 12.2 s (vLLM 11.4 s), planning 10.2 s, rest 43.0 s"
    assert len(line) <= 80
    assert "(vLLM kept)" in CommandStart(1.2, 3.0, 0.0, 0.3).text(4.5)
