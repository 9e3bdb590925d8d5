"""`batchllm status OUT [--json]` for a run that is going, was interrupted (its driver is
gone) or finished, and for a folder that holds no run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.runtime.status import NodeStatus, RunStatus, write_status

GEN = NodeStatus(model="smollm2-135m", committed=250, total=1000, failed=1, prompt_tokens=12_500, output_tokens=7_000,
                 output_tokens_per_s=700.4, eta_s=30.0)
JUDGE = NodeStatus(model="smollm2-135m", committed=0, total=0, failed=0, prompt_tokens=0, output_tokens=0,
                   output_tokens_per_s=0.0, eta_s=None)


def write(tmp_path, state: str, pid: int = os.getpid(), elapsed_s: float = 10.0) -> None:
    write_status(tmp_path / ".batchllm" / "status.json",
                 RunStatus(state, elapsed_s, {"gen": GEN, "judge": JUDGE}, pid=pid, started_at="S", updated_at="U"))


def status(*args: str):
    return CliRunner().invoke(app, ["status", *map(str, args)])


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_running_run(tmp_path):
    write(tmp_path, "running")
    result = status(tmp_path)
    assert result.exit_code == 0
    assert result.output == (
        f"{tmp_path}: running, 0:00:10 elapsed (updated U)\n"
        "gen: 250/1,000 units (25%), 1 failed, ETA 30s\n"
        "  tokens: prompt 12,500, output 7,000, 700 output tok/s\n"
        "judge: 0/0 units, ETA ?\n"
        "  tokens: prompt 0, output 0, 0 output tok/s\n")


def test_a_running_status_whose_driver_is_gone_is_interrupted(tmp_path):
    write(tmp_path, "running", pid=dead_pid(), elapsed_s=12.0)
    result = status(tmp_path)
    assert result.exit_code == 0
    assert result.output == (
        f"{tmp_path}: interrupted, 0:00:12 elapsed (updated U)\n"
        "  run the same `batchllm run` command again to resume\n"
        "gen: 250/1,000 units (25%), 1 failed\n"
        "  tokens: prompt 12,500, output 7,000, 700 output tok/s\n"
        "judge: 0/0 units\n"
        "  tokens: prompt 0, output 0, 0 output tok/s\n")
    assert json.loads(status(tmp_path, "--json").output)["state"] == "interrupted"


def test_a_finished_run_says_so_even_after_its_driver_is_gone(tmp_path):
    write(tmp_path, "finished", pid=dead_pid(), elapsed_s=3661.0)
    result = status(tmp_path)
    assert result.exit_code == 0
    assert result.output.splitlines()[:2] == [f"{tmp_path}: finished, 1:01:01 elapsed (updated U)",
                                             "gen: 250/1,000 units (25%), 1 failed"]


def test_json(tmp_path):
    write(tmp_path, "running")
    result = status(tmp_path, "--json")
    assert result.exit_code == 0
    assert json.loads(result.output) == {
        "state": "running", "started_at": "S", "updated_at": "U", "elapsed_s": 10.0, "pid": os.getpid(),
        "nodes": {
            "gen": {"model": "smollm2-135m", "committed": 250, "total": 1000, "failed": 1, "prompt_tokens": 12_500,
                    "output_tokens": 7_000, "output_tokens_per_s": 700.4, "eta_s": 30.0},
            "judge": {"model": "smollm2-135m", "committed": 0, "total": 0, "failed": 0, "prompt_tokens": 0,
                      "output_tokens": 0, "output_tokens_per_s": 0.0, "eta_s": None}}}


def test_a_folder_without_a_run_is_exit_2_with_what_to_do(tmp_path):
    result = status(tmp_path / "nothing")
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        f"error: OUT: '{tmp_path / 'nothing'}' has no batchllm run. Fix: give the --out folder of a run, "
        "or start one with `batchllm run DAG --out OUT`.")


def test_a_run_folder_without_a_status_file_is_exit_2(tmp_path):
    (tmp_path / ".batchllm" / "journal").mkdir(parents=True)
    result = status(tmp_path)
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        f"error: OUT: '{tmp_path}' holds a batchllm run that has not written .batchllm/status.json (an older batchllm, "
        "or a run stopped before it began). Fix: run the same `batchllm run` command again.")


def test_an_unreadable_status_file_is_exit_2(tmp_path):
    (tmp_path / ".batchllm").mkdir()
    (tmp_path / ".batchllm" / "status.json").write_text('{"state": "running"}')
    result = status(tmp_path)
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        f"error: OUT: '{tmp_path / '.batchllm' / 'status.json'}' is not a status file this batchllm can read (no 'nodes' field). "
        "Fix: run the same `batchllm run` command again to rewrite it.")


def test_a_long_eta_says_the_time_left_and_the_date_and_time_it_ends():
    from batchllm.runtime.status import format_time_left, status_lines

    assert [format_time_left(s) for s in (0, 42.4, 425, 3600, 63_467, 200_000)] == ["0s", "42s", "7m05s", "1h00m", "17h37m", "2d07h"]
    node = NodeStatus(model="m", committed=1, total=1_000_000, failed=0, prompt_tokens=0, output_tokens=0,
                      output_tokens_per_s=0.0, eta_s=63_467.0)
    lines = status_lines(Path("runs/big"), RunStatus("running", 600.0, {"gen": node}, pid=1, started_at="S",
                                                     updated_at="2026-11-25T10:00:00+00:00", rest_s=63_467.0))
    assert lines[0] == "runs/big: running, 0:10:00 elapsed, about 17h37m left (ends 2026-11-26 03:37 UTC) (updated 2026-11-25T10:00:00+00:00)"
    assert lines[1] == "gen: 1/1,000,000 units (0%), ETA 17h37m (ends 2026-11-26 03:37 UTC)"
