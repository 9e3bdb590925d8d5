"""LoRA adapters against merged models: a router DAG over three fine-tuned variants of one base.

    .venv/bin/python benchmarks/adapters.py [--questions 1400] [--max-tokens 64] [--out FILE]

Three LoRA adapters of the embedded smollm2-135m (rank 8 on every layer's q_proj and v_proj,
seeded random weights, B not zero: made here as testkit/lora_adapters.py makes them), and each
adapter merged into a full model of its own (W + alpha/r B A on the base's weights, saved in
the base's dtype: what PEFT's merge_and_unload gives). The questions are real ShareGPT prompts
(profiles/prompts: 1,000 first turns and 400 multi-turn chats, each cut at 1,000 characters),
routed by row to one of the three variants (`where:` on a `route` column, 0-2 in turn); past
1,400 rows the prompts come again, each to another variant than before (up to 4,200 rows).

Two sides, each one process timed from outside (imports, checks, pilots, engine starts and
all), on the same cores (cpu:2), one after the other, as a first run: in a batchllm home where
nothing was learnt yet (lengths, profiles, settings checks; the prepared models shared), so the
result does not hang on what earlier runs left there:

    adapters  three nodes on smollm2-135m with `adapter:`: one engine group, one engine
    merged    three nodes on the three merged models (today's only way): three models

Each side first runs its pilots (`batchllm plan --pilot`'s code: a sample of each node's rows)
and takes the planner's estimate of the rest on what they measured, then runs the rest (as
`batchllm run` into the same folder). The merged models are planned on the base's profile
(the same prior as the adapters' side: their step times are the base's), filed under their
names in a scratch profiles folder. Per side: the whole time, the rest's estimate against the
rest's stages as they ran, engine starts and output tokens.

The last line: `adapters: <x>x faster than merged models, plan estimate within <e> %` (x the
merged side's whole time over the adapters'; e the adapters side's |estimate - measured| of
the rest, over measured). Targets (issue 43): x >= 1.3, e <= 10.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.engines.devices import hardware_name  # noqa: E402
from batchllm.models.embedded import SMOLLM2_135M  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from benchmarks.reporting import host_line, publish  # noqa: E402
from testkit.lora_adapters import make_lora_adapter  # noqa: E402

VARIANTS = ("a", "b", "c")
RANK = 8
MAX_CHARS = 1000


def questions(count: int) -> tuple[list[str], list[int]]:
    """`count` rows (at most 3 x the 1,400 prompts) and each one's variant: the prompts in turn, each
    to the next variant on each pass over them, so no variant is asked one question twice (no prefix
    cached from an earlier row on either side)."""
    prompts = [p[:MAX_CHARS] for name in ("first_turns", "multi_turn")
               for p in pq.read_table(REPO / "profiles" / "prompts" / f"{name}.parquet").column("prompt").to_pylist()]
    if not 1 <= count <= len(VARIANTS) * len(prompts):
        raise SystemExit(f"--questions must be 1-{len(VARIANTS) * len(prompts)} (each of {len(prompts)} prompts once per variant), got {count}")
    rows = range(count)
    return [prompts[k % len(prompts)] for k in rows], [(k % len(prompts) + k // len(prompts)) % len(VARIANTS) for k in rows]


def merge_adapter(base: Path, adapter: Path, into: Path) -> Path:
    """The base's folder with the adapter's q_proj and v_proj deltas added to its weights."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for name in [k for k in lora if k.endswith(".lora_A.weight")]:
        target = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        delta = lora[name.replace("lora_A", "lora_B")].float() @ lora[name].float()
        weights[target] = (weights[target].float() + scale * delta).to(weights[target].dtype)
    into.mkdir(parents=True)
    for item in base.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, into / item.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(into / "model.safetensors"), metadata={"format": "pt"})
    del torch
    return into


def router_dag(folder: Path, side: str, max_tokens: int) -> Path:
    nodes = []
    for index, variant in enumerate(VARIANTS):
        model = f"model: {SMOLLM2_135M.name}\n    adapter: adapters/{variant}" if side == "adapters" else f"model: ./merged_{variant}"
        nodes.append(f"  tuned_{variant}:\n    {model}\n    where: \"route = {index}\"\n    prompt: \"{{{{ question }}}}\"\n"
                     f"    sampling: {{max_tokens: {max_tokens}}}\n")
    dag = folder / f"router-{side}.yaml"
    dag.write_text(f"name: router-{side}\ninputs:\n  questions: {{path: questions.parquet, id_column: id}}\n"
                   "engine:\n  max_model_len: 2048\nnodes:\n" + "".join(nodes))
    return dag


SIDE = """
import json, sys, time
from pathlib import Path
from rich.console import Console
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import parse_devices
from batchllm.runtime.launch import run_dag
from batchllm.runtime.run_spec import RunSpec
dag, out, profiles = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
quiet = Console(quiet=True)
devices = parse_devices("cpu:2")
pilots, _ = run_dag(load_dag(dag), RunSpec(out, devices, pilots_only=True, profiles_root=profiles), console=quiet)
started = time.perf_counter()
result, progress = run_dag(load_dag(dag), RunSpec(out, devices, profiles_root=profiles), console=quiet)
stats = progress.stats.values()
print(json.dumps({"rest_estimate_s": pilots.rest_estimate_s, "rest_s": time.perf_counter() - started,
                  "stages_s": result.report.wall_s, "model_loads": pilots.model_loads + result.model_loads,
                  "output_tokens": sum(s.output_tokens for s in stats), "failed": result.nodes_failed}))
"""


def run_side(dag: Path, out: Path, profiles: Path, env: dict[str, str]) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SIDE, str(dag), str(out), str(profiles)], env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{dag.name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1400, help="rows: 1,400 prompts, then again each to another variant (at most 4,200)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args()
    base = SMOLLM2_135M.prepare(batchllm_home())
    items, routes = questions(args.questions)
    sides: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="adapters-bench-") as scratch:
        folder = Path(scratch)
        home = folder / "home"  # a first run's: nothing learnt (lengths, profiles, checks), the prepared models shared
        home.mkdir()
        (home / "models").symlink_to(batchllm_home() / "models")
        env = {**os.environ, "BATCHLLM_HOME": str(home), "PYTHONPATH": str(REPO)}
        pq.write_table(pa.table({"id": [f"q{k}" for k in range(len(items))], "question": items,
                                 "route": routes}), folder / "questions.parquet")
        config = json.loads((base / "config.json").read_text())
        profiles = folder / "profiles"
        shutil.copytree(REPO / "profiles", profiles)
        own = profiles / hardware_name("cpu")
        shipped = own / SMOLLM2_135M.name if (own / SMOLLM2_135M.name).is_dir() else next(profiles.glob(f"cpu-*/{SMOLLM2_135M.name}"))
        for seed, variant in enumerate(VARIANTS):
            adapter = make_lora_adapter(folder / "adapters" / variant, config, seed=seed, rank=RANK)
            merge_adapter(base, adapter, folder / f"merged_{variant}")
            shutil.copytree(shipped, own / f"merged_{variant}", ignore=shutil.ignore_patterns("logs"), dirs_exist_ok=True)
        for side in ("adapters", "merged"):
            sides[side] = run_side(router_dag(folder, side, args.max_tokens), folder / f"out-{side}", profiles, env)
            print(f"{side}: {json.dumps(sides[side])}", flush=True)
    lines = [f"{len(items)} ShareGPT questions routed over 3 variants of {SMOLLM2_135M.name} (LoRA rank {RANK} on q_proj, v_proj), "
             f"max_tokens {args.max_tokens}, cpu:2 on {host_line()}"]
    lines.append(f"{'side':<9} {'whole s':>8} {'rest s':>8} {'rest est. s':>12} {'err':>7} {'loads':>6} {'output tok':>11}")
    for side, r in sides.items():
        error = (r["rest_estimate_s"] - r["rest_s"]) / r["rest_s"] if r["rest_estimate_s"] else float("nan")
        lines.append(f"{side:<9} {r['wall_s']:8.1f} {r['rest_s']:8.1f} {r['rest_estimate_s'] or float('nan'):12.1f} "
                     f"{error:+7.1%} {r['model_loads']:6d} {r['output_tokens']:11,d}")
    adapters, merged = sides["adapters"], sides["merged"]
    estimate_error = abs(adapters["rest_estimate_s"] - adapters["rest_s"]) / adapters["rest_s"] * 100
    lines.append(f"adapters: {merged['wall_s'] / adapters['wall_s']:.2f}x faster than merged models, "
                 f"plan estimate within {estimate_error:.0f} %")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
