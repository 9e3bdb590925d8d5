"""One multi-model DAG on the real engine, three schedules side by side in one run.

    .venv/bin/python benchmarks/e2e_plan_vs_baselines.py [--rows 96] [--devices cpu:2] [--dags ensemble,mix]

Two DAGs (written to a temp folder):
  ensemble  two generators with different workloads answer real ShareGPT first-turn
            prompts (one briefly, one at length), and a judge reads both answers;
  mix       the same three nodes and, as a second application on the same machine,
            a chain summary of the example documents (each chunk one step that sees
            the summary so far: few requests per step, so latency-bound).
Schedules, each from scratch (fresh output folder, no engine running):
  sequential  node after node, one engine on all cores (what users script today)
  max         SamuLLM's Max heuristic: node after node alone on all cores, each on its
              fastest plan there (two one-core replicas when that is faster)
  min         every ready node on its smallest plan
  plan        batchllm's plan, re-planned at every stage end
Prints per DAG first what the cost model says is reachable (Max's estimate against the
exact search's best schedule and against the lower bound), then the wall time of each
schedule, the ratios, batchllm's estimated vs actual time and its orchestration overhead
(time no engine was starting or stepping); the last line is the speed-up of batchllm's
plan over the Max heuristic per DAG. Each planned run's run.json and run.html (planned vs
actual Gantt) are kept in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.engines.devices import parse_devices  # noqa: E402
from batchllm.planner.plan_file import plan_dag_file  # noqa: E402
from batchllm.runtime.launch import run_dag_file  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "profiles" / "prompts" / "first_turns.parquet"
DOCUMENTS = Path(__file__).resolve().parent.parent / "examples" / "documents.parquet"
RESULTS = Path(__file__).resolve().parent / "results"
FIRST_PROMPT = 600  # the profiler measures output lengths on the first prompts; use others

DAG = """
name: e2e-ensemble-judge
inputs:
  prompts: {path: prompts.parquet, id_column: id}
engine:
  max_model_len: 2048
nodes:
  brief:
    model: smollm2-135m
    system: Answer in one or two sentences.
    prompt: "{{ prompt }}"
    sampling: {max_tokens: 48}
  detailed:
    model: smollm2-135m
    system: You are a thorough assistant. Explain step by step.
    prompt: "{{ prompt }}"
    sampling: {max_tokens: 160}
  judge:
    model: smollm2-135m
    prompt: |
      Request: {{ prompt }}

      Answer A: {{ brief }}

      Answer B: {{ detailed }}

      Which answer is more helpful? Reply with A or B.
    sampling: {max_tokens: 8}
outputs:
  judged:
    columns: {prompt: prompt, brief: brief, detailed: detailed, verdict: judge}
"""

CHAIN_NODE = """
  summarize:
    input: documents
    model: smollm2-135m
    iterate: {over: chunks, as: chunk}
    prompt: |
      {% if previous %}Summary so far: {{ previous }}

      {% endif %}Next part of the document:
      {{ chunk }}

      Write an updated summary of the whole document so far in two sentences.
    sampling: {max_tokens: 64}
"""


def mix_dag() -> str:
    """The ensemble DAG plus a chain summary over a second input."""
    text = DAG.replace("  prompts: {path: prompts.parquet, id_column: id}\n",
                       "  prompts: {path: prompts.parquet, id_column: id}\n  documents: {path: documents.parquet, id_column: doc_id}\n")
    for name in ("brief", "detailed", "judge"):
        text = text.replace(f"  {name}:\n    model:", f"  {name}:\n    input: prompts\n    model:")
    text = text.replace("outputs:\n", CHAIN_NODE.lstrip("\n") + "outputs:\n  summaries:\n    columns: {summary: summarize}\n")
    return text.replace("name: e2e-ensemble-judge", "name: e2e-mix")


DAGS = {"ensemble": lambda: DAG, "mix": mix_dag}


def write_inputs(folder: Path, rows: int, name: str) -> Path:
    table = pq.read_table(PROMPTS).slice(FIRST_PROMPT)
    picked = [r for r in table.to_pylist() if len(r["prompt"]) <= 600][:rows]
    pq.write_table(pa.table({"id": [str(r["id"]) for r in picked], "prompt": [r["prompt"] for r in picked]}), folder / "prompts.parquet")
    shutil.copy(DOCUMENTS, folder / "documents.parquet")
    dag = folder / f"{name}.yaml"
    dag.write_text(DAGS[name]())
    return dag


def reachable(dag: Path, devices: str) -> str:
    """What the cost model says any schedule can gain over Max on this DAG: the exact
    search's optimum and the lower bound, both against Max's estimate."""
    report = plan_dag_file(dag, devices, compare=True)
    by_name = {s.method: s for s in report.compared}
    max_s = by_name["max-heuristic"].total_s
    best = min((report.chosen, *report.compared), key=lambda s: (s.total_s, not s.optimal))
    proven = " (proven optimal)" if best.optimal else ""
    return (f"cost model: Max {max_s:.1f} s, best schedule found {best.total_s:.1f} s{proven} ({max_s / best.total_s:.2f}x over Max), "
            f"lower bound {report.lower_bound_s:.1f} s (no schedule beats {max_s / report.lower_bound_s:.2f}x)")


def run_schedules(dag: Path, folder: Path, name: str, devices, console: Console) -> tuple[dict, dict]:
    walls, reports = {}, {}
    for schedule in ("sequential", "max", "min", "plan"):
        out = folder / f"out-{name}-{schedule}"
        started = time.perf_counter()
        result, _ = run_dag_file(dag, out, devices, fresh=True, console=console, schedule=schedule)
        walls[schedule] = time.perf_counter() - started
        for report_file in ("run.json", "run.html"):  # kept for a look at stage estimates vs actual
            if (out / report_file).is_file():
                RESULTS.mkdir(exist_ok=True)
                shutil.copy(out / report_file, RESULTS / f"e2e-{name}-{schedule}-{report_file}")
        reports[schedule] = r = result.report
        if r is None:
            print(f"{name:9} {schedule:10} {walls[schedule]:7.1f} s  engines started {result.engines_started}", flush=True)
            continue
        stages = "; ".join(" + ".join(f"{n} {v.plan} on {v.devices}" for n, v in s.nodes.items()) for s in r.stages)
        estimated = "   n/a" if r.estimated_s is None else f"{r.estimated_s:6.1f}"  # sequential: no estimate
        print(f"{name:9} {schedule:10} {walls[schedule]:7.1f} s  estimated {estimated} s  overhead {r.overhead_s:5.1f} s "
              f"({r.overhead_s / r.wall_s:.1%})  engines started {result.engines_started}  stages: {stages}", flush=True)
    plan = reports["plan"]
    print(f"{name:9} ratios: sequential/plan {walls['sequential'] / walls['plan']:.2f}x, max/plan {walls['max'] / walls['plan']:.2f}x, "
          f"min/plan {walls['min'] / walls['plan']:.2f}x")
    print(f"{name:9} batchllm's plan: estimated {plan.estimated_s:.1f} s, actual {plan.wall_s:.1f} s "
          f"({(plan.wall_s - plan.estimated_s) / plan.estimated_s:+.1%}); orchestration overhead {plan.overhead_s / plan.wall_s:.1%} "
          f"of wall time (planning {plan.planning_s:.2f} s)", flush=True)
    return walls, reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96, help="prompts in the data set")
    parser.add_argument("--devices", default="cpu:2", help="cores to run on")
    parser.add_argument("--dags", default="ensemble,mix", help=f"which DAGs, comma-separated: {', '.join(DAGS)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.dags.split(",") if n.strip()]
    unknown = [n for n in names if n not in DAGS]
    if unknown or not names:
        parser.error(f"unknown DAG {unknown!r}; known: {', '.join(DAGS)}")
    devices = parse_devices(args.devices)
    console = Console(stderr=True)
    speedups = {}
    with tempfile.TemporaryDirectory(prefix="batchllm-e2e-") as tmp:
        for name in names:
            folder = Path(tmp) / name
            folder.mkdir()
            dag = write_inputs(folder, args.rows, name)
            print(f"DAG {name}: {args.rows} prompts, on {args.devices}", flush=True)
            print(f"{name:9} {reachable(dag, args.devices)}", flush=True)
            walls, _ = run_schedules(dag, folder, name, devices, console)
            speedups[name] = walls["max"] / walls["plan"]
    print("speed-up of batchllm's plan over the Max heuristic: " + ", ".join(f"{n} {x:.2f}x" for n, x in speedups.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
