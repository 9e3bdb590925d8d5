"""`<out>/run.json`: what was planned and what happened, stage by stage.

Per stage: the plan it ran (per node: execution plan, devices), when it started and
ended, the planner's estimate of its length and of the rest of the run when it began,
requests and tokens per node, engine starts, and per engine replica its busy time
(start + steps). Orchestration overhead of a stage is its wall time minus the busiest
replica's busy time: time no engine of the stage was loading or stepping for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchllm.core.files import write_text_atomically
from batchllm.engines.protocol import EngineConfig
from batchllm.planner.schedule import Schedule


def engine_label(config: EngineConfig) -> str:
    return f"{Path(config.model).name}@{config.replica.kind}:{','.join(map(str, config.replica.device_ids))}"


@dataclass
class NodeInStage:
    plan: str
    devices: list[int]
    units_before: int
    units_after: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_start_s: float = 0.0  # longest start among the replicas it started


@dataclass
class StageLog:
    index: int
    start_s: float
    estimated_s: float | None  # the planner's length of this stage when it began (None: no cost model, e.g. sequential)
    estimated_rest_s: float | None  # the planner's time to the end of the run when it began (None: likewise)
    planning_s: float
    end_s: float = 0.0
    nodes: dict[str, NodeInStage] = field(default_factory=dict)
    engine_busy_s: dict[str, float] = field(default_factory=dict)  # replica -> start + steps in this stage

    def add_node(self, name: str, plan: str, devices: list[int], units_before: int) -> None:
        self.nodes[name] = NodeInStage(plan, devices, units_before, units_before)

    def add_start(self, node: str | None, engine: str, load_time_s: float) -> None:
        self.engine_busy_s[engine] = self.engine_busy_s.get(engine, 0.0) + load_time_s
        if node in self.nodes:
            self.nodes[node].engine_start_s = max(self.nodes[node].engine_start_s, load_time_s)

    def add_step(self, engine: str, wall_s: float) -> None:
        self.engine_busy_s[engine] = self.engine_busy_s.get(engine, 0.0) + wall_s

    def add_tokens(self, node: str, prompt_tokens: int, output_tokens: int) -> None:
        if node in self.nodes:
            self.nodes[node].prompt_tokens += prompt_tokens
            self.nodes[node].output_tokens += output_tokens

    def end(self, end_s: float, units_after: dict[str, int]) -> None:
        self.end_s = end_s
        for name, units in units_after.items():
            self.nodes[name].units_after = units

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.duration_s - max(self.engine_busy_s.values(), default=0.0))


@dataclass(frozen=True)
class CommandStart:
    """A CLI command's start before its stage loop, by part: its process's start to the run
    (Python, batchllm's imports, the DAG read), the checks of the DAG, its data, models and
    engine settings (of which vLLM's settings check, 0 when its verdict was kept), and planning.
    The rest of `RunReport.command_start_s` is opening the run folder."""

    imports_s: float
    checks_s: float
    settings_check_s: float
    planning_s: float

    def text(self, total_s: float) -> str:
        """`imports 8.1 s, checks 3.2 s (vLLM 2.5 s), planning 6.0 s, rest 0.4 s`: vLLM's settings check, or
        `vLLM kept` where its verdict was kept (fits 80 columns indented, even after 1,000 s of imports)."""
        rest_s = max(0.0, total_s - self.imports_s - self.checks_s - self.planning_s)
        vllm = f"vLLM {self.settings_check_s:.1f} s" if self.settings_check_s >= 0.05 else "vLLM kept"
        return f"imports {self.imports_s:.1f} s, checks {self.checks_s:.1f} s ({vllm}), planning {self.planning_s:.1f} s, rest {rest_s:.1f} s"


@dataclass
class RunReport:
    dag: str
    devices: str
    method: str
    stages: list[StageLog] = field(default_factory=list)
    wall_s: float = 0.0
    planned: list[dict] = field(default_factory=list)  # the plan made at the start: start_s, end_s, nodes {name: {plan, devices, start_s}}
    models: dict[str, str] = field(default_factory=dict)  # node -> model
    first_request_s: float | None = None  # from the first stage's engines being ready to the first request sent
    failed: dict[str, str] = field(default_factory=dict)  # node -> why it stopped with work left: run.json's, given at `finish`
    outputs: dict[str, dict] = field(default_factory=dict)  # data set -> {path, complete}: complete false after a failed node
    command_start_s: float | None = None  # the CLI command's own start: from its process's start to the stage loop
    start: CommandStart | None = None  # what that start was spent on (a CLI command's)

    def plan_made(self, schedule: Schedule, device_ids: tuple[int, ...]) -> None:
        """Keep the first plan of the run, to compare with what happened."""
        if self.planned:
            return
        for stage in schedule.stages:
            self.planned.append({"start_s": stage.start_s, "end_s": stage.end_s, "nodes": {
                name: {"plan": str(plan), "devices": [device_ids[i] for i in stage.placement[name]],
                       "engine_start_s": stage.start_costs_s[name]} for name, plan in stage.plans.items()}})

    def finish(self, wall_s: float, failed: dict[str, str]) -> None:
        """The stage loop ended after `wall_s`; `failed`: why each failed node stopped (`NodeRuns.failures`)."""
        self.wall_s, self.failed = wall_s, dict(failed)

    @property
    def estimated_s(self) -> float | None:
        """The planner's estimate of the whole run, made before it started."""
        return self.stages[0].estimated_rest_s if self.stages else None

    @property
    def overhead_s(self) -> float:
        """Wall time outside every engine's starts and steps, planning included."""
        inside = sum(s.duration_s - s.overhead_s for s in self.stages)
        return max(0.0, self.wall_s - inside)

    @property
    def planning_s(self) -> float:
        return sum(s.planning_s for s in self.stages)

    def to_dict(self) -> dict:
        stages = []
        for stage in self.stages:
            item = asdict(stage)
            item.update(duration_s=stage.duration_s, overhead_s=stage.overhead_s)
            stages.append(item)
        return {"dag": self.dag, "devices": self.devices, "schedule": self.method, "wall_s": self.wall_s,
                "estimated_s": self.estimated_s, "planning_s": self.planning_s, "overhead_s": self.overhead_s,
                "overhead_share": self.overhead_s / self.wall_s if self.wall_s else 0.0,
                **({"command_start_s": self.command_start_s} if self.command_start_s is not None else {}),
                **({"command_start_parts": asdict(self.start)} if self.start is not None else {}), "models": self.models,
                "first_request_s": self.first_request_s,
                "stages": stages, "planned": self.planned, "failed": self.failed,
                "outputs": self.outputs}

    def write(self, path: Path) -> None:
        """Atomically: a crash leaves the previous report or the new one, never half."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")


@dataclass(frozen=True)
class RunResult:
    """What a run returns: its report, the files written, what failed."""

    engines_started: int
    nodes_failed: dict[str, str]  # node -> cause
    outputs: dict[str, Path]
    report: RunReport
    rest_estimate_s: float | None = None  # after pilots only: the rest of the run, planned on what they measured
    model_loads: int = 0  # engines started on devices (each loads its model); nodes sharing one load it once

    @property
    def first_request_s(self) -> float | None:
        """From the first stage's engines being ready to the first request sent."""
        return self.report.first_request_s
