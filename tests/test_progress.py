"""Progress a person can read anywhere: plain lines when output goes to a file, the status
file and `batchllm status` for a running, interrupted or finished run, and an end-of-run
summary that fits 80 columns uncut."""

from __future__ import annotations

import io
import json
import os

from rich.console import Console
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.runtime.progress import NodeStats, RunProgress
from batchllm.runtime.run_summary import summary_lines
from batchllm.runtime.status import RunStatus, write_status


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def log_progress(tmp_path) -> tuple[RunProgress, Clock, io.StringIO]:
    clock, text = Clock(), io.StringIO()
    console = Console(file=text, width=80, force_terminal=False)
    progress = RunProgress(console, tmp_path / ".batchllm" / "status.json", line_interval_s=30.0, clock=clock)
    return progress, clock, text


def test_without_a_terminal_a_line_per_node_every_interval_and_at_the_end(tmp_path):
    progress, clock, text = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", units_total=1000, units_done_before=100))
    for second in range(1, 31):
        clock.now_s = 100.0 + second
        progress.advance("gen", prompt_tokens=10, output_tokens=20, units=10)
        progress.tick()
    assert text.getvalue() == "gen: 400/1,000 units (40%), 20 output tok/s, ETA 0:01:00\n"
    clock.now_s = 140.0
    progress.advance("gen", prompt_tokens=0, output_tokens=0, units=600, failed=3)
    progress.finish_node("gen")
    progress.close("finished")
    assert text.getvalue().splitlines()[-1] == "gen: 1,000/1,000 units (100%), 15 output tok/s, ETA 0:00:00"


def test_the_status_file_and_batchllm_status_for_a_running_run(tmp_path):
    progress, clock, _ = log_progress(tmp_path)
    progress.start_node(NodeStats("gen", "m", units_total=1000, units_done_before=0))
    for second in range(1, 11):
        clock.now_s = 100.0 + second
        progress.advance("gen", prompt_tokens=5, output_tokens=7, units=25, failed=1 if second == 3 else 0)
    progress.tick()
    data = json.loads((tmp_path / ".batchllm" / "status.json").read_text())
    assert data["state"] == "running" and data["pid"] == os.getpid()
    assert data["nodes"]["gen"] == {"model": "m", "committed": 250, "total": 1000, "failed": 1, "prompt_tokens": 50,
                                    "output_tokens": 70, "output_tokens_per_s": 7.0, "eta_s": 30.0}
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 0
    assert result.output.splitlines()[1:] == ["  gen  250/1,000 (25%), 1 failed, 70 output tok, ETA 0:00:30"]
    assert result.output.startswith(f"{tmp_path}: running, 0:00:10 elapsed, updated ")
    as_json = json.loads(CliRunner().invoke(app, ["status", str(tmp_path), "--json"]).output)
    assert as_json["state"] == "running" and as_json["nodes"]["gen"]["committed"] == 250


def test_a_running_status_whose_driver_is_gone_is_interrupted_and_a_finished_one_says_so(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    write_status(tmp_path / ".batchllm" / "status.json", RunStatus("running", 12.0, {}, pid=dead, updated_at="T"))
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.output == f"{tmp_path}: interrupted (run the same command again to resume), 0:00:12 elapsed, updated T\n"
    write_status(tmp_path / ".batchllm" / "status.json", RunStatus("finished", 3661.0, {}, updated_at="T"))
    assert CliRunner().invoke(app, ["status", str(tmp_path)]).output == f"{tmp_path}: finished, 1:01:01 elapsed, updated T\n"


def test_status_of_a_folder_without_a_run_is_exit_2_with_what_to_do(tmp_path):
    result = CliRunner().invoke(app, ["status", str(tmp_path / "nothing")])
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        f"error: OUT: '{tmp_path / 'nothing'}' has no batchllm run. Fix: give the --out folder of a run, "
        "or start one with `batchllm run DAG --out OUT`.")


def test_the_summary_fits_80_columns_uncut():
    stats = {
        "concise": NodeStats("concise", "/models/smollm2-135m", 1_000_000, 0, units_done_now=1_000_000, prompt_tokens=52_345_678,
                             output_tokens=48_000_000, engine_load_s=22.4, started_at=0.0, busy_s=3_100.2, prefix_hits=12_000_000,
                             ideal_cached_tokens=13_500_000, finished_at=3_600.0, failed=12),
        "nobody": NodeStats("nobody", "smollm2-135m", 0, 0, started_at=0.0, finished_at=0.0),
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
