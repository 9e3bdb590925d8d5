"""What running engines as Ray actors costs: the same DAG on the same two cores, as local
engine processes and as Ray actors on a two-node cluster on this machine (127.0.0.1, one
core per node), in one invocation.

    .venv/bin/python benchmarks/ray_overhead.py [--dag dags/ensemble_judge.yaml] [--rounds 2]

Both modes see the same devices as the planner does: two one-core nodes (the local run
gets the same node layout, so the plans match, and each replica is one engine on one
core). Runs alternate local, Ray, local, Ray ... so drifts in the machine's load fall on
both; each run starts from a fresh BATCHLLM_HOME (only the prepared model is shared), so
nothing learnt in one run changes the next one's plan. Printed per run: wall time,
engine start (the first stage's, as the driver waited for it), wall time after the
engines were ready, the stages' wall time (engine starts and work: without set-up and
the engines' shut-down at the end, where a local worker process's orderly exit took
about 15 s and a Ray actor is killed at once), orchestration overhead (wall time outside engine starts and steps,
from run.json), first request latency; then medians and the Ray / local ratios
(target: wall time ratio <= 1.10).
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.cluster.local import LocalRayCluster  # noqa: E402
from batchllm.cluster.session import RaySession  # noqa: E402
from batchllm.engines.devices import DeviceSet, NodeDevices  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from batchllm.runtime.launch import run_dag_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Measured:
    mode: str
    wall_s: float
    start_s: float  # the first stage's engine start
    overhead_s: float  # run.json: outside every engine's starts and steps
    stages_s: float  # the stages' wall time: engine starts and work, without the run's set-up and engines' shut-down
    first_request_s: float | None
    plans: str

    @property
    def after_start_s(self) -> float:
        return self.wall_s - self.start_s

    def line(self) -> str:
        first = f"{self.first_request_s * 1000:.0f} ms" if self.first_request_s is not None else "-"
        return (f"{self.mode:5s} wall {self.wall_s:6.1f} s  engine start {self.start_s:5.1f} s  after start "
                f"{self.after_start_s:6.1f} s  stages {self.stages_s:6.1f} s  overhead {self.overhead_s:5.2f} s  first request {first}  plans {self.plans}")


def fresh_home(root: Path, model_home: Path) -> Path:
    """A BATCHLLM_HOME that shares only the prepared models with `model_home`."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=root))
    (home / "models").symlink_to(model_home / "models", target_is_directory=True)
    return home


def run_once(mode: str, dag: Path, devices: DeviceSet, root: Path, model_home: Path, session: RaySession | None) -> Measured:
    home = fresh_home(root, model_home)
    os.environ["BATCHLLM_HOME"] = str(home)
    quiet = Console(file=io.StringIO(), width=120)
    started = time.monotonic()
    result, _ = run_dag_file(dag, home / "out", devices, fresh=True, console=quiet, home=home, cluster=session)
    wall_s = time.monotonic() - started
    report = result.report
    start_s = _first_stage_start_s(report.stages[0])
    plans = " | ".join(", ".join(f"{n} {v.plan}@{v.devices}" for n, v in stage.nodes.items())
                       + f" ({stage.duration_s:.1f} s, overhead {stage.overhead_s:.1f} s)" for stage in report.stages)
    stages_s = sum(stage.duration_s for stage in report.stages)
    return Measured(mode, wall_s, start_s, report.overhead_s, stages_s, report.first_request_s, plans)


def _first_stage_start_s(stage) -> float:
    return max((node.engine_start_s for node in stage.nodes.values()), default=0.0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dag", type=Path, default=REPO / "dags" / "ensemble_judge.yaml")
    parser.add_argument("--rounds", type=int, default=2, help="local + Ray runs each (alternating)")
    args = parser.parse_args()
    model_home = batchllm_home()
    if not (model_home / "models").is_dir():
        raise SystemExit(f"no prepared models in {model_home}: run `batchllm models prepare` first")
    local = DeviceSet("cpu", (0, 1), (NodeDevices("local-core0", (0,)), NodeDevices("local-core1", (1,))))
    print(f"DAG {args.dag.relative_to(REPO) if args.dag.is_relative_to(REPO) else args.dag}; "
          f"{args.rounds} rounds of local processes vs Ray actors; two one-core nodes each", flush=True)
    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as scratch:
        cluster_started = time.monotonic()
        cluster = LocalRayCluster.start([(0,), (1,)], port=free_port(), temp_dir=Path(f"/tmp/blrayb{os.getpid()}"))
        try:
            print(f"two-node Ray cluster on {cluster.address} started in {time.monotonic() - cluster_started:.1f} s", flush=True)
            cluster.drive_from_here()  # the cluster's Ray settings (its token), not the user's
            session = RaySession.connect(cluster.address)
            on_ray = session.devices()
            measured: list[Measured] = []
            for _ in range(args.rounds):
                for mode, devices, current in (("local", local, None), ("ray", on_ray, session)):
                    measured.append(run_once(mode, args.dag, devices, Path(scratch), model_home, current))
                    print(measured[-1].line(), flush=True)
            session.close()
        finally:
            cluster.stop()
            left = cluster.leftovers()
    if left:
        print(f"warning: cluster processes left: {left}")
    summary(measured)
    return 0


def summary(measured: list[Measured]) -> None:
    def median(mode: str, field: str) -> float:
        return statistics.median(getattr(m, field) for m in measured if m.mode == mode)

    print("medians:")
    for mode in ("local", "ray"):
        print(f"  {mode:5s} wall {median(mode, 'wall_s'):.1f} s, engine start {median(mode, 'start_s'):.1f} s, "
              f"after start {median(mode, 'after_start_s'):.1f} s, stages {median(mode, 'stages_s'):.1f} s, orchestration overhead {median(mode, 'overhead_s'):.2f} s")
    wall = median("ray", "wall_s") / median("local", "wall_s")
    after = median("ray", "after_start_s") / median("local", "after_start_s")
    extra = median("ray", "overhead_s") - median("local", "overhead_s")
    stages = median("ray", "stages_s") / median("local", "stages_s")
    print(f"Ray / local wall time: {wall:.3f}x (target <= 1.10x: {'met' if wall <= 1.10 else 'NOT met'}); "
          f"after engine start: {after:.3f}x; stages only (no set-up, no engine shut-down): {stages:.3f}x; orchestration overhead Ray - local: {extra:+.2f} s")


if __name__ == "__main__":
    sys.exit(main())
