"""Engines as Ray actors: one actor per replica, its devices reserved by a placement group
on the replica's node, the same worker loop inside as in a local worker process.

The actor runs `worker.worker_main` (stepper, serve loop, step records) in one thread of
its own, so vLLM loads, binds its threads to the replica's cores and steps in the same
thread, fed through in-process queues; the actor's methods only move messages. The
driver keeps one `take` call outstanding per engine (a long poll), so results arrive as
soon as the worker sends them and `poll` never blocks on the network longer than asked.

Devices: a CPU replica's bundle holds its cores as `CPU` plus the node's `core<N>`
resources when the node advertises them (several nodes on one machine: each owns its
cores); a GPU replica's bundle holds `GPU`, and inside the actor its device numbers are
the GPUs Ray assigned. A label selector on `ray.io/node-id` keeps the bundle on the node
the planner chose; `STRICT_PACK` keeps all of a replica on that node.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from pathlib import Path
from typing import cast

from batchllm.engines.engine import EngineFailed, StepperFactory
from batchllm.engines.process_engine import WorkerEngine, _VllmStepperFactory
from batchllm.engines.protocol import (
    DriverMessage,
    EngineConfig,
    StopWorker,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    exception_cause,
)
from batchllm.engines.worker import worker_main

TAKE_WAIT_S = 1.0  # an outstanding take returns after this long with nothing to say
PLACEMENT_TIMEOUT_S = 120.0  # devices not reserved by then: the node is gone or busy


class EngineActor:
    """Inside the actor: the worker loop in its own thread, queues to the driver's calls."""

    def __init__(self, config: EngineConfig, stepper_factory: StepperFactory):
        import ray

        if config.replica.kind == "gpu":  # Ray chose the GPUs inside the node; bind to those
            gpus = tuple(int(g) for g in ray.get_gpu_ids())
            config = dataclasses.replace(config, replica=dataclasses.replace(config.replica, device_ids=gpus))
        if config.log_path and not Path(config.log_path).parent.is_dir():  # another machine than the driver's
            config = dataclasses.replace(config, log_path=None)
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=worker_main, args=(config, self._inbox, self._outbox, stepper_factory),
                                        name="batchllm-engine", daemon=True)
        self._thread.start()

    def send(self, message: DriverMessage) -> None:
        self._inbox.put(message)

    def take(self, wait_s: float) -> list[WorkerMessage]:
        """Messages from the worker: waits up to `wait_s` for the first, then takes all there are."""
        messages: list[WorkerMessage] = []
        try:
            messages.append(self._outbox.get(timeout=wait_s))
            while True:
                messages.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        if not messages and not self._thread.is_alive():
            messages.append(WorkerFailed("the engine thread ended without a word"))
        return messages

    def stop(self, timeout_s: float) -> None:
        self._inbox.put(StopWorker())
        self._thread.join(timeout=timeout_s)


def replica_bundle(config: EngineConfig, node_resources: dict[str, float]) -> dict[str, float]:
    """What the replica reserves on its node: its cores (and their `core<N>` resources when
    the node has them), or its GPUs and one CPU for the driver loop."""
    replica = config.replica
    if replica.kind == "gpu":
        return {"GPU": float(len(replica.device_ids)), "CPU": 1.0}
    bundle = {"CPU": float(len(replica.device_ids))}
    bundle.update({f"core{c}": 1.0 for c in replica.device_ids if f"core{c}" in node_resources})
    return bundle


class RayEngine(WorkerEngine):
    def __init__(self, config: EngineConfig, stepper_factory: StepperFactory, start_timeout_s: float = 1800.0):
        import ray
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config, start_timeout_s)
        node = config.replica.node
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        if node not in alive:
            raise EngineFailed(f"engine for {config.model} on node {node!r}", f"the node is not in the cluster (alive: {sorted(alive)})")
        assert node is not None  # None is never a node id of `alive`: raised above
        bundle = replica_bundle(config, alive[node]["Resources"])
        self._group = placement_group([bundle], strategy="STRICT_PACK", bundle_label_selector=[{"ray.io/node-id": node}],
                                      name=f"batchllm-{Path(config.model).name}-{node[:8]}-{config.replica.device_ids}")
        self._placed = self._group.ready()
        actor_class = ray.remote(EngineActor)
        self._actor = actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, 0),
            runtime_env={"env_vars": config.replica.environment() if config.replica.kind == "cpu" else {}},
            max_concurrency=4, max_restarts=0, name=None,
        ).remote(config, stepper_factory)
        self._buffer: collections.deque[WorkerMessage] = collections.deque()
        self._pending = self._actor.take.remote(TAKE_WAIT_S)

    @property
    def node(self) -> str:
        return cast(str, self.config.replica.node)  # a Ray engine's replica always names its node (checked in __init__)

    def _wait_ready(self, timeout_s: float) -> WorkerReady:
        import ray

        placed, _ = ray.wait([self._placed], timeout=min(timeout_s, PLACEMENT_TIMEOUT_S))
        if not placed:
            self._kill()
            raise EngineFailed(f"engine for {self.config.model} on node {self.node!r}",
                               f"devices {self.config.replica.device_ids} could not be reserved within {PLACEMENT_TIMEOUT_S:.0f} s "
                               "(node lost, or its devices taken)")
        return super()._wait_ready(timeout_s)

    def _send(self, message: DriverMessage) -> None:
        self._actor.send.remote(message)

    def _next_message(self, timeout_s: float) -> WorkerMessage | None:
        import ray
        from ray.exceptions import RayError

        deadline = time.monotonic() + timeout_s
        while not self._buffer:
            done, _ = ray.wait([self._pending], timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                return None
            try:
                self._buffer.extend(ray.get(self._pending))
            except RayError as error:
                raise self._failure(f"actor on node {self.node!r} lost", exception_cause(error)) from None
            self._pending = self._actor.take.remote(TAKE_WAIT_S)
        return self._buffer.popleft()

    def _kill(self) -> None:
        import ray
        from ray.util import remove_placement_group

        ray.kill(self._actor, no_restart=True)
        remove_placement_group(self._group)

    def stop(self) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            ray.get(self._actor.stop.remote(30.0), timeout=40.0)
        except (RayError, TimeoutError):
            pass  # lost already, or stuck: killed below either way
        self._kill()


def start_ray_engine(config: EngineConfig) -> RayEngine:
    """The real vLLM engine in a Ray actor on the replica's node (ray.init done by the caller)."""
    from batchllm.engines.vllm_stepper import VllmStepper, configure_environment

    return RayEngine(config, _VllmStepperFactory(configure_environment, VllmStepper))
