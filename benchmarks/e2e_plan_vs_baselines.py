"""One multi-model DAG on the real engine, three schedules side by side in one run.

    .venv/bin/python benchmarks/e2e_plan_vs_baselines.py [--rows 96] [--devices cpu:2]

The DAG (written to a temp folder): two generators with different workloads answer
real ShareGPT first-turn prompts (one briefly, one at length), and a judge reads both
answers. Schedules, each from scratch (fresh output folder, no engine running):
  sequential  node after node, one engine on all cores (what users script today)
  max         SamuLLM's Max heuristic: node after node alone on all cores, each on its
              fastest plan there (two one-core replicas when that is faster)
  min         every ready node on its smallest plan
  plan        batchllm's plan, re-planned at every stage end
Prints the wall time of each, the ratios, batchllm's estimated vs actual time and its
orchestration overhead (time no engine was starting or stepping); the last line is
the speed-up of batchllm's plan over the Max heuristic. Each planned run's run.json and
run.html (planned vs actual Gantt) are kept in benchmarks/results/.
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
from batchllm.runtime.launch import run_dag_file  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "profiles" / "prompts" / "first_turns.parquet"
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


def write_inputs(folder: Path, rows: int) -> Path:
    table = pq.read_table(PROMPTS).slice(FIRST_PROMPT)
    picked = [r for r in table.to_pylist() if len(r["prompt"]) <= 600][:rows]
    pq.write_table(pa.table({"id": [str(r["id"]) for r in picked], "prompt": [r["prompt"] for r in picked]}), folder / "prompts.parquet")
    dag = folder / "e2e.yaml"
    dag.write_text(DAG)
    return dag


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96, help="prompts in the data set")
    parser.add_argument("--devices", default="cpu:2", help="cores to run on")
    args = parser.parse_args()
    devices = parse_devices(args.devices)
    console = Console(stderr=True)
    walls, reports = {}, {}
    with tempfile.TemporaryDirectory(prefix="batchllm-e2e-") as tmp:
        folder = Path(tmp)
        dag = write_inputs(folder, args.rows)
        print(f"DAG brief + detailed -> judge over {args.rows} prompts on {args.devices}", flush=True)
        for schedule in ("sequential", "max", "min", "plan"):
            started = time.perf_counter()
            result, _ = run_dag_file(dag, folder / f"out-{schedule}", devices, fresh=True, console=console, schedule=schedule)
            walls[schedule] = time.perf_counter() - started
            for report_file in ("run.json", "run.html"):  # kept for a look at stage estimates vs actual
                if (folder / f"out-{schedule}" / report_file).is_file():
                    RESULTS.mkdir(exist_ok=True)
                    shutil.copy(folder / f"out-{schedule}" / report_file, RESULTS / f"e2e-{schedule}-{report_file}")
            reports[schedule] = result.report
            r = result.report
            if r is None:
                print(f"{schedule:10} {walls[schedule]:7.1f} s  engines started {result.engines_started}", flush=True)
                continue
            stages = "; ".join(" + ".join(f"{n} {v.plan} on {v.devices}" for n, v in s.nodes.items()) for s in r.stages)
            print(f"{schedule:10} {walls[schedule]:7.1f} s  estimated {r.estimated_s:6.1f} s  overhead {r.overhead_s:5.1f} s "
                  f"({r.overhead_s / r.wall_s:.1%})  engines started {result.engines_started}  stages: {stages}", flush=True)
    plan = reports["plan"]
    print(f"ratios: sequential/plan {walls['sequential'] / walls['plan']:.2f}x, max/plan {walls['max'] / walls['plan']:.2f}x, "
          f"min/plan {walls['min'] / walls['plan']:.2f}x")
    print(f"batchllm's plan: estimated {plan.estimated_s:.1f} s, actual {plan.wall_s:.1f} s "
          f"({(plan.wall_s - plan.estimated_s) / plan.estimated_s:+.1%}); orchestration overhead {plan.overhead_s / plan.wall_s:.1%} "
          f"of wall time (planning {plan.planning_s:.2f} s)")
    print(f"speed-up of batchllm's plan over the Max heuristic: {walls['max'] / walls['plan']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
