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

Outputs still being generated are censored observations at their age: an engine's last
step gives how many sequences decode and their total context, so their mean age is that
context per sequence less the node's mean prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineResult, FinishReason
from batchllm.costmodel.calibration.batch_tail import batch_left_s
from batchllm.costmodel.calibration.model import ModelCalibration, SpeedFactors
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.latency import step_features
from batchllm.costmodel.length_spread import fitted_spread
from batchllm.costmodel.profile import ReplicaShape
from batchllm.costmodel.request_lengths import RequestLengths, relative_shifts
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady
from batchllm.planner.problem import NodeWorkload, PlanProblem, build_problem
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.output_forecast import CalibratedForecast, LogShift
from batchllm.runtime.run_state import NodeProgress
from batchllm.runtime.step_result import StepResult

PILOT_PRIOR_OUTPUTS = 0.5  # the prior's weight in outputs once a node's pilot has ended (a random sample of the set)
PROMPT_PRIOR_UNITS = 8.0  # the planner's prompt estimate counts as this many measured prompts
MIN_STEPS_TO_SAVE = 30  # fewer measured steps than this teach the store nothing
SNAPSHOT_MAX_AGE_S = 10.0  # an engine's last step older than this says nothing about what runs now
RECENT_STEPS = 8  # an engine's last steps: measured over predicted time is how fast it goes now


def shape_key(config: EngineConfig) -> str:
    return ReplicaShape(len(config.replica.device_ids), config.replica.tp).key


@dataclass
class NodeEvidence:
    prompt_tokens: int = 0  # measured, over `units` results
    units: int = 0


@dataclass(frozen=True)
class PilotLearnt:
    """What a node's pilot taught: its answers' mean length and the prior's (both cut at the
    node's max_tokens), and how much of its length model's spread held (None: no length model)."""

    mean_output_tokens: float
    prior_mean_output_tokens: float
    max_tokens: int
    spread: float | None

    def note(self, node: str) -> str:
        held = "" if self.spread is None else \
            f"; the length model's differences between its requests: {self.spread:.0%} of them held on it"
        return (f"pilot of {node} done: mean answer {self.mean_output_tokens:.0f} tokens at max_tokens {self.max_tokens} "
                f"(the prior's {self.prior_mean_output_tokens:.0f}){held}; planning the rest on it")


@dataclass
class _Snapshot:
    """An engine's last step, and its recent ones (for what the machine does right now)."""

    node: str
    shape: str
    decode_seqs: int
    decode_context: int
    prefill_tokens: int
    at_s: float
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
        self.log_shifts = log_shifts or {}
        self.spreads: dict[str, float] = {}  # per node whose pilot ended: how much of its length model's spread held
        self.settings, self.source, self.clock = settings or {}, source, clock
        self.by_node = {w.name: w for w in workloads}
        self.models: dict[str, ModelCalibration] = {}
        for w in workloads:
            self.models.setdefault(w.profile.model, ModelCalibration(w.profile))
        self.node_lengths = {w.name: ModelCalibration(w.profile).lengths for w in workloads}
        self.node_evidence = {w.name: NodeEvidence() for w in workloads}
        self._snapshots: dict[tuple, _Snapshot] = {}
        self._version, self._built_version = 0, 0
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
        snapshot = _Snapshot(node, key, step.decode_seqs, step.decode_context, step.prefill_tokens, self.clock(),
                             previous.recent if previous is not None and previous.shape == key else deque(maxlen=RECENT_STEPS))
        snapshot.recent.append((step_features(step), step.wall_s))
        self._snapshots[engine] = snapshot
        self._version += 1

    def _committed(self, node: str, results: tuple[EngineResult, ...]) -> None:
        model = self._model_of(node)
        if model is None:
            return
        n = self.by_node[node].requests_per_unit
        evidence = self.node_evidence[node]
        for result in results:
            if result.is_error:
                continue
            length, finished = round(result.num_output_tokens / n), result.finish_reason != FinishReason.LENGTH
            model.lengths.observe(length, finished, n)
            self.node_lengths[node].observe(length, finished, n)
            evidence.prompt_tokens += result.num_prompt_tokens
            evidence.units += 1
        self._version += 1

    # -- the calibrated cost model ------------------------------------------------------------
    def calibrated_problem(self) -> PlanProblem:
        """The planner's problem on the calibrated profiles and prompt sizes (rebuilt only
        when something was measured since the last one)."""
        if self._built_version == self._version:
            return self._calibrated
        self._built_version = self._version
        self._calibrated = build_problem(self.problem.cluster, [self.calibrated_workload(w.name) for w in self.workloads],
                                         self.problem.notes)
        return self._calibrated

    def calibrated_workload(self, node: str) -> NodeWorkload:
        item = self.by_node[node]
        model = self.models[item.profile.model]
        lengths = self.node_lengths[node]
        own = lengths.outputs > 0 or any(s.node == node for s in self._live_snapshots())
        posterior = lengths.posterior(self._running_ages(node)) if own else None
        profile = model.profile(posterior, self.machine_factors())
        workload = self._scaled_prompts(node)
        if posterior is not None and workload.output_lengths is not None:  # the run's own lengths, each request's shift kept
            shifts = self.spreads.get(node, 1.0) * workload.output_lengths.log_shift
            workload = replace(workload, output_lengths=RequestLengths(posterior, relative_shifts(shifts), "pilot"))
        return replace(item, profile=profile, workload=workload)

    def pilot_ended(self, node: str, answers: Sequence[tuple[LengthPrompt, int]] = ()) -> "PilotLearnt":
        """The node's pilot has every answer: a random sample of its own prompt set, all of it
        ended (no short-first bias), so from now on the prior (another prompt set's lengths)
        weighs as PILOT_PRIOR_OUTPUTS outputs, not as many as a run's first ones need.
        `answers`: the pilot's requests as the length model reads them, with their answers'
        lengths; where the node's length model spreads requests, how much of that spread
        holds on them scales it from now on."""
        lengths = self.node_lengths[node]
        self.node_lengths[node] = lengths = replace(lengths, prior_outputs=min(lengths.prior_outputs, PILOT_PRIOR_OUTPUTS), _last=None)
        for engine, snapshot in self._snapshots.items():  # an engine's last step counts the outputs that ended in it: none runs now
            if snapshot.node == node:
                self._snapshots[engine] = replace(snapshot, decode_seqs=0, decode_context=0)
        self._version += 1
        log_shift = self.log_shifts.get(node)
        if log_shift is not None and answers:
            prompts = [prompt for prompt, _ in answers]
            self.spreads[node] = fitted_spread(lengths.posterior(), log_shift(prompts), [length for _, length in answers],
                                               [p.max_tokens for p in prompts])
        max_tokens = int(np.max(self.by_node[node].workload.max_tokens, initial=1))

        def capped_mean(distribution) -> float:
            return float(RequestLengths.shared(distribution, 1, "pilot").expected(max_tokens)[0])

        return PilotLearnt(capped_mean(lengths.posterior()), capped_mean(lengths.prior), max_tokens, self.spreads.get(node))

    def output_forecast(self, node: str) -> CalibratedForecast:
        """The node's answer lengths as calibrated now, for the runtime's split and order."""
        lengths = self.node_lengths[node]
        return CalibratedForecast(node, lengths.posterior(self._running_ages(node)), self.log_shifts.get(node),
                              source="prior" if lengths.outputs == 0 else "pilot", spread=self.spreads.get(node, 1.0))

    def machine_factors(self) -> SpeedFactors | None:
        """Speed factors over every model measured: for a model no engine ran yet."""
        measured = [m.factors() for m in self.models.values()]
        steps, loads = sum(f.steps for f in measured), sum(f.loads for f in measured)
        if not steps and not loads:
            return None
        step = float(np.exp(sum(f.steps * np.log(f.step) for f in measured) / steps)) if steps else 1.0
        load = float(np.exp(sum(f.loads * np.log(f.load) for f in measured) / loads)) if loads else 1.0
        return SpeedFactors(step, load, steps, loads)

    def prompt_factor(self, node: str) -> float:
        """Measured prompt tokens over the planner's estimate, the estimate counting as
        PROMPT_PRIOR_UNITS prompts."""
        planned = float(np.mean(self.by_node[node].workload.prompt_tokens)) if len(self.by_node[node].workload) else 0.0
        evidence = self.node_evidence[node]
        if planned <= 0 or not evidence.units:
            return 1.0
        return (PROMPT_PRIOR_UNITS * planned + evidence.prompt_tokens) / (PROMPT_PRIOR_UNITS + evidence.units) / planned

    def _scaled_prompts(self, node: str) -> Workload:
        workload = self.by_node[node].workload
        factor = self.prompt_factor(node)
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
        item = self.by_node[node]
        snapshots = [s for s in self._live_snapshots() if s.node == node]
        left = (progress.total_units - progress.done_units) * item.requests_per_unit
        if not progress.total_known or not snapshots or any(s.prefill_tokens for s in snapshots) or \
                sum(s.decode_seqs for s in snapshots) < left or len(item.workload) == 0:
            return None
        model = self.models[item.profile.model]
        lengths = self.node_lengths[node].posterior(self._running_ages(node))
        prompt = self._mean_prompt_tokens(node)
        max_tokens = int(np.max(item.workload.max_tokens))
        tails = []
        for snapshot in snapshots:
            calibration = model.latency.get(snapshot.shape)
            latency = calibration.model() if calibration is not None and calibration.steps else \
                model.profile(fallback=self.machine_factors()).shapes[snapshot.shape].latency
            predicted = sum(latency.step_s(f) for f, _ in snapshot.recent)
            factor = sum(w for _, w in snapshot.recent) / predicted if predicted > 0 else 1.0
            age = max(0, round(snapshot.decode_context / snapshot.decode_seqs - prompt))
            tails.append(batch_left_s(latency, lengths, snapshot.decode_seqs, age, prompt, max_tokens, factor))
        return max(tails)

    def _mean_prompt_tokens(self, node: str) -> float:
        evidence = self.node_evidence[node]
        if evidence.units:
            return evidence.prompt_tokens / evidence.units
        return float(np.mean(self._scaled_prompts(node).prompt_tokens)) if len(self.by_node[node].workload) else 0.0

    def _live_snapshots(self) -> list[_Snapshot]:
        now = self.clock()
        return [s for s in self._snapshots.values() if now - s.at_s <= SNAPSHOT_MAX_AGE_S and s.decode_seqs > 0]

    def _running_ages(self, node: str) -> list[tuple[int, float]]:
        """(tokens so far, sequences) of the node's outputs being generated now."""
        prompt = self._mean_prompt_tokens(node)
        return [(max(1, round(s.decode_context / s.decode_seqs - prompt)), float(s.decode_seqs))
                for s in self._live_snapshots() if s.node == node]

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
            calibrated = model.profile_to_keep(fallback=self.machine_factors())
            unmeasured = [k for k in calibrated.shapes if k not in evidence.shapes_measured]
            learnt = replace(calibrated, kind="learnt", hardware=cluster.identity.folder_name, identity=cluster.identity,
                             engine={**calibrated.engine, **{k: v for k, v in self.settings.items() if k in ("dtype", "enforce_eager")}},
                             notes={"prior": f"{model.prior.kind} {model.prior.hardware}/{model.prior.model}",
                                    "shapes_measured": list(evidence.shapes_measured),
                                    ("shapes_kept" if model.prior.kind == "learnt" else "shapes_rescaled"): unmeasured})
            folder = self.store.save(learnt, cluster.identity, self.settings, source=self.source,
                                     evidence={"steps": evidence.steps, "outputs": evidence.outputs, "loads": evidence.loads,
                                               "shapes_measured": list(evidence.shapes_measured)})
            lines.append(f"learnt profile of {name} saved: {folder} ({evidence.steps:,} steps, {evidence.outputs:,.0f} outputs)")
        return lines
