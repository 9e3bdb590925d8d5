"""Plans for clusters of 1, 2 and 4 nodes on SamuLLM's scenarios (issue 4's workloads, from
planner_paper_scenarios.py): the estimate per node count, and a check of every stage of
every chosen plan that each replica (and so its tensor-parallel group) lies inside one
node and starts at a multiple of its size there (inside one NVLink group).

    .venv/bin/python benchmarks/ray_plan_scaling.py [--gpu A100-80G] [--gpu H100-80G]

Nothing runs: estimates come from the analytic profiles, which charge nothing for
traffic between nodes or the driver (see the plan note of a multi-node cluster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner_paper_scenarios import PROFILES, scenarios  # noqa: E402

from batchllm.planner.best import best_schedule  # noqa: E402
from batchllm.planner.cluster import Cluster, parse_cluster  # noqa: E402
from batchllm.planner.problem import build_problem  # noqa: E402
from batchllm.planner.schedule import Schedule  # noqa: E402
from batchllm.planner.timeline import Timeline  # noqa: E402

NODE_COUNTS = (1, 2, 4)


def misplaced(schedule: Schedule, cluster: Cluster) -> list[str]:
    """Replicas that cross a node boundary or are not aligned to their size inside a node."""
    starts, bad = [], []
    for _size in cluster.nodes:
        starts.append(sum(cluster.nodes[:len(starts)]))
    for stage in schedule.stages:
        for name, plan in stage.plans.items():
            ids, size = stage.placement[name], plan.shape.devices
            for k in range(plan.dp):
                replica = ids[k * size:(k + 1) * size]
                node_start = max(s for s in starts if s <= replica[0])
                node_end = node_start + cluster.nodes[starts.index(node_start)]
                contiguous = list(replica) == list(range(replica[0], replica[0] + size))
                if not contiguous or replica[-1] >= node_end or (replica[0] - node_start) % size:
                    bad.append(f"stage {stage.index} {name} {plan} on {replica}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="append", help="GPU kinds (default: A100-80G and H100-80G)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    for gpu in args.gpu or ["A100-80G", "H100-80G"]:
        clusters = [parse_cluster(f"{n}x{args.gpus_per_node}x{gpu}" if n > 1 else f"{args.gpus_per_node}x{gpu}", PROFILES)
                    for n in NODE_COUNTS]
        print(f"{gpu}, {args.gpus_per_node} per node (NVLink groups of {clusters[0].nvlink_group}); estimated seconds; "
              "speed-up over one node in brackets; max tp; replicas outside a node or NVLink group")
        print(f"{'scenario':28} " + " ".join(f"{str(c):>22}" for c in clusters) + f" {'max tp':>6} {'misplaced':>9} {'search':>7}")
        for index, (name, _, _) in enumerate(scenarios(clusters[0])):
            started, cells, max_tp, bad = time.perf_counter(), [], 0, []
            base = None
            for cluster in clusters:
                workloads = scenarios(cluster)[index][1]
                schedule = best_schedule(Timeline.start(build_problem(cluster, workloads)))
                base = base or schedule.total_s
                cells.append(f"{schedule.total_s:9.0f} ({base / schedule.total_s:4.2f}x)")
                max_tp = max([max_tp] + [p.shape.tp for s in schedule.stages for p in s.plans.values()])
                bad += misplaced(schedule, cluster)
            print(f"{name:28} " + " ".join(f"{c:>22}" for c in cells)
                  + f" {max_tp:6d} {len(bad):9d} {time.perf_counter() - started:6.1f}s", flush=True)
            for line in bad[:3]:
                print(f"    misplaced: {line}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
