"""What `plan` promises against what the user waits for: whole commands, timed from outside.

    .venv/bin/python benchmarks/calibration.py --commands      (about 40 minutes on an AVX2-only 2-core host)

Two single-node workloads of the embedded model that no shipped profile saw: 300 one-word
arithmetic answers (prefill-heavy) and 276 long answers (up to 256 tokens) to ShareGPT first
turns (decode-heavy, long contexts). In one fresh $BATCHLLM_HOME (the models linked in):

  first   `batchllm plan DAG --pilot --json --out DIR`, then `batchllm run DAG --out DIR`:
          the plan's `estimated_s` against the two commands' wall time together; the run's own
          first estimate (its start as measured, its first stage's time to the end, its end as
          kept) against the run command's wall time
  reused  the same workloads again into new folders (no pilot: their prompt sets are known, the
          profile and the commands' times learnt by the first runs), over the result store the
          first pass filled: the run computes only what it does not hold (the pilots' rows)
          `batchllm plan DAG --json`, then `batchllm run DAG --out DIR`
  known   the same again over an empty result store ($BATCHLLM_STORE): every request computed

The home starts empty, so the first command (the first workload's `plan --pilot`) is a first
command on a cold home: no profile learnt, no command's start measured, no verdict kept.

Each command is a process of its own, timed from its start to its exit. Target (issue 44): every
error within 10 %. Prints the host's CPU and the flags that pick vLLM's kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.engines.hardware import this_machine  # noqa: E402
from batchllm.models.embedded import SMOLLM2_135M  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402

MODEL = "smollm2-135m"
WORK = REPO / "benchmarks" / "results" / "command-estimates-work"
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
FIRST_UNUSED = 300  # first_turns[0:300] profiled the model


@dataclass(frozen=True)
class Workload:
    label: str
    max_tokens: int
    prompts: tuple[str, ...]


def workloads() -> list[Workload]:
    arithmetic = tuple(f"What is {17 + 7 * i % 83} + {29 + 11 * i % 71}? Reply with the number only." for i in range(300))
    turns = pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()[FIRST_UNUSED:]
    questions = tuple([t for t in turns if 40 <= len(t) <= 400][:276])
    return [Workload("one-word-300", 16, arithmetic), Workload("long-answers-276", 256, questions)]


def single_node_dag(folder: Path, label: str, prompts: list[str], max_tokens: int) -> Path:
    """A DAG of one node of the embedded model over these prompts (greedy), and its data, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"r{i:04d}" for i in range(len(prompts))], "prompt": prompts}), folder / f"{label}.parquet")
    path = folder / f"{label}.yaml"
    path.write_text(f"""name: {label}
inputs:
  prompts: {{path: {label}.parquet, id_column: id}}
engine: {{max_model_len: 2048}}
nodes:
  gen:
    model: {MODEL}
    prompt: "{{{{ prompt }}}}"
    sampling: {{max_tokens: {max_tokens}, temperature: 0.0}}
outputs:
  out: {{columns: {{answer: gen}}}}
""")
    return path


def dag_file(workload: Workload) -> Path:
    return single_node_dag(WORK / "dags", workload.label, list(workload.prompts), workload.max_tokens)


def timed(args: list[str], home: Path, log: Path, store: Path | None = None) -> tuple[float, str]:
    """Run one command as a user would; its wall time and its stdout. `store`: the result store
    (default: the home's)."""
    env = {key: value for key, value in os.environ.items() if key != "BATCHLLM_STORE"}
    started = time.monotonic()
    done = subprocess.run([BATCHLLM, *args], env={**env, "BATCHLLM_HOME": str(home), **({"BATCHLLM_STORE": str(store)} if store else {})},
                          capture_output=True, text=True)
    wall_s = time.monotonic() - started
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"batchllm {' '.join(args)} failed ({done.returncode}); see {log}")
    return wall_s, done.stdout


def kept_run_end_s(home: Path) -> float:
    """The `run` command's end as the store kept it before this run (0 when none)."""
    for path in (home / "profiles").glob("*/commands.json"):
        entry = json.loads(path.read_text()).get(f"run {MODEL}")
        if entry:
            return float(entry["end_s"])
    return 0.0


def run_first_estimate_s(out: Path, end_s: float) -> float:
    """The run's own first estimate of its wall time: its start as measured, its first stage's
    estimate to the end of the run, its end as kept."""
    report = json.loads((out / "run.json").read_text())
    return float(report.get("command_start_s", 0.0)) + float(report["stages"][0]["estimated_rest_s"] or 0.0) + end_s


def error(estimate_s: float, measured_s: float) -> str:
    return f"{(estimate_s - measured_s) / measured_s:+.1%}"


def main() -> None:
    started = time.monotonic()
    shutil.rmtree(WORK, ignore_errors=True)
    home = WORK / "home"
    home.mkdir(parents=True)
    SMOLLM2_135M.prepare(batchllm_home())  # once, outside the timed commands: the shared home's models are linked in
    (home / "models").symlink_to(batchllm_home() / "models")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command estimates at {commit}, {datetime.now(UTC).isoformat(timespec='seconds')}, "
          f"{this_machine('cpu').describe()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for label, store in (("first", None), ("reused", None), ("known", WORK / "empty-store.sqlite")):
        for workload in workloads():
            dag, out = dag_file(workload), WORK / "runs" / f"{workload.label}-{label}"
            out.parent.mkdir(parents=True, exist_ok=True)
            plan_args = ["plan", str(dag), "--json", *(["--pilot", "--out", str(out)] if label == "first" else [])]
            plan_s, plan_stdout = timed(plan_args, home, WORK / f"{workload.label}-{label}-plan.log", store)
            plan = json.loads(plan_stdout)
            end_s = kept_run_end_s(home)
            run_s, _ = timed(["run", str(dag), "--out", str(out)], home, WORK / f"{workload.label}-{label}-run.log", store)
            whole_s = plan_s + run_s if label == "first" else run_s
            row = {"pass": label, "workload": workload.label, "plan_s": plan_s, "run_s": run_s, "estimated_s": plan["estimated_s"],
                   "stages_s": plan["total_s"], "command_start_s": plan.get("command_start_s"), "command_end_s": plan.get("command_end_s"),
                   "pilot_s": plan.get("pilot_s"), "rest_estimated_s": plan.get("rest_estimated_s"),
                   "run_first_estimate_s": run_first_estimate_s(out, end_s), "measured_s": whole_s}
            rows.append(row)
            print(f"{label} {workload.label}: plan{' --pilot' if label == 'first' else ''} {plan_s:.1f} s, run {run_s:.1f} s; "
                  f"plan's estimate {row['estimated_s']:.1f} s against {whole_s:.1f} s ({error(row['estimated_s'], whole_s)}); "
                  f"run's own first estimate {row['run_first_estimate_s']:.1f} s against {run_s:.1f} s "
                  f"({error(row['run_first_estimate_s'], run_s)}); stored before the run: "
                  f"{sum(node['stored'] for node in plan.get('stored', {}).values())}; plan parts: {json.dumps({k: row[k] for k in ('pilot_s', 'rest_estimated_s', 'stages_s', 'command_start_s', 'command_end_s')})}",
                  flush=True)
    print()
    print(f"{'pass':7} {'workload':18} {'measured':>9} {'plan est.':>9} {'err':>7} {'run':>8} {'run est.':>9} {'err':>7}")
    for r in rows:
        print(f"{r['pass']:7} {r['workload']:18} {r['measured_s']:8.1f}s {r['estimated_s']:8.1f}s {error(r['estimated_s'], r['measured_s']):>7} "
              f"{r['run_s']:7.1f}s {r['run_first_estimate_s']:8.1f}s {error(r['run_first_estimate_s'], r['run_s']):>7}")
    within = sum(abs(r[k] - r[m]) / r[m] <= 0.10 for r in rows for k, m in (("estimated_s", "measured_s"), ("run_first_estimate_s", "run_s")))
    print(f"estimates within 10 %: {within}/{2 * len(rows)}; total time {time.monotonic() - started:.0f} s")
    (WORK / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
