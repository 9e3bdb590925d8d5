"""What a command costs outside its stages (its start and end), measured per host and kept like
step latencies, and shown as a part of its own in `plan`, the run's time left and its summary."""

from __future__ import annotations

import json
import time

from rich.console import Console

from batchllm.core import process_clock
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.command_times import KEPT_COMMANDS, CommandTimes, CommandTimesStore, command_key
from batchllm.engines.hardware import this_machine
from batchllm.planner.plan_file import plan_dag_file
from batchllm.planner.report import print_report, report_json
from tests.conftest import ENSEMBLE_DAG
from tests.test_run_cli import run_cli


def test_a_measurement_moves_what_is_kept_by_a_running_mean_over_at_most_eight_commands():
    times = CommandTimes(40.0, 4.0)
    second = times.with_measured(20.0, 2.0)
    assert (second.start_s, second.end_s, second.commands) == (30.0, 3.0, 2)
    for _ in range(20):
        second = second.with_measured(100.0, 10.0)
    assert second.commands == 22
    before = second
    after = before.with_measured(0.0, 0.0)  # one fast start moves it by 1/KEPT_COMMANDS, not all the way
    assert after.start_s == before.start_s * (1 - 1 / KEPT_COMMANDS)


def test_the_store_keeps_times_per_host_command_and_models(tmp_path):
    store, identity = CommandTimesStore(ProfileStore(tmp_path)), this_machine("cpu")
    assert command_key("run", ["b", "a", "b"]) == "run a b"
    assert store.load(identity, "run a") is None
    store.record(identity, "run a", 30.0, 3.0)
    kept = store.record(identity, "run a", 50.0, 5.0)
    store.record(identity, "plan --pilot a", 10.0, 1.0)
    assert store.load(identity, "run a") == kept == CommandTimes(40.0, 4.0, 2)
    assert store.load(identity, "plan --pilot a") == CommandTimes(10.0, 1.0, 1)
    assert store.path(identity).parent.parent == tmp_path  # beside the learnt profiles of this host
    store.path(identity).write_text("{not json")
    assert store.load(identity, "run a") is None  # unreadable: measured again, never an error


def test_a_run_after_a_pilot_command_takes_its_start_less_the_settings_check_whose_verdict_it_finds_kept(tmp_path):
    store, identity = CommandTimesStore(ProfileStore(tmp_path)), this_machine("cpu")
    piloted = store.record(identity, "plan --pilot a", 26.3, 6.7, checks_s=21.0)
    assert piloted.checks_s == 21.0
    assert piloted.with_checks_kept() == CommandTimes(26.3 - 21.0, 6.7, 1, 0.0)
    assert store.record(identity, "plan --pilot a", 30.3, 6.7, checks_s=23.0).checks_s == 22.0  # a running mean, as the start


def test_a_plan_shows_the_runs_own_start_and_end_as_parts_of_the_estimate(workspace):
    report = plan_dag_file(workspace.dag(ENSEMBLE_DAG.replace("tiny-model", "smollm2-135m")), "1xA100-80G")
    plain = report_json(report)
    assert plain["estimated_s"] == plain["total_s"] and "command_start_s" not in plain
    with_command = report_json(type(report)(**{**report.__dict__, "command": CommandTimes(38.0, 4.5, 3),
                                               "command_source": "measured on this machine over 3 `run` commands"}))
    assert with_command["estimated_s"] == round(plain["total_s"] + 42.5, 3)
    assert (with_command["command_start_s"], with_command["command_end_s"]) == (38.0, 4.5)
    console = Console(record=True, width=200)
    print_report(type(report)(**{**report.__dict__, "command": CommandTimes(38.0, 4.5, 3), "command_source": "measured"}), console)
    assert (f"what `run` takes: about {report.chosen.total_s + 42.5:.1f} s: its start 38.0 s + the stages "
            f"{report.chosen.total_s:.1f} s + its end 4.5 s (measured)") in console.export_text()


def test_a_run_keeps_its_own_start_and_end_for_this_machine_and_reports_its_start(workspace, monkeypatch, isolated_home):
    store = CommandTimesStore(ProfileStore.at_home(isolated_home))
    assert run_cli(workspace, monkeypatch, ENSEMBLE_DAG).exit_code == 0
    key = command_key("run", ["./tiny-model"])  # the DAG's models as it names them
    kept = store.load(this_machine("cpu"), key)
    assert kept is not None and kept.commands == 1 and kept.start_s > 0 and kept.end_s >= 0
    report = json.loads((workspace.root / "out" / "run.json").read_text())
    assert report["command_start_s"] == kept.start_s
    assert run_cli(workspace, monkeypatch, ENSEMBLE_DAG, "--fresh").exit_code == 0
    assert store.load(this_machine("cpu"), key).commands == 2


def test_the_process_age_counts_from_before_this_module_was_imported():
    waited = time.monotonic() - process_clock._IMPORTED_AT
    assert process_clock.process_age_s() >= waited - 0.02  # /proc counts in clock ticks (10 ms)


def test_plan_estimates_a_runs_start_with_the_settings_check_it_keeps_and_else_its_own(workspace, isolated_home):
    """`plan` checks vLLM's settings and keeps the verdict, so the `run` after it starts without
    the check: kept runs that checked count less their check; with no command kept, the plan's
    own start (less what it does that the run will not) stands in."""
    from batchllm.cli.plan_command import _run_command_times
    from batchllm.dag.loader import load_dag

    dag = load_dag(workspace.dag(ENSEMBLE_DAG))
    own = CommandTimes(3.5, 0.0)
    assert _run_command_times(dag, fallback="plan --pilot", this_plan=own)[0] == own
    assert _run_command_times(dag, fallback="plan --pilot") == (None, "")
    store = CommandTimesStore(ProfileStore.at_home(isolated_home))
    store.record(this_machine("cpu"), command_key("run", ["./tiny-model"]), 8.1, 0.4, checks_s=5.6)  # a run that checked
    times, source = _run_command_times(dag, fallback="plan --pilot", this_plan=own)
    assert (round(times.start_s, 6), times.end_s) == (2.5, 0.4)
    assert "verdict kept" in source
