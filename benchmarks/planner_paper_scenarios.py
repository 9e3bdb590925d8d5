"""Planner quality and search time on SamuLLM's published workloads (analytic A100 profiles).

    .venv/bin/python benchmarks/planner_paper_scenarios.py [--devices 8xA100-80G]

Scenarios, built from the paper's statistics (prompt sets are synthetic with the
published ranges and means; output lengths come from each model's profile):
  (a) ensembling: 9 models of 6-13B, 1,000 or 10,000 requests each, inputs 5-127
      tokens (mean 21), max output 256 or 512;
  (b) routing: Llama-2-70B, Mixtral-8x7B, WizardLM-13B, CodeLlama-34B, Mistral-7B with
      408 / 1,267 / 2,068 / 456 / 2,657 requests, inputs 9-577 (mean 310), max output 4,096;
  (c) chain summary: a 13B summariser over 100-500 documents, chunk counts skewed
      (median 3, max 60 per 100 documents; 2,048-token chunks), a 70B evaluator run 1-4
      times per summary, pipelined behind it;
  (d) the mix of (a) and (c);
  plus small instances (3 ensemble models, the chain) where the exact search finishes.
Each row: estimated time of greedy, greedy without preemption, Max, Min, the exact optimum
where tractable, the lower bound; greedy's ratios; search time. Last line: the worst
greedy / best-known ratio and the longest search (model speeds fit included).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.costmodel.estimator import Workload  # noqa: E402
from batchllm.costmodel.profile import find_profile  # noqa: E402
from batchllm.planner.baselines import lower_bound_s, max_heuristic, min_heuristic  # noqa: E402
from batchllm.planner.best import best_schedule  # noqa: E402
from batchllm.planner.cluster import Cluster, parse_cluster  # noqa: E402
from batchllm.planner.exact import exact_schedule  # noqa: E402
from batchllm.planner.greedy import greedy_schedule  # noqa: E402
from batchllm.planner.problem import NodeWorkload, PlanProblem, build_problem  # noqa: E402
from batchllm.planner.timeline import Timeline  # noqa: E402

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
ENSEMBLE = ["llama-2-7b", "llama-2-13b", "vicuna-13b", "wizardlm-13b", "chatglm3-6b", "mpt-7b-chat", "stablelm-7b",
            "pythia-12b", "dolly-v2-12b"]
ROUTING = {"llama-2-70b": 408, "mixtral-8x7b": 1267, "wizardlm-13b": 2068, "codellama-34b": 456, "mistral-7b": 2657}


def prompt_lengths(count: int, low: int, high: int, mean: float, seed: int) -> np.ndarray:
    """Log-normal lengths clipped to [low, high], with the median set so the mean is ~`mean`."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.exp(rng.normal(math.log(mean) - sigma * sigma / 2, sigma, count))
    return np.clip(np.round(lengths), low, high).astype(np.int64)


def chunk_counts(documents: int) -> np.ndarray:
    """Skewed chunks per document: median 3, max 60 per 100 documents (log-normal quantiles)."""
    from statistics import NormalDist

    sigma = math.log(60 / 3) / NormalDist().inv_cdf(1 - 0.5 / 100)
    quantiles = [(i + 0.5) / documents for i in range(documents)]
    return np.clip(np.round([3 * math.exp(sigma * NormalDist().inv_cdf(q)) for q in quantiles]), 1, 60).astype(np.int64)


def ensemble_nodes(cluster: Cluster, models: list[str], requests: int, max_tokens: int, prefix: str = "") -> list[NodeWorkload]:
    prompts = prompt_lengths(requests, 5, 127, 21, seed=1)
    return [NodeWorkload(prefix + m, find_profile(PROFILES, cluster.hardware, m), Workload.of(prompts, max_tokens), (requests,))
            for m in models]


def routing_nodes(cluster: Cluster) -> list[NodeWorkload]:
    nodes = []
    for seed, (model, count) in enumerate(ROUTING.items()):
        prompts = prompt_lengths(count, 9, 577, 310, seed=10 + seed)
        nodes.append(NodeWorkload(model, find_profile(PROFILES, cluster.hardware, model), Workload.of(prompts, 4096), (count,)))
    return nodes


def chain_nodes(cluster: Cluster, documents: int) -> list[NodeWorkload]:
    chunks = chunk_counts(documents)
    rounds = tuple(int((chunks > k).sum()) for k in range(int(chunks.max())))
    summariser = find_profile(PROFILES, cluster.hardware, "llama-2-13b")
    summary_tokens = 200
    steps = int(chunks.sum())
    summarise = Workload.of(np.full(min(steps, 2000), 2048 + summary_tokens), summary_tokens)
    evaluations = int(np.random.default_rng(3).integers(1, 5, documents).sum())
    evaluate = Workload.of(np.full(min(evaluations, 2000), summary_tokens + 60), 64)
    return [NodeWorkload("summarise-13b", summariser, summarise, rounds),
            NodeWorkload("evaluate-70b", find_profile(PROFILES, cluster.hardware, "llama-2-70b"), evaluate, (evaluations,),
                         producers=("summarise-13b",))]


def scenarios(cluster: Cluster) -> list[tuple[str, list[NodeWorkload], bool]]:
    """(name, nodes, try the exact search)."""
    return [
        ("a ensemble 9x1000 out256", ensemble_nodes(cluster, ENSEMBLE, 1000, 256), False),
        ("a ensemble 9x1000 out512", ensemble_nodes(cluster, ENSEMBLE, 1000, 512), False),
        ("a ensemble 9x10000 out256", ensemble_nodes(cluster, ENSEMBLE, 10000, 256), False),
        ("a ensemble 9x10000 out512", ensemble_nodes(cluster, ENSEMBLE, 10000, 512), False),
        ("a-small 3x1000 out512", ensemble_nodes(cluster, ENSEMBLE[:3], 1000, 512), True),
        ("b routing 5 models", routing_nodes(cluster), True),
        ("c chain 100 docs", chain_nodes(cluster, 100), True),
        ("c chain 500 docs", chain_nodes(cluster, 500), True),
        ("d mix a(9x1000) + c(100)", ensemble_nodes(cluster, ENSEMBLE, 1000, 512) + chain_nodes(cluster, 100), False),
        ("speed 10 models x 10000", ensemble_nodes(cluster, ENSEMBLE + ["mistral-7b"], 10000, 512), False),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="8xA100-80G")
    args = parser.parse_args()
    cluster = parse_cluster(args.devices, PROFILES)
    print(f"devices {cluster}; times are estimated seconds. greedy: Algorithm 1; batchllm: what `batchllm plan` picks (greedy with rollouts, or Max/Min if they end earlier).")
    print(f"{'scenario':28} {'greedy':>7} {'batchllm':>8} {'no-pre':>7} {'max':>7} {'min':>7} {'exact':>7} {'bound':>7} "
          f"{'b/max':>6} {'b/min':>6} {'g/best':>6} {'b/best':>6} {'search':>7}")
    worst_greedy, worst, longest_search = 0.0, 0.0, 0.0
    for name, workloads, try_exact in scenarios(cluster):
        started = time.perf_counter()
        problem: PlanProblem = build_problem(cluster, workloads)
        start = Timeline.start(problem)
        planned = best_schedule(start)
        search_s = time.perf_counter() - started
        greedy, no_preemption = greedy_schedule(start), greedy_schedule(start, preemption=False)
        max_s, min_s = max_heuristic(start).total_s, min_heuristic(start).total_s
        exact = exact_schedule(start, max_stages_tried=20_000) if try_exact else None
        best = min([planned.total_s, greedy.total_s, no_preemption.total_s, max_s, min_s] + ([exact.total_s] if exact else []))
        exact_text = "-" if exact is None else f"{exact.total_s:.0f}" + ("" if exact.optimal else "?")
        worst_greedy = max(worst_greedy, greedy.total_s / best)
        worst, longest_search = max(worst, planned.total_s / best), max(longest_search, search_s)
        print(f"{name:28} {greedy.total_s:7.0f} {planned.total_s:8.0f} {no_preemption.total_s:7.0f} {max_s:7.0f} {min_s:7.0f} "
              f"{exact_text:>7} {lower_bound_s(start):7.0f} {max_s / planned.total_s:6.2f} {min_s / planned.total_s:6.2f} "
              f"{greedy.total_s / best:6.3f} {planned.total_s / best:6.3f} {search_s:6.2f}s")
    print("exact: '?' = search budget hit, best found shown. b/max, b/min: speed-up of batchllm over the heuristic.")
    print("search: fitting node speeds (simulations) + greedy with rollouts + Max + Min (+ budgeted exact search up to 5 nodes), wall time.")
    print(f"worst greedy/best-known {worst_greedy:.3f}; worst batchllm/best-known {worst:.3f}; max search time {longest_search:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
