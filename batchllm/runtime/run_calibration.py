"""What a planned run learns about its cost model as it goes (`RunCalibration`, a run observer).

- every engine start, step and finished output goes to its model's `ModelCalibration`
  (a run's first steps are its prefills and the first evidence there is, so none is left
  out as warm-up, unlike the profile builder's; the prior's warm-up stays in the start
  cost); output lengths are also kept per node (prompts differ by node), and each node's
  measured prompt tokens correct the planner's estimate of them (4 characters a token,
  plus a guess for the chat template);
- `calibrated_problem()` is the planner's problem rebuilt on the calibrated profiles (one
  simulation per (node, replica shape), tens of milliseconds per node), which
  `CalibratedStages` plans each stage on and `RunEstimates` estimates the time left on;
- once every output a node has left is being generated (nothing waits, no prefill), its
  finish is what those outputs still need (`batch_tail_s`: their ages, the calibrated
  lengths, the replicas' recent steps), since the fluid plan knows only its average pace;
- at the end `save` files what was measured in the local profile store, so the next plan
  on this machine starts from it.

Each node's answer lengths are its own object (`costmodel.calibration.node_lengths`), an
`OutputLengths` (`costmodel.output_lengths`): this observer feeds them the node's outputs and its
engines' steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import numpy as np

from batchllm.core.requests import EngineResult
from batchllm.costmodel.calibration.batch_tail import batch_left_s
from batchllm.costmodel.calibration.model import SHAPES_MEASURED_HERE, ModelCalibration, SpeedFactors
from batchllm.costmodel.calibration.node_lengths import NodeLengths, output_length
from batchllm.costmodel.calibration.store import LORA_REVISION, LORA_SETTING, ProfileStore
from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.latency import step_features
from batchllm.costmodel.output_lengths import LogShift
from batchllm.costmodel.profile import ReplicaShape
from batchllm.costmodel.request_lengths import RequestLengths, relative_shifts
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady
from batchllm.planner.engine_groups import grouped, problem_groups
from batchllm.planner.problem import NodeWorkload, PlanProblem, build_problem
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.run_state import NodeProgress
from batchllm.runtime.step_result import StepResult

MIN_STEPS_TO_SAVE = 30  # fewer measured steps than this teach the store nothing
RECENT_STEPS = 8  # an engine's last steps: measured over predicted time is how fast it goes now


def shape_key(config: EngineConfig) -> str:
    return ReplicaShape(len(config.replica.device_ids), config.replica.tp).key


@dataclass
class _Snapshot:
    """An engine's last step, and its recent ones (for what the machine does right now)."""

    node: str
    shape: str
    prefill_tokens: int
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # (features, wall_s)


class RunCalibration(RunObserver):
    def __init__(self, problem: PlanProblem, workloads: list[NodeWorkload], *, store: ProfileStore | None = None,
                 settings: dict[str, object] | None = None, source: str = "a run", clock: Callable[[], float] = time.monotonic,
                 log_shifts: dict[str, LogShift] | None = None):
        """`problem`: the planner's problem on the prior profiles (its cluster and notes are kept);
        `settings`: run settings known before the start (the store's key); `source`: what the
        store says the evidence came from; `log_shifts`: per node, its model's length model
        (per-request shifts), where one is used."""
        self.problem, self.workloads, self.store = problem, workloads, store
        self.settings, self.source, self.clock = settings or {}, source, clock
        self.by_node = {w.name: w for w in workloads}
        self.models: dict[str, ModelCalibration] = {}
        for w in workloads:
            self.models.setdefault(w.profile.model, ModelCalibration(w.profile))
        self.lengths = {w.name: NodeLengths(w.name, w.profile.lengths, max_tokens=int(np.max(w.workload.max_tokens, initial=1)),
                                            requests_per_unit=w.requests_per_unit,
                                            planned_prompt_tokens=float(np.mean(w.workload.prompt_tokens)) if len(w.workload) else 0.0,
                                            log_shift=(log_shifts or {}).get(w.name), clock=clock)
                        for w in workloads}
        self._snapshots: dict[Hashable, _Snapshot] = {}
        self._version = 0
        self._built_version = self._versions()  # when the problem was last built (the prior's: nothing measured yet)
        self._calibrated = problem

    # -- what the executor tells it --------------------------------------------------------------
    def engine_started(self, node: str, config: EngineConfig, load_time_s: float, ready: WorkerReady) -> None:
        model = self._model_of(node)
        if model is None:
            return
        key = shape_key(config)
        model.observe_load(key, load_time_s)
        model.observe_started(key, config, ready)
        self._version += 1

    def observe(self, result: StepResult) -> None:
        for commit in result.commits:
            self._committed(commit.node, commit.results)
        for engine_step in result.engine_steps:
            self._step(engine_step.node, engine_step.config, engine_step.step)

    def _step(self, node: str | None, config: EngineConfig, step: StepRecord) -> None:
        model = self._model_of(node)
        if model is None or node is None:
            return
        engine, key = config.sharing_key(), shape_key(config)
        model.observe_step(key, step_features(step), step.wall_s)
        previous = self._snapshots.get(engine)
        if previous is not None and previous.node != node:  # the engine runs another node now: none of the last one's
            self.lengths[previous.node].observe_running(engine, 0, 0)
        self.lengths[node].observe_running(engine, step.decode_seqs, step.decode_context)
        snapshot = _Snapshot(node, key, step.prefill_tokens,
                             previous.recent if previous is not None and previous.shape == key else deque(maxlen=RECENT_STEPS))
        snapshot.recent.append((step_features(step), step.wall_s))
        self._snapshots[engine] = snapshot
        self._version += 1

    def _committed(self, node: str, results: tuple[EngineResult, ...]) -> None:
        model = self._model_of(node)
        if model is None:
            return
        n = self.by_node[node].requests_per_unit
        for result in results:
            if (seen := output_length(result, n)) is not None:
                model.lengths.observe(*seen, n)
        self.lengths[node].observe(results)
        self._version += 1

    # -- the calibrated cost model ------------------------------------------------------------
    def calibrated_problem(self) -> PlanProblem:
        """The planner's problem on the calibrated profiles and prompt sizes (rebuilt only
        when something was measured since the last one)."""
        version = self._versions()
        if self._built_version == version:
            return self._calibrated
        self._built_version = version
        calibrated = [self.calibrated_workload(w.name) for w in self.workloads]
        self._calibrated = build_problem(self.problem.cluster, grouped(calibrated, problem_groups(self.problem)), self.problem.notes)
        return self._calibrated

    def _versions(self) -> tuple[int, ...]:
        """What was measured so far, as counters: its own and each node's lengths'."""
        return (self._version, *(lengths.version for lengths in self.lengths.values()))

    def calibrated_workload(self, node: str) -> NodeWorkload:
        item = self.by_node[node]
        model = self.models[item.profile.model]
        lengths = self.lengths[node]
        posterior = lengths.posterior() if lengths.has_evidence else None
        profile = model.profile(posterior, self.machine_factors())
        workload = self._scaled_prompts(node)
        if posterior is not None and workload.output_lengths is not None:  # the run's own lengths, each request's shift kept
            shifts = lengths.spread_now * workload.output_lengths.log_shift
            workload = replace(workload, output_lengths=RequestLengths(posterior, relative_shifts(shifts), "pilot"))
        return replace(item, profile=profile, workload=workload)

    def machine_factors(self) -> SpeedFactors | None:
        """Speed factors over every model measured: for a model no engine ran yet."""
        measured = [m.factors() for m in self.models.values()]
        steps, loads = sum(f.steps for f in measured), sum(f.loads for f in measured)
        if not steps and not loads:
            return None
        step = float(np.exp(sum(f.steps * np.log(f.step) for f in measured) / steps)) if steps else 1.0
        load = float(np.exp(sum(f.loads * np.log(f.load) for f in measured) / loads)) if loads else 1.0
        return SpeedFactors(step, load, steps, loads)

    def _scaled_prompts(self, node: str) -> Workload:
        workload = self.by_node[node].workload
        factor = self.lengths[node].prompt_factor()
        if factor == 1.0:
            return workload
        prompts = np.maximum(np.round(workload.prompt_tokens * factor), 1).astype(np.int64)
        cached = None if workload.cached_tokens is None else \
            np.minimum(np.round(workload.cached_tokens * factor).astype(np.int64), prompts - 1)
        return replace(workload, prompt_tokens=prompts, cached_tokens=cached)

    def batch_tail_s(self, node: str, progress: NodeProgress) -> float | None:
        """When nothing of the node waits any more (every output left is being generated,
        no prefill), the time its replicas' running outputs still take (the slowest
        replica's); None otherwise."""
        item, node_lengths = self.by_node[node], self.lengths[node]
        running = node_lengths.running_engines()
        snapshots = [(self._snapshots[engine], *decoding) for engine, decoding in running.items()]
        left = (progress.total_units - progress.done_units) * item.requests_per_unit
        if not progress.total_known or not snapshots or any(s.prefill_tokens for s, _, _ in snapshots) or \
                sum(seqs for _, seqs, _ in snapshots) < left or len(item.workload) == 0:
            return None
        model = self.models[item.profile.model]
        lengths = node_lengths.posterior()
        prompt = node_lengths.mean_prompt_tokens()
        max_tokens = node_lengths.max_tokens
        tails = []
        for snapshot, decode_seqs, decode_context in snapshots:
            calibration = model.latency.get(snapshot.shape)
            latency = calibration.model() if calibration is not None and calibration.steps else \
                model.profile(fallback=self.machine_factors()).shapes[snapshot.shape].latency
            predicted = sum(latency.step_s(f) for f, _ in snapshot.recent)
            factor = sum(w for _, w in snapshot.recent) / predicted if predicted > 0 else 1.0
            age = max(0, round(decode_context / decode_seqs - prompt))
            tails.append(batch_left_s(latency, lengths, decode_seqs, age, prompt, max_tokens, factor))
        return max(tails)

    def _model_of(self, node: str | None) -> ModelCalibration | None:
        item = self.by_node.get(node) if node is not None else None
        return self.models[item.profile.model] if item is not None else None

    # -- across runs ---------------------------------------------------------------------------
    def save(self) -> list[str]:
        """File every model measured enough in the store; one line per model saved."""
        cluster = self.problem.cluster
        if self.store is None or not cluster.local or cluster.identity is None:
            return []
        lines = []
        for name, model in self.models.items():
            evidence = model.evidence()
            if evidence.steps < MIN_STEPS_TO_SAVE:
                continue
            ran = model.engine.get("engine_version")
            if "engine_version" in self.settings and ran != self.settings["engine_version"]:
                lines.append(f"learnt profile of {name} not saved: its engines reported {ran!r}, not "
                             f"{self.settings['engine_version']!r} (a stand-in engine teaches nothing about the real one)")
                continue
            settings = {**self.settings, LORA_SETTING: LORA_REVISION} if model.engine.get(LORA_SETTING) else self.settings  # kept apart
            calibrated = model.profile_to_keep(fallback=self.machine_factors())
            here = model.shapes_measured_here()
            learnt = replace(calibrated, kind="learnt", hardware=cluster.identity.folder_name, identity=cluster.identity,
                             engine={**calibrated.engine, **{k: v for k, v in self.settings.items() if k in ("dtype", "enforce_eager")}},
                             notes={"prior": f"{model.prior.kind} {model.prior.hardware}/{model.prior.model}",
                                    "shapes_measured": list(evidence.shapes_measured), SHAPES_MEASURED_HERE: list(here),
                                    "shapes_kept": [k for k in here if k not in evidence.shapes_measured],
                                    "shapes_rescaled": [k for k in calibrated.shapes if k not in here]})
            folder = self.store.save(learnt, cluster.identity, settings, source=self.source,
                                     evidence={"steps": evidence.steps, "outputs": evidence.outputs, "loads": evidence.loads,
                                               "shapes_measured": list(evidence.shapes_measured)})
            lines.append(f"learnt profile of {name} saved: {folder} ({evidence.steps:,} steps, {evidence.outputs:,.0f} outputs)")
        return lines
