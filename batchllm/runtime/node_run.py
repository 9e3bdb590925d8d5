"""One record per node of a run (`NodeRun`), and the run's nodes in topological order (`NodeRuns`).

A node's `status` is the single truth of where it is:

    PENDING  --(a stage assigns it engines)-->  IN_STAGE  --(the next stage begins without it)-->  PENDING
    PENDING | IN_STAGE  --(every unit committed or skipped, every producer finished)-->  FINISHED
    PENDING | IN_STAGE  --(a producer failed, or its engine failed past its restarts)-->  FAILED

Invariant: a node has engines (`replicas`) only in the stage that assigned them: all the while it
is IN_STAGE, and, once FINISHED or FAILED (by a producer) in it, until the next stage begins (a
node of that stage may take them over; a node failed by its own engines' losses has none);
FINISHED and FAILED are final. Where each of its units is, the ledger says
(`NodeLedger`), not this record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from batchllm.core.requests import EngineResult, ModelTask
from batchllm.costmodel.output_lengths import UNLEARNT, OutputLengths, WindowForecast
from batchllm.dag.model import DagSpec, NodeSpec, Price
from batchllm.engines.protocol import EngineConfig
from batchllm.io.input_source import InputSource
from batchllm.io.journal_records import JournalStats, ResultRecord
from batchllm.io.node_journal import ResultJournal
from batchllm.runtime.backlog import Backlog
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.ledger import Ledger, NodeLedger
from batchllm.runtime.nearest_rows import NearestRows
from batchllm.runtime.node_feed import MergedUpstream, Nearest, NodeFeed, Upstream
from batchllm.runtime.pilot import NodePilot
from batchllm.runtime.prepare import PreparedWindow
from batchllm.runtime.progress import NodeStats
from batchllm.runtime.request_keys import NodeKeys
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_state import NodeProgress, RunningPlan, RunningSince
from batchllm.runtime.step_result import NodeCommit


class NodeStatus(enum.Enum):
    PENDING = "pending"  # work left, no engines in the current stage
    IN_STAGE = "in stage"  # work left, engines (or servers) in the current stage
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class NodeRun:
    name: str
    spec: NodeSpec
    index: int  # its topological position, which its request ids carry
    on_servers: bool  # its requests go to servers (`endpoints:`), not to engines on devices
    ancestors: frozenset[str]  # the nodes whose outputs reach it, directly or through others
    journal: ResultJournal
    earlier: JournalStats  # what earlier invocations committed
    ledger: NodeLedger
    feed: NodeFeed
    status: NodeStatus = NodeStatus.PENDING
    replicas: list[EngineConfig] = field(default_factory=list)  # its engines in the current stage
    backlog: Backlog = field(default_factory=Backlog)
    restarts: int = 0  # engines lost or failed to start, counted against MAX_ENGINE_RESTARTS
    plan: RunningPlan | None = None  # its engines on devices as the last stage left them
    since: RunningSince | None = None  # when that plan's engines were ready (or its pilot ended)
    preparing: tuple[Future[PreparedWindow], bool] | None = None  # the window being prepared, fresh units?
    took_window: bool = False  # took a window in this run (the first is small)
    keys: NodeKeys | None = None  # its requests' keys in the result store (None: it neither reuses nor keeps results)
    store_keys: dict[int, bytes] = field(default_factory=dict)  # the key of each of its units rendered and not yet committed
    store_may_answer: bool = True  # the store held answers of its scope as the run began (else its requests are not looked up)
    reused: JournalStats = JournalStats()  # its units taken from the result store in this run, with their tokens
    pilot: NodePilot | None = None  # its pilot while it runs: from the run's opening until its last result is in (or it fails)
    lengths: OutputLengths | None = None  # its answer lengths as the run's cost model learns them (None: no cost model plans it)
    failure: str | None = None  # why it stopped with work left: set with FAILED (`fail`), the status the truth of failing
    stats: NodeStats | None = None  # its progress counters, made when it starts (`start`) and kept after the run

    @property
    def is_open(self) -> bool:
        return self.status in (NodeStatus.PENDING, NodeStatus.IN_STAGE)

    def enter_stage(self, replicas: list[EngineConfig]) -> None:
        self.status, self.replicas = NodeStatus.IN_STAGE, replicas

    def leave_stage(self) -> None:
        if self.status is NodeStatus.IN_STAGE:
            self.status = NodeStatus.PENDING
        self.replicas = []

    def finish(self) -> None:
        self.status = NodeStatus.FINISHED

    def fail(self, cause: str) -> None:
        self.status, self.failure, self.pilot = NodeStatus.FAILED, cause, None  # its pilot will not end

    def forecast(self) -> WindowForecast:
        """Its requests' predicted answer tokens, for the split and order of a window: its lengths' forecast, else
        (nothing learns them) the most each may generate."""
        return (self.lengths or UNLEARNT).forecast()

    def set_plan(self, running: RunningPlan | None) -> None:
        """Its engines on devices in the stage that begins (None: none); a plan kept from the last
        stage keeps its clock."""
        self.plan, self.since = running, self.since if running is not None and self.plan == running else None

    def start_clock(self, now_s: float) -> None:
        """Its engines are ready: a new plan's time on it starts now."""
        if self.plan is not None and self.since is None:
            self.since = RunningSince(now_s, self.ledger.committed_units)

    def start(self, price: Price | None) -> NodeStats | None:
        """Its progress counters as it starts in this run (with what earlier invocations did); None: it
        started before."""
        if self.stats is not None:
            return None
        self.stats = NodeStats(self.name, self.spec.model, self.ledger.unit_counts, self.ledger.committed_units, earlier=self.earlier,
                         price=price, pools=self.spec.task.pools, reused=self.reused.committed)
        return self.stats

    def commit(self, units: np.ndarray, results: list[EngineResult], ledger: Ledger) -> NodeCommit:
        """Journal its results (of `units`, in the same order) and mark them committed."""
        rows, steps = self.ledger.row_step_of(units)
        self.journal.append_many([
            ResultRecord(row, step, r.texts, r.num_prompt_tokens, r.num_output_tokens, r.finish_text(), r.logprobs, r.vector, r.score)
            for row, step, r in zip(rows.tolist(), steps.tolist(), results)])
        self.feed.requeue(ledger.commit(self.name, units))
        return NodeCommit.of(self.name, results)

    def commit_stored(self, units: np.ndarray, records: list[ResultRecord]) -> None:
        """Journal results taken from the result store (of `units`, in the same order, their row
        and step still the store's) and mark them committed: they never reach an engine."""
        rows, steps = self.ledger.row_step_of(units)
        self.journal.append_many([record._replace(row=row, step=step) for row, step, record in zip(rows.tolist(), steps.tolist(), records)])
        self.feed.requeue(self.ledger.reuse(units))
        self.reused = self.reused.plus(JournalStats.of(records))
        for unit in units.tolist():
            self.store_keys.pop(unit, None)

    def progress(self, now_s: float, producers_finished: bool) -> NodeProgress:
        """Its units done, and how long it has run on its current plan (from how many units done)."""
        done = self.ledger.committed_units
        since = self.since if self.plan is not None else None
        running_s, before = (now_s - since.at_s, since.done_units) if since is not None else (0.0, done)
        return NodeProgress(done, self.ledger.total_units, producers_finished, running_s, before)


class NodeRuns:
    """The run's nodes in topological order, by name."""

    def __init__(self, runs: list[NodeRun]):
        self._order = list(runs)  # by topological position (`at`)
        self._runs = {run.name: run for run in runs}
        self._failed: list[NodeRun] = []  # in the order they failed

    def __getitem__(self, name: str) -> NodeRun:
        return self._runs[name]

    def __iter__(self) -> Iterator[NodeRun]:
        return iter(self._runs.values())

    def begin_stage(self, assigned: Mapping[str, list[EngineConfig]], plans: Mapping[str, RunningPlan]) -> None:
        """A stage begins: the nodes it assigns engines (and, on devices, a plan) are IN_STAGE."""
        for run in self:
            run.leave_stage()
            if run.name in assigned:
                run.enter_stage(assigned[run.name])
            run.set_plan(plans.get(run.name))

    def end_pilots(self, names: Iterable[str]) -> list[NodeRun]:
        """The nodes of these whose pilot has every result now: their pilot is over."""
        ended = [run for run in map(self.__getitem__, names) if run.pilot is not None and run.pilot.ended(run.ledger)]
        for run in ended:
            run.pilot = None
        return ended

    def piloting(self) -> bool:
        """A pilot runs."""
        return any(run.pilot is not None for run in self)

    def open_ones(self) -> list[NodeRun]:
        return [run for run in self if run.is_open]

    def in_stage(self) -> list[NodeRun]:
        """The nodes the current stage runs, producers first."""
        return [run for run in self if run.status is NodeStatus.IN_STAGE]

    def with_engines(self) -> list[NodeRun]:
        """The nodes with engines in the current stage (also those finished in it), producers first."""
        return [run for run in self if run.replicas]

    def owner_of(self, config: EngineConfig) -> NodeRun | None:
        """The node whose engine this is in the current stage."""
        return next((run for run in self if config in run.replicas), None)

    def producers_finished(self, run: NodeRun) -> bool:
        return all(self[u].status is NodeStatus.FINISHED for u in run.spec.upstream)

    def settle(self) -> tuple[list[NodeRun], list[NodeRun]]:
        """Fail the open nodes a producer of which failed, and finish those whose producers all
        finished and whose units are all committed or skipped. Returns (failed, finished)."""
        failed, finished = [], []
        for run in self.open_ones():  # producers first: a failure reaches every node below it
            blocked = [u for u in run.spec.upstream if self[u].status is NodeStatus.FAILED]
            if blocked:
                self.fail(run, f"upstream node {blocked[0]!r} failed")
                failed.append(run)
                continue
            if not self.producers_finished(run):
                continue
            if not run.ledger.is_settled() and run.status is not NodeStatus.IN_STAGE:
                run.feed.admit_all()  # rows no upstream output reaches need no engine
            if run.ledger.is_settled():
                run.finish()
                finished.append(run)
        return failed, finished

    def planned_progress(self, now_s: float) -> dict[str, NodeProgress]:
        """The progress of the open nodes the stage chooser places on devices: not on servers, and
        not behind an unfinished node on servers, directly or through others (the chooser plans
        the nodes on devices only, so it cannot know when that one ends)."""
        return {run.name: run.progress(now_s, self.producers_finished(run)) for run in self.open_ones()
                if not run.on_servers and not any(self[a].on_servers and self[a].status is not NodeStatus.FINISHED
                                                  for a in run.ancestors)}

    def running_plans(self) -> dict[str, RunningPlan]:
        """The engines on devices as the last stage left them, of the nodes that did not fail."""
        return {run.name: run.plan for run in self if run.plan is not None and run.status is not NodeStatus.FAILED}

    def at(self, index: int) -> NodeRun:
        """The node at this topological position (what its request ids carry)."""
        return self._order[index]

    def fail(self, run: NodeRun, cause: str) -> None:
        run.fail(cause)
        self._failed.append(run)

    def failures(self) -> dict[str, str]:
        """Why each failed node stopped with work left, in the order they failed."""
        return {run.name: run.failure for run in self._failed if run.failure is not None}

    def journals(self) -> dict[str, ResultJournal]:
        return {run.name: run.journal for run in self}


def open_node_runs(dag: DagSpec, sources: dict[str, InputSource], run_dir: RunDir, note: Callable[[str], None],
                   vector_dimensions: dict[str, int]) -> tuple[NodeRuns, Ledger, dict[str, str]]:
    """Each node's journal (what earlier invocations committed; an embed node's with its
    vector size), the ledger restored from them, and each node's feed; also each node's
    fingerprint. Damaged journal lines are noted."""
    order = dag.topological_order()
    prints = node_fingerprints(dag, sources)
    journals = {n: ResultJournal(run_dir.journal_folder(n), prints[n], n, samples=dag.nodes[n].sampling.n,
                                 logprobs=dag.nodes[n].sampling.logprobs, vector_dimensions=vector_dimensions.get(n),
                                 scores=dag.nodes[n].task is ModelTask.SCORE)
                for n in order}
    for journal in journals.values():
        for damage in journal.damage:
            note(f"[yellow]journal damaged:[/yellow] {damage}")
    ledger = Ledger(_node_ledger(dag.nodes[n], sources, journals[n]) for n in order)

    def upstream_of(name: str) -> dict[str, Upstream | MergedUpstream]:
        """What the node's templates read by name: upstream nodes, and merges of them."""
        producer = lambda u: Upstream(ledger[u], journals[u])  # noqa: E731
        return {n: MergedUpstream([producer(u) for u in dag.merges[n]]) if n in dag.merges else producer(n)
                for n in dag.nodes[name].reads}

    def nearest_of(name: str) -> dict[str, Nearest]:
        """The nearest lists the node's templates read by name."""
        lists: dict[str, Nearest] = {}
        for read in dag.nodes[name].nearest_read:
            spec = dag.nearest[read]
            lists[read] = NearestRows(spec, Upstream(ledger[spec.query], journals[spec.query]),
                                      Upstream(ledger[spec.corpus], journals[spec.corpus]),
                                      sources[dag.nodes[spec.corpus].input_name], vector_dimensions[spec.corpus])
        return lists

    runs = []
    for index, name in enumerate(order):
        node = dag.nodes[name]
        feed = NodeFeed(node, index, ledger[name], sources[node.input_name], journals[name], upstream_of(name), nearest_of(name),
                        adapter=node.request_adapter(dag.on_endpoints(name)))
        runs.append(NodeRun(name, node, index, dag.on_endpoints(name), frozenset(dag.ancestors(name)), journals[name],
                            journals[name].stats(), ledger[name], feed))
    return NodeRuns(runs), ledger, prints


def _node_ledger(node: NodeSpec, sources: Mapping[str, InputSource], journal: ResultJournal) -> NodeLedger:
    source = sources[node.input_name]
    steps = source.list_lengths(node.iterate.over) if node.iterate else None
    ledger = NodeLedger(node.name, source.num_rows, steps)
    for rows, steps_done in journal.committed_key_batches():  # a segment at a time
        ledger.restore_committed(rows, steps_done)
    return ledger
