"""Length-aware balance and order against today's split, on two replicas, through the real
driver.

    .venv/bin/python benchmarks/length_balance.py [--copies 3] [--rounds 1]

Workload: the prompts of `benchmarks/data/length_sets.parquet` (five prompt sets with the
real answer lengths of the embedded model: short answers, ShareGPT first turns, multi-turn,
long-form writing, code), the half held out from training, repeated `--copies` times
(each copy marked ` #k`) to >= 4,000 requests, shuffled, one DAG node on cpu:2 planned
`max` (dp2: two replicas). The other half is what the length model learnt from (filed in
the arm's store as earlier runs would have).

Engines: `benchmarks/paced_engine.py`, the real worker process with a stepper that batches
continuously (32 at once) and sleeps each step's time by a step-latency model, each answer
as long as the real model's was. Two arms, in turns, side by side in one run:

    today        no length model in the store: every request's predicted answer alike
                 (the split balances prompt tokens, the order is the prefix order's)
    length-aware the length model fit on the other half: the split balances predicted
                 work, each replica runs its longest predicted answers first

Printed per arm: makespan (engines ready to the last result), the idle tail (the first
replica's end to the last's: its busy time against the other's), and the planner's
estimate of the same (`estimate()` on the paced profile, the arm's per-request lengths).
Targets (issue 28): length-aware not slower, its idle tail at most half of today's, both
estimates within 10 %. No pilot in either arm (`pilot=None`): it is the split and order
that differ.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.core.length_prompt import LengthPrompt  # noqa: E402
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate  # noqa: E402
from batchllm.costmodel.latency import StepLatencyModel  # noqa: E402
from batchllm.costmodel.length_model.observations import ObservationStore  # noqa: E402
from batchllm.costmodel.lengths import LengthDistribution  # noqa: E402
from batchllm.costmodel.profile import Profile, ReplicaShape  # noqa: E402
from batchllm.costmodel.request_lengths import RequestLengths  # noqa: E402
from batchllm.engines.devices import DeviceSet, hardware_name  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from batchllm.planner.length_sources import LengthModels  # noqa: E402
from benchmarks.paced_engine import MAX_NUM_SEQS, PacedEngines  # noqa: E402

DATA = REPO / "benchmarks" / "data" / "length_sets.parquet"
MODEL = "smollm2-135m"
MAX_TOKENS = 256
LATENCY = StepLatencyModel(base_s=0.002, per_prefill_token_s=2e-6, per_attention_unit_s=0.0, per_decode_seq_s=2.5e-4,
                           per_context_token_s=0.0)


def paced_profile(root: Path) -> Path:
    """The shipped profile of the embedded model with the paced engine's settings and step latency."""
    shipped = next(p for p in [REPO / "profiles" / hardware_name("cpu") / MODEL, REPO / "profiles" / "cpu-intel-xeon" / MODEL]
                   if (p / "profile.json").is_file())
    folder = root / hardware_name("cpu") / MODEL
    shutil.copytree(shipped, folder, ignore=shutil.ignore_patterns("steps-*", "logs"))
    body = json.loads((folder / "profile.json").read_text())
    body["engine"].update(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192, block_size_tokens=16, max_model_len=8192,
                          engine_version="standin")
    for shape in body["shapes"].values():
        shape.update(load_time_s=0.5, warmup_s=0.0, kv_capacity_tokens=10_000_000, latency=LATENCY.to_dict())
    (folder / "profile.json").write_text(json.dumps(body, indent=2))
    return root


def halves(table: pa.Table) -> tuple[list[dict], list[dict]]:
    rows = table.to_pylist()
    rng = np.random.default_rng(11)
    held = rng.random(len(rows)) < 0.5
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def prompt_of(row: dict) -> LengthPrompt:
    return LengthPrompt(row["last_user"], row["system"] or "", "answer", int(row["prompt_tokens"]), MAX_TOKENS, 0.0)


def arm_home(root: Path, train: list[dict] | None) -> Path:
    """A home with the embedded model linked in, and (length-aware) the training half filed as outputs seen."""
    home = root / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / MODEL).symlink_to(batchllm_home() / "models" / MODEL)
    if train:
        store = ObservationStore.at_home(home, MODEL)
        for name in sorted({r["set"] for r in train}):
            rows = [r for r in train if r["set"] == name]
            store.add([prompt_of(r) for r in rows], np.array([r["output_tokens"] for r in rows]),
                      np.array([r["finished"] for r in rows]), prompt_set=f"training {name}")
    return home


def write_inputs(folder: Path, test: list[dict], copies: int) -> tuple[Path, list[dict]]:
    rows = [dict(r, copy=k) for k in range(copies) for r in test]
    order = np.random.default_rng(5).permutation(len(rows))
    rows = [rows[i] for i in order]
    pq.write_table(pa.table({"id": [f"{r['id']}#{r['copy']}" for r in rows],
                             "prompt": [f"{r['last_user']} #{r['copy']}" for r in rows],
                             "system": [r["system"] or "" for r in rows]}), folder / "rows.parquet")
    (folder / "dag.yaml").write_text(
        "inputs:\n  rows: {path: rows.parquet, id_column: id}\n"
        f"nodes:\n  answer: {{model: {MODEL}, system: '{{{{ system }}}}', prompt: '{{{{ prompt }}}}', "
        f"sampling: {{max_tokens: {MAX_TOKENS}}}}}\n"
        "outputs:\n  answers: {columns: {answer: answer}}\n")
    return folder / "dag.yaml", rows


def run_arm(name: str, dag: Path, home: Path, profiles: Path, lengths: dict[str, int]) -> dict:
    from batchllm.runtime.launch import run_dag_file

    out = dag.parent / f"out-{name}"
    started = time.monotonic()
    result, _ = run_dag_file(dag, out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True), home=home,
                             engine_factory=PacedEngines(lengths, LATENCY), schedule="max", pilot=None, profiles_root=profiles)
    wall_s = time.monotonic() - started
    report = json.loads((out / "run.json").read_text())
    stages = report["stages"]
    busy = {}
    for stage in stages:
        for engine, seconds in stage.get("engine_busy_s", {}).items():
            busy[engine] = busy.get(engine, 0.0) + seconds
    plans = [n["plan"] for s in stages for n in s["nodes"].values()]
    return {"wall_s": wall_s, "busy": sorted(busy.values()), "plans": plans}


def planned_s(profiles: Path, rows: list[dict], lengths: RequestLengths) -> float:
    profile = Profile.load(profiles / hardware_name("cpu") / MODEL)
    workload = Workload.of(np.array([r["prompt_tokens"] for r in rows]), MAX_TOKENS, output_lengths=lengths)
    runs = [estimate(profile, ExecutionPlan(2, ReplicaShape(1)), workload, seed=s, include_load=False).run_s for s in range(3)]
    return float(np.mean(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=0, help="copies of the held-out half (default: enough for >= 4,000)")
    args = parser.parse_args()
    table = pq.read_table(DATA)
    train, test = halves(table)
    copies = args.copies or -(-4000 // len(test))
    lengths = {r["last_user"]: int(r["output_tokens"]) for r in table.to_pylist()}
    with tempfile.TemporaryDirectory(prefix="length-balance-") as scratch:
        root = Path(scratch)
        profiles = paced_profile(root / "profiles")
        results, estimates = {}, {}
        for arm, trained in (("today", None), ("length-aware", train)):
            folder = root / arm
            folder.mkdir()
            home = arm_home(folder, trained)
            dag, rows = write_inputs(folder, test, copies)
            models = LengthModels.at_home(home, [MODEL])
            if trained:
                print(f"length model: {models.verdicts[MODEL]}")
                prompts = [LengthPrompt(f"{r['last_user']} #{r['copy']}", r["system"] or "", "answer", int(r["prompt_tokens"]),
                                        MAX_TOKENS, 0.0) for r in rows]
                ranker = models.rankers[MODEL]  # what the runtime orders and splits by
                request_lengths = ranker.request_lengths(prompts)
            else:
                observed = np.array([r["output_tokens"] for r in train])
                cdf = LengthDistribution.fit(observed, np.array([r["finished"] for r in train]))
                request_lengths = RequestLengths.shared(cdf, len(rows), "prior")
            estimates[arm] = planned_s(profiles, rows, request_lengths)
            results[arm] = run_arm(arm, dag, home, profiles, {f"{k}": v for k, v in lengths.items()})
        print(f"{len(test) * copies:,} requests ({copies} copies of {len(test)} held-out prompts), 2 replicas x {MAX_NUM_SEQS} "
              f"at once, paced steps; plans run: {', '.join(sorted(set(p for r in results.values() for p in r['plans'])))}")
        print(f"{'arm':14} {'makespan s':>10} {'replica busy s':>18} {'idle tail s':>11} {'estimate s':>10} {'error':>7}")
        for arm, r in results.items():
            tail = r["busy"][-1] - r["busy"][0] if len(r["busy"]) > 1 else 0.0
            r["tail"] = tail
            makespan = r["busy"][-1] if r["busy"] else r["wall_s"]
            r["makespan"] = makespan
            error = (estimates[arm] - makespan) / makespan
            r["error"] = error
            print(f"{arm:14} {makespan:10.1f} {' / '.join(f'{b:.1f}' for b in r['busy']):>18} {tail:11.1f} "
                  f"{estimates[arm]:10.1f} {error:+7.1%}")
        today, aware = results["today"], results["length-aware"]
        print(f"summary: makespan {aware['makespan'] / today['makespan']:.2f}x today's, idle tail "
              f"{aware['tail'] / max(today['tail'], 1e-9):.2f}x today's, estimates within "
              f"{max(abs(today['error']), abs(aware['error'])):.1%}")


if __name__ == "__main__":
    main()
