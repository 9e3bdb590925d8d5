"""What a run is asked to do (`RunSpec`, checked once, when it is built) and what the checks of
its DAG found before anything runs (`RunInputs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchllm.core.endpoint import Endpoint
from batchllm.core.errors import UserError
from batchllm.dag.model import DagSpec
from batchllm.engines.devices import DeviceSet
from batchllm.io.input_source import InputSource
from batchllm.models.registry import batchllm_home
from batchllm.planner.plan_file import PROFILES_ROOT
from batchllm.runtime.pilot import PilotSize
from batchllm.runtime.request_keys import NodeKeys
from batchllm.runtime.stage_planner import SCHEDULE_METHODS

SCHEDULES = (*SCHEDULE_METHODS, "sequential")
COMMANDS = ("run", "plan --pilot")  # the CLI commands whose own start and end a run measures


@dataclass(frozen=True)
class RunSpec:
    """Where a run writes, on which devices, and how.

    `fresh`: start over in `out` (else resume what it holds). `schedule`: `plan` (batchllm's
    stages, re-planned at every stage boundary), `max` or `min` (the heuristics, for
    comparison), or `sequential` (node by node, one engine on all devices; also what `plan`
    falls back to when a model has no profile here). `prefix_order`: order each window for the
    prefix cache. `pilot`: how large a new prompt set's pilot is (None: no pilots);
    `pilots_only`: run only the pilots (into `out`, where a later run finds them committed)
    and estimate the rest on them. `home`: batchllm's state (models, the local profile and
    length stores); `profiles_root`: the shipped profiles. `command`: the CLI command this
    process is (its own start and end are measured and kept for this machine; None: the
    Python API, where the process is the caller's). `store`: the result store (a SQLite file)
    that requests are answered from when it holds their key, and that what the engines compute
    is filed in (None: every request is computed, and nothing is filed)."""

    out: Path
    devices: DeviceSet
    fresh: bool = False
    schedule: str = "plan"
    prefix_order: bool = True
    pilot: PilotSize | None = PilotSize()
    pilots_only: bool = False
    home: Path = field(default_factory=batchllm_home)
    profiles_root: Path = PROFILES_ROOT
    command: str | None = None
    store: Path | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise UserError(f"unknown schedule {self.schedule!r}", where="--schedule", hint=f"use one of {', '.join(SCHEDULES)}")
        if self.command is not None and self.command not in COMMANDS:
            raise ValueError(f"command must be one of {COMMANDS} or None, got {self.command!r}")
        if self.pilots_only and self.pilot is None:
            raise ValueError("pilots_only needs a pilot size, got pilot=None")
        if not self.devices.ids:
            raise UserError(f"a run needs at least one device, got {self.devices}", where="--devices",
                            hint="name the devices, e.g. cpu:2 or cuda:0,1, or leave the default (auto)")

    @property
    def planned(self) -> bool:
        """Stages chosen on a cost model (else node by node)."""
        return self.schedule != "sequential"


@dataclass(frozen=True)
class RunInputs:
    """What the checks before a run found: the DAG, each node's input, each served model's
    servers (checked to answer and to serve it), and the prompt sets the local store has seen
    answered (their nodes need no pilot)."""

    dag: DagSpec
    sources: dict[str, InputSource]
    endpoints: dict[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    known_prompt_sets: frozenset[str] = frozenset()
    vector_dimensions: dict[str, int] = field(default_factory=dict)  # each embed node's vector size
    store_keys: dict[str, NodeKeys] = field(default_factory=dict)  # each node's keys in the result store (none: not reused)
