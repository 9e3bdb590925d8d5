"""`batchllm plan`'s library entry: a DAG file and a device spec -> schedules.

The chosen schedule is the best of greedy with rollouts, the Max and Min heuristics and,
for small DAGs, a budgeted exact search (see `best.best_schedule`); `compare` adds each of them, plain greedy (SamuLLM's
Algorithm 1), greedy without preemption, the Max and Min heuristics, the exact search
when the DAG is small enough (else it is listed as not run, with the reason), and the
lower bound, all on the same costs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.command_times import CommandTimes
from batchllm.costmodel.output_lengths import OutputLengths
from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.loader import load_dag
from batchllm.dag.model import DagSpec
from batchllm.io.dag_checks import check_dag
from batchllm.io.node_data import Sources
from batchllm.models.registry import batchllm_home
from batchllm.planner.answered_work import answered_states
from batchllm.planner.baselines import lower_bound_s, max_heuristic, min_heuristic
from batchllm.planner.best import EXACT_MAX_NODES, best_schedule
from batchllm.planner.cluster import Cluster, parse_cluster
from batchllm.planner.exact import exact_schedule
from batchllm.planner.from_dag import dag_workloads, measured_paces, server_node_facts
from batchllm.planner.greedy import greedy_schedule
from batchllm.planner.preflight import NodePreflight, node_preflight
from batchllm.planner.problem import PlanProblem, build_problem
from batchllm.planner.rollout import rollout_schedule
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import LoadingEngine, Timeline, loading_engines

PROFILES_ROOT = Path(__file__).resolve().parent.parent.parent / "profiles"


@dataclass(frozen=True)
class NotRun:
    """A method `compare` did not run, and why."""

    method: str
    reason: str


@dataclass(frozen=True)
class PlanReport:
    dag_name: str
    cluster: Cluster
    problem: PlanProblem
    chosen: Schedule
    fit_s: float  # fitting node speeds (simulations), before any search
    lower_bound_s: float
    compared: tuple[Schedule, ...] = ()
    not_run: tuple[NotRun, ...] = ()
    preflight: dict[str, NodePreflight] = field(default_factory=dict)  # per node, in topological order
    priced: bool = False  # the DAG has `prices:`
    command: CommandTimes | None = None  # a `run`'s own start and end on this machine (None: planned for other hardware)
    command_source: str = ""  # where `command` comes from
    all_computed_s: float | None = None  # `chosen` is of the requests the result store does not answer: its total had it answered none

    @property
    def estimated_s(self) -> float:
        """What the user waits for: the stages, and the `run` command's own start and end."""
        return self.chosen.total_s + (self.command.total_s if self.command is not None else 0.0)

    @property
    def search_s(self) -> float:
        return self.fit_s + self.chosen.search_s


def plan_dag_file(path: Path, devices: str, *, profiles_root: Path = PROFILES_ROOT, compare: bool = False,
                  lengths: Mapping[str, OutputLengths] | None = None) -> PlanReport:
    return plan_dag(load_dag(path), devices, profiles_root=profiles_root, compare=compare, lengths=lengths)


def plan_dag(dag: DagSpec, devices: str, *, profiles_root: Path = PROFILES_ROOT, compare: bool = False,
             lengths: Mapping[str, OutputLengths] | None = None, answered_share: Mapping[str, float] | None = None,
             loading: Mapping[str, LoadingEngine] | None = None) -> PlanReport:
    """`lengths`: by node, its predicted output lengths (`LengthModels.planned`); none: each its profile's CDF.
    `answered_share`: by node, the share of its requests answered before the run (the result
    store's): the schedules are of the rest (`answered_work`). `loading`: by node, the engines
    the run will have started before its first stage (early engines), loading for a while."""
    tables = check_dag(dag, batchllm_home(), resolve_models=False)
    cluster = parse_cluster(devices, profiles_root)
    paces = measured_paces(dag, ServerPaceStore(batchllm_home()))
    on_servers, outside = server_notes(dag, tables, paces), server_node_facts(dag, paces)
    dag = dag.on_devices()
    if not dag.nodes:
        raise UserError("every node runs on servers (endpoints:): there are no devices to plan", where=str(dag.path),
                        hint="`batchllm run` sends them to the servers; its progress and `batchllm status` show their pace and ETA")
    started = time.perf_counter()
    workloads = dag_workloads(dag, tables, cluster, profiles_root, ProfileStore.at_home(batchllm_home()),
                              batchllm_home(), lengths=lengths, outside=outside)
    problem = build_problem(cluster, workloads.planning_nodes(), (*workloads.notes, *on_servers))
    fit_s = time.perf_counter() - started
    answered = answered_share if answered_share and any(answered_share.values()) else None
    states = answered_states(problem, answered) if answered else Timeline.start(problem).states
    start = Timeline(problem, 0.0, states, loading_engines(problem, loading or {}))
    chosen = best_schedule(start)
    all_computed_s = best_schedule(Timeline.start(problem)).total_s if answered else None
    compared: tuple[Schedule, ...] = ()
    not_run: tuple[NotRun, ...] = ()
    if compare:
        compared = (rollout_schedule(start), greedy_schedule(start), greedy_schedule(start, preemption=False), max_heuristic(start), min_heuristic(start))
        if len(problem.nodes) <= EXACT_MAX_NODES:
            compared += (exact_schedule(start, max_stages_tried=20_000),)
        else:
            not_run = (NotRun("exact", f"{len(problem.nodes)} nodes, more than {EXACT_MAX_NODES}"),)
    preflight = {item.name: node_preflight(item, dag) for item in workloads.nodes}
    return PlanReport(dag.name, cluster, problem, chosen, fit_s, lower_bound_s(start), compared, not_run, preflight, bool(dag.prices),
                      all_computed_s=all_computed_s)


def server_notes(dag: DagSpec, sources: Sources, paces: Mapping[str, ServerPace | None]) -> tuple[str, ...]:
    """What the plan says of nodes on servers: no devices are chosen for them; their time is
    estimated from the pace a run measured on the same servers, when one did (`measured_paces`)."""
    notes = []
    for name, node in dag.nodes.items():
        if node.model not in dag.endpoints:
            continue
        urls = dag.endpoints[node.model].urls
        head = f"node {name} runs on {len(urls)} server(s) of {node.model} ({', '.join(urls)}), beside the devices"
        pace = paces.get(node.model)
        if pace is None:
            notes.append(f"{head}: no pace of these servers measured yet, so its time is not estimated; `run` measures "
                         "it (its progress and `status` show the ETA) and later plans use it")
            continue
        source = sources[node.input_name]
        rows = int(source.list_lengths(node.iterate.over).sum()) if node.iterate else source.num_rows
        answers = rows * node.sampling.n
        fewer = " (or fewer: its `where:` or its upstream answers may leave fewer)" if node.where or node.reads else ""
        notes.append(f"{head}: about {answers / pace.answers_per_s:,.0f} s for its {answers:,} answers{fewer}, "
                     f"at the pace measured there: {pace.describe()}")
    return tuple(notes)
