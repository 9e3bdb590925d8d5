"""Calibration on the real engine: how wrong the estimate is before, during and after runs
that start from a wrong prior, and from a prior learnt on this machine.

    .venv/bin/python benchmarks/calibration.py [OWN_PROFILE_DIR] [--xeon-only]    (about an hour on 2 cores)
    .venv/bin/python benchmarks/calibration.py --commands

--xeon-only: only the `xeon` foreign cases and the learnt ones (each learnt from a xeon run).
--commands: what the user waits for instead: whole `plan` and `run` commands, each a process
timed from outside, against `plan`'s estimate and the run's own (benchmarks/command_estimates.py).

Model: the embedded smollm2-135m; devices cpu:2, planned by batchllm (`schedule: plan`).
First the machine's own profile is taken with `batchllm profile --quick`'s code (into a
scratch store), unless a folder holding one is given. Then three single-node workloads (prompt set, count, max_tokens) are
each planned and run with three foreign priors, placed where the shipped profile of this
CPU kind would be:

    xeon       the committed profile of the other CPU kind (cpu-intel-xeon)
    own x2     this machine's own profile, step latency and load time scaled by 2
    own x0.5   the same scaled by 0.5

and once more with (b) the prior learnt from one earlier run of a *different* workload
(the store one of the `xeon` runs of the previous workload left behind; for the first
workload, the last one's). Every case runs in its own $BATCHLLM_HOME (models linked in),
so no case sees another's learnt profile.

Per case it prints the error of (estimate - measured) / measured:
    measured  from the first stage's start (where the plan is made) to the last result;
              the set-up before it and the engines' stop after it are printed apart
    initial   the plan's estimate of the whole run, before anything ran
    @20%      the calibrated estimate of the time left, at the first re-estimate (every 2 s)
              after 20 % of the engines' work was done (20 % of the time from the plan's
              engines being up to the last result: they step without pause), against the
              time that was actually left. (By units committed it would be near the end:
              requests that run all at once finish together, most of them at max_tokens.)
    final     the whole run re-estimated with the calibration at its end, on the plans the
              run executed (what the same workload would be estimated at next time)
Each run starts with its pilot (a new prompt set: 64 random rows first), so `initial` is the
first estimate after it, pilot time included; `prior` is the plan made before it. Targets
(issue 28): |initial| <= 10 % on every workload with every prior; |@20%| <= 10 %; median
over all estimates <= 5 %. The machine is shared (other jobs, a long benchmark): the load
average is printed per case, and times are noisy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.costmodel.calibration.latency import scaled  # noqa: E402
from batchllm.costmodel.calibration.store import ProfileStore  # noqa: E402
from batchllm.costmodel.estimator import ExecutionPlan  # noqa: E402
from batchllm.costmodel.profile import Profile, ReplicaShape  # noqa: E402
from batchllm.engines.devices import DeviceSet  # noqa: E402
from batchllm.engines.hardware import this_machine  # noqa: E402
from batchllm.engines.process_engine import start_vllm_engine  # noqa: E402
from batchllm.models.registry import batchllm_home, resolve_model  # noqa: E402
from batchllm.planner.best import best_schedule  # noqa: E402
from batchllm.planner.timeline import Timeline  # noqa: E402
from batchllm.profiling.quick import quick_profile  # noqa: E402
from batchllm.runtime import launch  # noqa: E402
from batchllm.runtime.run_calibration import RunCalibration  # noqa: E402
from benchmarks.command_estimates import single_node_dag  # noqa: E402

MODEL = "smollm2-135m"
DEVICES = DeviceSet("cpu", (0, 1))
WORK = REPO / "benchmarks" / "results" / "calibration-work"
FIRST_UNUSED = 300  # first_turns[0:300] profiled the model


@dataclasses.dataclass(frozen=True)
class Workload:
    label: str
    count: int
    max_tokens: int

    def prompts(self) -> list[str]:
        if self.label.startswith("first-turns"):
            texts = pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()[FIRST_UNUSED:]
            return [t for t in texts if 20 <= len(t) <= 300][: self.count]
        if self.label.startswith("multi-turn"):  # the end of each conversation: what the last turn sees
            texts = pq.read_table(REPO / "profiles" / "prompts" / "multi_turn.parquet").column("prompt").to_pylist()
            return [t[-300:] for t in texts][: self.count]
        return [f"Write a short sentence about the number {i}." for i in range(self.count)]


# Large enough for several batches (a pilot, then the rest), small enough for a shared 2-core machine.
WORKLOADS = [Workload("first-turns-400x64", 400, 64), Workload("multi-turn-400x96", 400, 96),
             Workload("numbers-2000x128", 2000, 128)]
FOREIGN = ["xeon", "own x2", "own x0.5"]


def dag_file(workload: Workload) -> Path:
    texts = workload.prompts()
    if len(texts) != workload.count:
        raise SystemExit(f"{workload.label}: only {len(texts)} prompts")
    return single_node_dag(WORK / "dags", workload.label, texts, workload.max_tokens)


def case_home(name: str) -> Path:
    home = WORK / "homes" / name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "models").symlink_to(batchllm_home() / "models")
    return home


def prior_root(name: str, profile: Profile) -> Path:
    """A profiles folder whose profile for this CPU kind is `profile`."""
    root = WORK / "priors" / name.replace(" ", "")
    shutil.rmtree(root, ignore_errors=True)
    profile.save(root / this_machine("cpu").folder_name / MODEL)
    return root


def scaled_profile(profile: Profile, factor: float) -> Profile:
    shapes = {k: dataclasses.replace(s, latency=scaled(s.latency, factor), load_time_s=s.load_time_s * factor,
                                     warmup_s=s.warmup_s * factor) for k, s in profile.shapes.items()}
    return dataclasses.replace(profile, kind="measured", shapes=shapes, notes={"benchmark": f"own profile x{factor}"})


def parse_plan(text: str) -> ExecutionPlan:
    dp, shape = text[2:].split("x", 1)
    return ExecutionPlan(int(dp), ReplicaShape.parse(shape))


def run_case(workload: Workload, prior: str, root: Path, home: Path) -> dict:
    """Plan and run the workload; the numbers of one case."""
    captured: list[RunCalibration] = []
    original = launch._calibrated_planning

    def capture(*args, **kwargs):
        planning, why = original(*args, **kwargs)
        if planning is not None:
            captured.append(planning.calibration)
        return planning, why

    out = WORK / "runs" / f"{workload.label}-{prior.replace(' ', '')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(WORK / "runs" / f"{workload.label}-{prior.replace(' ', '')}.log", "w")
    load_before = os.getloadavg()[0]
    launch._calibrated_planning = capture
    try:
        result, progress = launch.run_dag_file(dag_file(workload), out, DEVICES, fresh=True, console=Console(file=log, width=200),
                                               engine_factory=start_vllm_engine, home=home, schedule="plan", profiles_root=root)
    finally:
        launch._calibrated_planning = original
        log.close()
    report = result.report
    calibrated = captured[0]
    # What the estimates are of: from the first stage's start (where the plan is made) to the
    # last result; the engines' stop after it and the set-up before it are reported apart.
    start_s, end_s = report.stages[0].start_s, report.stages[-1].end_s
    wall_s, prior_s = end_s - start_s, report.estimated_s
    piloted = len(report.stages) > 1  # one node: its first stage ended before it finished, at its pilot's end
    # The first estimate a user gets: after the pilot (its time included) when one ran, else the plan's.
    initial_s = (report.stages[1].start_s - start_s + report.stages[1].estimated_rest_s) if piloted else prior_s
    ready_s = start_s + max(n.engine_start_s for n in report.stages[0].nodes.values())  # every engine of the plan is up
    at_20 = next(((t, rest) for t, rest, _, _ in progress.estimates if t >= ready_s + 0.2 * (end_s - ready_s)), None)
    rest_error = (at_20[1] - (end_s - at_20[0])) / (end_s - at_20[0]) if at_20 else float("nan")
    timeline = Timeline.start(calibrated.calibrated_problem())
    for stage in report.stages:
        plans = {n: parse_plan(s.plan) for n, s in stage.nodes.items() if n in timeline.states}
        if plans:
            timeline = timeline.advance(plans)
    final_s = (best_schedule(timeline).total_s if not timeline.done else timeline.now_s)
    notes = [n for n in calibrated.problem.notes]
    return {"workload": workload.label, "prior": prior, "plan": " / ".join(f"{n}:{s.plan}" for st in report.stages for n, s in st.nodes.items()),
            "wall_s": wall_s, "initial_s": initial_s, "initial_error": (initial_s - wall_s) / wall_s, "piloted": piloted,
            "prior_s": prior_s, "prior_error": (prior_s - wall_s) / wall_s,
            "at_20_s": at_20[0] if at_20 else None, "rest_error": rest_error, "final_s": final_s, "final_error": (final_s - wall_s) / wall_s,
            "load_avg": (load_before, os.getloadavg()[0]), "estimates": len(progress.estimates), "notes": notes,
            "whole_wall_s": report.wall_s, "before_s": start_s, "after_s": report.wall_s - end_s,
            "engine_start_s": max(n.engine_start_s for st in report.stages for n in st.nodes.values()),
            "prompt_factor": calibrated.lengths["gen"].prompt_factor(), "speed_factor": calibrated.models[MODEL].factors().step,
            "load_factor": calibrated.models[MODEL].factors().load}


def pct(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:+.1%}"


def main() -> None:
    if "--commands" in sys.argv:
        from benchmarks.command_estimates import main as commands_main

        commands_main()
        return
    started = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    home = batchllm_home()
    model_dir = Path(resolve_model(MODEL, dag_dir=REPO, home=home, where="benchmark").materialise(home))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"calibration benchmark at {commit}, {datetime.now(UTC).isoformat(timespec='seconds')}, {this_machine('cpu').describe()}, "
          f"load average {os.getloadavg()[0]:.1f} (2 cores; shared with other jobs)", flush=True)
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    foreign = ["xeon"] if "--xeon-only" in sys.argv else FOREIGN  # the learnt cases and the runs they learn from
    if arguments:  # a profile of this machine taken earlier (a store entry of `batchllm profile --quick`)
        own = Profile.load(Path(arguments[0]))
        print(f"own profile: {arguments[0]} ({own.kind}, {own.notes.get('method', '')})", flush=True)
    else:
        quick_home = case_home("quick-profile")
        t0 = time.monotonic()
        own, _ = quick_profile(MODEL, model_dir, DEVICES, start_vllm_engine, REPO / "profiles", ProfileStore.at_home(quick_home),
                               lambda line: print(f"  quick profile: {line}", flush=True))
        print(f"own profile (batchllm profile --quick): {time.monotonic() - t0:.0f} s", flush=True)
    priors = {"xeon": Profile.load(REPO / "profiles" / "cpu-intel-xeon" / MODEL), "own x2": scaled_profile(own, 2.0),
              "own x0.5": scaled_profile(own, 0.5)}
    rows = []
    for workload in WORKLOADS:
        for prior in foreign:
            rows.append(run_case(workload, prior, prior_root(prior, priors[prior]), case_home(f"{workload.label}-{prior.replace(' ', '')}")))
            print(line(rows[-1]), flush=True)
    for index, workload in enumerate(WORKLOADS):
        earlier = WORKLOADS[index - 1]  # a different workload's run on this machine
        home_learnt = case_home(f"{workload.label}-learnt")
        for kept in ("profiles", "lengths"):  # what the earlier run filed: its profile and its answer lengths
            if (WORK / "homes" / f"{earlier.label}-xeon" / kept).is_dir():
                shutil.copytree(WORK / "homes" / f"{earlier.label}-xeon" / kept, home_learnt / kept)
        rows.append(run_case(workload, f"learnt ({earlier.label})", prior_root("xeon", priors["xeon"]), home_learnt))
        print(line(rows[-1]), flush=True)
    print()
    print("measured: from the first stage's start (the plan) to the last result; set-up before and engine stop after it apart")
    print("prior: the plan's estimate before anything ran; initial: the first estimate after the pilot (its time included)")
    print(f"{'workload':22} {'prior':30} {'plan':16} {'measured':>9} {'prior':>9} {'err':>7} {'initial':>9} {'err':>7} "
          f"{'@20% err':>9} {'final':>9} {'err':>7}  load avg")
    for row in rows:
        print(f"{row['workload']:22} {row['prior']:30} {row['plan'][:16]:16} {row['wall_s']:8.1f}s {row['prior_s']:8.1f}s "
              f"{pct(row['prior_error']):>7} {row['initial_s']:8.1f}s {pct(row['initial_error']):>7} {pct(row['rest_error']):>9} "
              f"{row['final_s']:8.1f}s {pct(row['final_error']):>7}  {row['load_avg'][0]:.1f}->{row['load_avg'][1]:.1f}")
    foreign = [r for r in rows if not r["prior"].startswith("learnt")]
    learnt = [r for r in rows if r["prior"].startswith("learnt")]
    errors = [abs(r[k]) for r in rows for k in ("initial_error", "rest_error", "final_error") if r[k] == r[k]]
    print()
    print(f"foreign prior, |error of the time left at 20 %| <= 10 %: {sum(abs(r['rest_error']) <= 0.10 for r in foreign)}/{len(foreign)} cases "
          f"(max {max(abs(r['rest_error']) for r in foreign):.1%})")
    print(f"learnt prior, |initial error| <= 10 %: {sum(abs(r['initial_error']) <= 0.10 for r in learnt)}/{len(learnt)} cases "
          f"(max {max(abs(r['initial_error']) for r in learnt):.1%})")
    print(f"every case, |first estimate error| (after the pilot) <= 10 %: {sum(abs(r['initial_error']) <= 0.10 for r in rows)}/"
          f"{len(rows)} cases (max {max(abs(r['initial_error']) for r in rows):.1%}); pilots ran in {sum(r['piloted'] for r in rows)}")
    for key in ("initial_error", "rest_error", "final_error"):
        print(f"median |{key}| over all cases: {statistics.median(abs(r[key]) for r in rows):.1%}")
    print(f"median |error| over every estimate of every case: {statistics.median(errors):.1%}")
    print(f"total time {time.monotonic() - started:.0f} s")
    (WORK / "rows.json").write_text(json.dumps(rows, indent=1, default=str))


def line(row: dict) -> str:
    return (f"{row['workload']} / {row['prior']}: plan {row['plan']}, measured {row['wall_s']:.1f} s, initial {row['initial_s']:.1f} s "
            f"({pct(row['initial_error'])}), time left at 20 % of the work ({row['at_20_s'] or 0:.1f} s) {pct(row['rest_error'])}, "
            f"final {row['final_s']:.1f} s ({pct(row['final_error'])}); step x{row['speed_factor']:.2f}, load x{row['load_factor']:.2f}, "
            f"prompt tokens x{row['prompt_factor']:.2f} vs prior/plan; {row['estimates']} re-estimates; engine start "
            f"{row['engine_start_s']:.1f} s; run {row['whole_wall_s']:.1f} s wall = {row['before_s']:.1f} s set-up + "
            f"{row['wall_s']:.1f} s + {row['after_s']:.1f} s engine stop; load avg {row['load_avg'][0]:.1f}->{row['load_avg'][1]:.1f}")


if __name__ == "__main__":
    main()
