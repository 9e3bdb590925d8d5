"""Progress a person can read anywhere: plain lines when output is not a terminal, the ETA
over the last minute, the status file the driver writes, and an end-of-run summary that
fits 80 columns uncut. Every time comes from a fake clock: nothing sleeps."""

from __future__ import annotations

import io
import json
import os
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console

from batchllm.runtime.ledger import UnitCounts
from batchllm.runtime.progress import NodeStats, RunProgress, eta_s, progress_line
from batchllm.runtime.run_summary import summary_lines
from batchllm.runtime.status import read_status


class Units:
    """A node's unit counts as its ledger would give them (`NodeStats.counts`)."""

    def __init__(self, total: int, committed: int = 0, expected: int | None = None):
        self.total, self.committed, self.expected = total, committed, expected

    def __call__(self) -> UnitCounts:
        return UnitCounts(self.total, self.committed, self.total if self.expected is None else self.expected)


def commit(progress: RunProgress, node: str, units: int, **tokens) -> None:
    """`units` results of `node` committed: the ledger counts them, and the progress is told."""
    progress.stats[node].counts.committed += units
    progress.advance(node, **tokens)


MIDNIGHT = datetime(2026, 11, 25, tzinfo=UTC)  # the wall clock when the progress clock reads 0


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def log_progress(tmp_path, terminal: bool = False) -> tuple[RunProgress, Clock, io.StringIO]:
    clock, text = Clock(), io.StringIO()
    console = Console(file=text, width=80, force_terminal=terminal)
    progress = RunProgress(console, tmp_path / ".batchllm" / "status.json", line_interval_s=30.0, clock=clock,
                           wall_time=lambda: f"T{clock.now_s:.0f}", wall_clock=lambda: MIDNIGHT + timedelta(seconds=clock.now_s))
    return progress, clock, text


def test_without_a_terminal_a_line_per_running_node_every_interval_and_at_the_end(tmp_path):
    progress, clock, text = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", Units(1000, 100), units_done_before=100))
    progress.start_node(NodeStats("judge", "m", Units(50, 0), units_done_before=0))
    for second in range(1, 31):
        clock.now_s = 100.0 + second
        commit(progress, "gen", 10, prompt_tokens=10, output_tokens=20)
        progress.tick()
    assert text.getvalue() == ("gen: 400/1,000 units (40%), 20 output tok/s, ETA 1m00s (ends 2026-11-25 00:03 UTC)\n"
                               "judge: 0/50 units (0%), 0 output tok/s, ETA ?\n")
    clock.now_s = 140.0
    commit(progress, "gen", 600, failed=3)
    progress.finish_node("gen")
    progress.tick()  # not due yet: the next lines come 30 s after the last ones
    clock.now_s = 160.0
    progress.tick()  # due: only the node still running
    assert text.getvalue().splitlines()[2:] == ["judge: 0/50 units (0%), 0 output tok/s, ETA ?"]
    progress.close("finished")
    assert text.getvalue().splitlines()[3:] == ["gen: 1,000/1,000 units (100%), 15 output tok/s, ETA 0s",
                                                "judge: 0/50 units (0%), 0 output tok/s, ETA ?"]


def test_tokens_come_with_the_call_and_units_from_the_ledgers_counts(tmp_path):
    progress, _, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", Units(10, 0), units_done_before=0))
    progress.stats["gen"].counts.committed += 1  # the ledger committed one
    progress.advance("gen", 7, 9)
    stats = progress.stats["gen"]
    assert (stats.units_done, stats.prompt_tokens, stats.output_tokens, stats.failed) == (1, 7, 9, 0)


def test_the_eta_follows_the_last_minute_and_is_unknown_when_the_node_stalls(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", Units(10_000, 0), units_done_before=0))
    for second in range(1, 61):  # 100 units/s for a minute
        clock.now_s = 100.0 + second
        commit(progress, "gen", 100)
    for second in range(61, 121):  # then 1 unit/s
        clock.now_s = 100.0 + second
        commit(progress, "gen", 1)
    stats = progress.stats["gen"]
    assert eta_s(stats, 220.0) == 3940.0  # 3,940 left at the last minute's 1 unit/s
    assert eta_s(stats, 400.0) is None  # nothing in the last minute
    stats.counts.committed = 10_000
    assert eta_s(stats, 400.0) == 0.0


def test_many_calls_within_a_second_keep_one_rate_sample(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", Units(100_000, 0), units_done_before=0))
    for k in range(10_000):
        clock.now_s = 100.0 + k / 20_000  # 10,000 polls in half a second
        commit(progress, "gen", 3, output_tokens=2)
    stats = progress.stats["gen"]
    assert (len(stats.recent), stats.units_done, stats.output_tokens) == (1, 30_000, 20_000)


def test_on_a_terminal_bars_and_no_log_lines(tmp_path):
    progress, clock, text = log_progress(tmp_path, terminal=True)
    assert progress.bars_shown
    progress.start_node(NodeStats("gen", "m", Units(10, 0), units_done_before=0))
    clock.now_s = 200.0
    commit(progress, "gen", 4)
    progress.tick()
    progress.close("interrupted")
    assert "units (" not in text.getvalue()
    assert read_status(tmp_path).state == "interrupted"


def test_the_status_file_from_start_through_ticks_to_the_end(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    path = tmp_path / ".batchllm" / "status.json"
    with progress:
        assert json.loads(path.read_text()) == {"state": "running", "elapsed_s": 0.0, "nodes": {}, "pid": os.getpid(),
                                                "started_at": "T100", "updated_at": "T100"}
        progress.start_node(NodeStats("gen", "/models/m", Units(1000, 40), units_done_before=40))
        started = json.loads(path.read_text())["nodes"]  # at once: its engines take a while to start
        assert (started["gen"]["committed"], started["gen"]["total"]) == (40, 1000)
        clock.now_s = 101.0
        commit(progress, "gen", 25, prompt_tokens=5, output_tokens=7)
        progress.tick()  # written every 2 s: not yet
        assert json.loads(path.read_text())["nodes"] == started
        for second in range(2, 11):
            clock.now_s = 100.0 + second
            commit(progress, "gen", 25, prompt_tokens=5, output_tokens=7, failed=1 if second == 3 else 0)
            progress.tick()
        assert json.loads(path.read_text()) == {
            "state": "running", "elapsed_s": 10.0, "pid": os.getpid(), "started_at": "T100", "updated_at": "T110",
            "nodes": {"gen": {"model": "/models/m", "committed": 290, "total": 1000, "failed": 1, "prompt_tokens": 50,
                              "output_tokens": 70, "output_tokens_per_s": 7.0, "eta_s": 28.4, "servers": []}}}
        clock.now_s = 111.0
        commit(progress, "gen", 710)
        progress.finish_node("gen")
        progress.close("finished")
    data = json.loads(path.read_text())
    assert (data["state"], data["updated_at"], data["nodes"]["gen"]["committed"], data["nodes"]["gen"]["eta_s"]) == (
        "finished", "T111", 1000, 0.0)
    assert not list((tmp_path / ".batchllm").glob("*.tmp"))  # no temporary left beside it


def test_a_run_ends_in_one_of_three_states(tmp_path):
    progress, _, _ = log_progress(tmp_path)
    with pytest.raises(ValueError, match="finished, incomplete, interrupted, not 'done'"):
        progress.close("done")


def test_the_summary_fits_80_columns_uncut():
    stats = {
        "concise": NodeStats("concise", "/models/smollm2-135m", Units(1_000_000, 1_000_000), 0, prompt_tokens=52_345_678,
                             output_tokens=48_000_000, engine_load_s=22.4, started_at=0.0, busy_s=3_100.2, prefix_hits=12_000_000,
                             ideal_cached_tokens=13_500_000, finished_at=3_600.0, failed=12),
        "nobody": NodeStats("nobody", "smollm2-135m", Units(0), 0, started_at=0.0, finished_at=0.0),
    }
    text = io.StringIO()
    console = Console(file=text, width=80, force_terminal=False)
    for line in summary_lines(stats, now_s=3_600.0):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    assert "…" not in text.getvalue() and max(map(len, text.getvalue().splitlines())) <= 80
    assert text.getvalue().splitlines() == [
        "batchllm run summary",
        "concise (smollm2-135m): 1,000,000/1,000,000 units, 12 failed",
        "  tokens: prompt 52,345,678, output 48,000,000, 13,333.3 output tok/s",
        "  prefix cache: 12,000,000 tok (23%), ideal 13,500,000",
        "  time: load 22.4 s, engine 3100.2 s, total 3600.0 s",
        "nobody (smollm2-135m): 0 units, no row reached it",
        "  (its `where:` held nowhere, or an upstream node had no output)",
    ]


def test_the_summary_shows_the_cost_at_the_dags_prices(workspace):
    from batchllm.dag.loader import load_dag
    from batchllm.dag.model import Price

    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        prices:
          ./tiny-model: {prompt_per_1m: 0.5, output_per_1m: 2}
        nodes:
          a: {model: ./tiny-model, prompt: "{{ question }}"}
        """))
    assert dag.prices == {"./tiny-model": Price(0.5, 2.0)}
    stats = {"a": NodeStats("a", "./tiny-model", Units(10, 10), 0, prompt_tokens=2_000_000, output_tokens=500_000,
                            started_at=0.0, finished_at=10.0, price=dag.prices["./tiny-model"])}
    assert summary_lines(stats, now_s=10.0)[-1] == "  cost: 2.0000 (prompt 1.0000 + output 1.0000, at the DAG's prices)"


def test_prices_for_a_model_no_node_uses_are_refused(workspace):
    import pytest

    from batchllm.core.errors import UserError
    from batchllm.dag.loader import load_dag

    with pytest.raises(UserError, match="unknown key 'gpt-4' in prices"):
        load_dag(workspace.dag("""
            inputs:
              questions: {path: questions.parquet, id_column: id}
            prices:
              gpt-4: {prompt_per_1m: 0.5, output_per_1m: 2}
            nodes:
              a: {model: ./tiny-model, prompt: "{{ question }}"}
            """))


def test_a_steady_rate_slower_than_the_model_sets_the_eta_and_a_burst_of_commits_does_not(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", Units(100_000, 0), units_done_before=0))
    for second in range(1, 61):  # 100 units/s for a minute: 94,000 left take 940 s at that rate
        clock.now_s = 100.0 + second
        commit(progress, "gen", 100)
    progress.set_estimates({"gen": 60.0}, 60.0, 60.0)  # the engines alone would take a minute
    stats = progress.stats["gen"]
    assert eta_s(stats, 160.0) == 940.0
    assert progress.status(160.0).rest_s == 940.0  # nor does the run end before its node
    progress.set_estimates({"gen": 2_000.0}, 2_000.0, 60.0)  # a model slower than the rate stands
    assert eta_s(stats, 160.0) == 2_000.0

    progress.start_node(NodeStats("judge", "m", Units(5_000, 0), units_done_before=0))
    for second in range(1, 21):  # few units, as when every request runs at once and the first end
        clock.now_s = 160.0 + second
        commit(progress, "judge", 10)
    progress.set_estimates({"judge": 30.0}, 30.0, 80.0)
    assert eta_s(progress.stats["judge"], 180.0) == 30.0  # the rate (9,600 s) is not steady yet: the model's


def test_the_eta_counts_the_units_a_node_is_expected_to_have_not_every_undecided_row(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("tech", "m", Units(10_000, 0), units_done_before=0))
    for second in range(1, 11):  # 10 units/s
        clock.now_s = 100.0 + second
        commit(progress, "tech", 10)
    progress.stats["tech"].counts.expected = 4_100  # 60 % of the decided rows were skipped
    assert eta_s(progress.stats["tech"], 110.0) == (4_100 - 100) * 9 / 90
    assert progress.progress_lines(110.0, running_only=False) == ["tech: 100/10,000 units (1%), 0 output tok/s, ETA 6m40s (ends 2026-11-25 00:08 UTC)"]


def test_a_runs_console_keeps_a_long_line_whole_in_a_log():
    from batchllm.runtime.console import run_console

    log = io.StringIO()
    note = "plan note: prior for ./models/" + "a-rather-long-folder-name/" * 8 + "model: measured on another host"
    run_console(file=log).print(note, markup=False, highlight=False)
    assert log.getvalue() == note + "\n"  # rich would break it at 80 columns


def test_a_note_is_one_line_whatever_the_consoles_width(tmp_path):
    progress, _, text = log_progress(tmp_path)  # an 80-column console that is not a terminal
    note = "engine for judge lost; its log: /tmp/" + "a-long-run-folder/" * 6 + "engine.log"
    progress.note(note)
    assert text.getvalue() == note + "\n"


def test_an_embed_or_score_nodes_pace_is_its_prompt_tokens_a_second_for_it_writes_none():
    pooling = NodeStats("vectors", "minilm-l6", Units(100, 40), 0, prompt_tokens=8_500, started_at=0.0, pools=True)
    generating = NodeStats("gen", "m", Units(100, 40), 0, prompt_tokens=8_500, output_tokens=300, started_at=0.0)
    assert progress_line(pooling, 10.0).startswith("vectors: 40/100 units (40%), 850 prompt tok/s, ETA ")
    assert progress_line(generating, 10.0).startswith("gen: 40/100 units (40%), 30 output tok/s, ETA ")
    assert pooling.rate_text(10.0, digits=1) == "850.0 prompt tok/s"
