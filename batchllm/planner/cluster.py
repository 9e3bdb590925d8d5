"""The devices a plan is made for, the execution plans a model may take on them, and
where each plan's replicas go.

A planning device spec names hardware, not this machine's devices: `8xA100-80G`,
`2xH100-80G` (hardware from profiles/analytic/catalog.yaml or a measured profile
folder), `cpu:2` (two cores of this machine's CPU kind), and a cluster of such nodes:
`2x8xA100-80G` (two nodes of eight). Placement keeps tensor-parallel groups inside the
hardware's NVLink groups: a replica of w devices starts at a multiple of w within its
node, so a tp2 group is always one NVLink pair on an 8xA100 node, and no replica spans
two nodes.

A cluster carries the identity of its hardware (this machine's for `cpu:N` and for a run,
the catalog's for a named GPU): the profile picked for a model is compared with it and
with the run's engine settings, and every difference becomes a plan note. A profile that
differs is still used; it is never used without saying so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchllm.core.errors import UserError
from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.costmodel.profile import Profile, ReplicaShape, find_profile
from batchllm.dag.model import EngineSpec
from batchllm.engines.hardware import MODEL_DTYPE, HardwareIdentity, differences, same_gpu, this_machine
from batchllm.engines.version import installed_engine_version

_GPU_SPEC = re.compile(r"(?:(\d+)x)?(\d+)x([A-Za-z0-9][\w.-]*)\Z")  # [nodes x] GPUs per node x hardware
_CPU_SPEC = re.compile(r"cpu:(\d+)\Z")


@dataclass(frozen=True)
class Cluster:
    kind: str  # "gpu" or "cpu"
    hardware: str  # profile folder name: A100-80G, cpu-intel-xeon, ...
    devices: int
    nvlink_group: int = 1  # GPUs per NVLink group (1 on CPUs: no tensor parallelism across cores)
    identity: HardwareIdentity | None = None  # what a profile is compared with; None: not known
    local: bool = False  # this machine's devices (the installed engine is the one that will run)
    node_sizes: tuple[int, ...] = ()  # devices per node, in index order; (): one node of all `devices`

    def __post_init__(self) -> None:
        if self.node_sizes and sum(self.node_sizes) != self.devices:
            raise ValueError(f"node sizes {self.node_sizes} do not add up to {self.devices} devices")

    @property
    def nodes(self) -> tuple[int, ...]:
        return self.node_sizes or (self.devices,)

    def __str__(self) -> str:
        if len(self.nodes) > 1 and len(set(self.nodes)) == 1:
            per_node = f"{len(self.nodes)}x{self.nodes[0]}x{self.hardware}" if self.kind == "gpu" else \
                f"{len(self.nodes)} nodes x cpu:{self.nodes[0]} ({self.hardware})"
            return per_node
        if len(self.nodes) > 1:
            return f"{self.kind}:{'+'.join(map(str, self.nodes))} ({self.hardware})"
        return f"{self.devices}x{self.hardware}" if self.kind == "gpu" else f"cpu:{self.devices} ({self.hardware})"


def parse_cluster(text: str, profiles_root: Path) -> Cluster:
    """`8xA100-80G`, `2x8xA100-80G` (nodes x GPUs per node) or `cpu:N`; unknown hardware
    is an error that lists the known kinds."""
    where = "--devices"
    if match := _CPU_SPEC.match(text):
        count = int(match.group(1))
        if count < 1:
            raise UserError(f"bad device spec {text!r}: at least one core is needed", where=where)
        return local_cluster("cpu", count)
    match = _GPU_SPEC.match(text)
    if not match:
        raise UserError(f"bad device spec {text!r}", where=where,
                        hint="use <count>x<GPU> such as 8xA100-80G, <nodes>x<count>x<GPU> such as 2x8xA100-80G, "
                             "or cpu:N for N CPU cores")
    nodes, count, hardware = int(match.group(1) or 1), int(match.group(2)), match.group(3)
    known = _catalog_hardware(profiles_root)
    if hardware not in known and not (profiles_root / hardware).is_dir():
        raise UserError(f"unknown GPU {hardware!r} in device spec {text!r}", where=where,
                        hint=f"known GPUs: {', '.join(sorted(known))}; or profile yours with `batchllm profile`")
    if not 1 <= count <= 64:
        raise UserError(f"bad device spec {text!r}: {count} GPUs; a node has 1 to 64", where=where)
    if not 1 <= nodes <= 64:
        raise UserError(f"bad device spec {text!r}: {nodes} nodes; plan for 1 to 64", where=where)
    spec = known.get(hardware)
    identity = HardwareIdentity("gpu", hardware, MODEL_DTYPE, gpu_memory_mib=int(spec["memory_gb"] * 1024),
                                gpu_count=count) if spec and "memory_gb" in spec else None
    return Cluster("gpu", hardware, nodes * count, int((spec or {}).get("nvlink_group", 1)), identity,
                   node_sizes=(count,) * nodes if nodes > 1 else ())


def local_cluster(kind: str, count: int, node_sizes: tuple[int, ...] = ()) -> Cluster:
    """This machine's devices as a planning cluster (profiles filed under its hardware name);
    `node_sizes` for a run on a cluster of nodes of this machine's kind."""
    identity = this_machine(kind)
    return Cluster(kind, identity.folder_name, count, identity=identity, local=True,
                   node_sizes=node_sizes if len(node_sizes) > 1 else ())


def cluster_notes(cluster: Cluster) -> tuple[str, ...]:
    """What a plan for several nodes assumes and does not charge for (one plan note)."""
    if len(cluster.nodes) < 2:
        return ()
    return (f"{len(cluster.nodes)} nodes ({'+'.join(map(str, cluster.nodes))} devices): every replica and its tensor-parallel "
            "group stays inside one node; the estimate charges nothing for what it cannot know: moving prompts and "
            "results between the driver and the nodes, loading weights on each node (taken as fast as on one machine), "
            "nodes that differ from the profile's, or a node lost mid-run",)


def run_settings(engine: EngineSpec, cluster: Cluster) -> dict[str, object]:
    """The engine settings (of MATCHED_SETTINGS) a run on the cluster is known to use before
    any engine starts: the DAG's, the device defaults, and on this machine the installed
    vLLM. Batch token budget and block size are the engine's choice, known once it runs."""
    settings: dict[str, object] = {"enforce_eager": cluster.kind == "cpu" if engine.enforce_eager is None else engine.enforce_eager}
    if engine.max_num_seqs is not None:
        settings["max_num_seqs"] = engine.max_num_seqs
    if cluster.identity is not None and cluster.identity.dtype is not None:
        settings["dtype"] = cluster.identity.dtype
    if cluster.local and (version := installed_engine_version()):
        settings["engine_version"] = version
    return settings


def _catalog_hardware(profiles_root: Path) -> dict[str, dict]:
    path = profiles_root / "analytic" / "catalog.yaml"
    return yaml.safe_load(path.read_text())["hardware"] if path.is_file() else {}


def cluster_profile(cluster: Cluster, model: str, profiles_root: Path,
                    settings: dict[str, object] | None = None) -> tuple[Profile, tuple[str, ...]]:
    """The profile of `model` on the cluster's hardware (on CPUs, when this kind has none, the
    profile of the CPU kind closest to it: one from a sibling machine beats none), and one
    note per difference from the cluster's hardware and the run's engine `settings`."""
    try:
        profile = find_profile(profiles_root, cluster.hardware, model)
    except UserError:
        if cluster.kind != "cpu":
            return _catalog_gpu_profile(cluster, model, profiles_root, settings or {})
        profile = _closest_cpu_profile(cluster, model, profiles_root)
    return profile, mismatch_notes(profile, cluster, settings or {})


def catalog_gpu(identity: HardwareIdentity | None, profiles_root: Path) -> str | None:
    """The catalog's name for this machine's GPU (`NVIDIA A100-SXM4-80GB`, 81920 MiB ->
    `A100-80G`): same model name, memory within 10 %."""
    if identity is None or identity.kind != "gpu" or identity.name is None:
        return None
    for name, spec in _catalog_hardware(profiles_root).items():
        memory_mib = float(spec.get("memory_gb", 0)) * 1024
        if same_gpu(name, identity.name) and (identity.gpu_memory_mib is None or abs(identity.gpu_memory_mib - memory_mib) <= 0.1 * memory_mib):
            return name
    return None


def _catalog_gpu_profile(cluster: Cluster, model: str, profiles_root: Path,
                         settings: dict[str, object]) -> tuple[Profile, tuple[str, ...]]:
    """A GPU with no measured profile of its own is planned on its analytic profile, which
    the run then calibrates (say so in the notes)."""
    name = catalog_gpu(cluster.identity, profiles_root)
    if name is None:
        raise UserError(f"no profile for model {model!r} on {cluster.hardware!r}, and {cluster.identity.describe() if cluster.identity else 'this GPU'} "
                        f"is not in {str(profiles_root / 'analytic' / 'catalog.yaml')!r}",
                        hint="run `batchllm profile` on this machine, or add the GPU to the catalog")
    profile = find_profile(profiles_root, name, model)
    note = f"prior for {model}: {profile.kind} profile {name}/{model}" + (
        " (roofline, not measured), calibrated by the run's own steps" if profile.kind == "analytic" else "")
    return profile, (note, *mismatch_notes(profile, cluster, settings))


def mismatch_notes(profile: Profile, cluster: Cluster, settings: dict[str, object]) -> tuple[str, ...]:
    """`profile cpu-amd-epyc/smollm2-135m does not match: <difference>`, one per difference."""
    here_label = "this machine" if cluster.local else "planned hardware"
    return tuple(f"profile {profile.hardware}/{profile.model} does not match: {line}"
                 for line in profile.mismatches(cluster.identity, settings, here_label=here_label))


def _closest_cpu_profile(cluster: Cluster, model: str, profiles_root: Path) -> Profile:
    siblings = [Profile.load(p.parent) for p in sorted(profiles_root.glob(f"cpu-*/{model}/profile.json"))]
    if not siblings:
        raise UserError(f"no profile for model {model!r} on {cluster.hardware!r} or any other CPU under {str(profiles_root)!r}",
                        hint="run `batchllm profile --model <model>` on this machine")
    here = cluster.identity
    if here is None:
        return siblings[0]
    return min(siblings, key=lambda p: len(differences(p.identity, here)))  # ties: the first by folder name


def candidate_plans(profile: Profile, cluster: Cluster) -> list[ExecutionPlan]:
    """Every (dp, replica shape) that fits on the cluster: the profile holds only valid
    shapes (heads divisible by tp, weights plus one sequence's KV cache fit), and a
    replica fits inside one node."""
    plans = []
    for key in profile.shapes:
        shape = ReplicaShape.parse(key)
        fitting = sum(size // shape.devices for size in cluster.nodes)
        for dp in range(1, fitting + 1):
            plans.append(ExecutionPlan(dp, shape))
    return sorted(plans, key=lambda p: (p.devices, p.shape.devices))


Placement = dict[str, tuple[int, ...]]  # node -> device ids, in replica order


def place(blocks: dict[str, tuple[int, int]], kept: Placement, devices: int,
          node_sizes: tuple[int, ...] = ()) -> Placement | None:
    """Device ids for each node's replicas, or None when they do not fit.

    `blocks` maps a node to (replicas, devices per replica); the replicas in `kept` (a
    node's running replicas it keeps or takes over) stay where they are. The others are
    packed largest first, each at the lowest free offset that is a multiple of its size
    within a cluster node (buddy-style alignment keeps tp groups inside NVLink groups,
    and no replica spans two of `node_sizes`; () is one node of all `devices`).
    """
    starts, offsets = 0, {}
    for size_of_node in node_sizes or (devices,):
        offsets[starts] = size_of_node
        starts += size_of_node
    free = [True] * devices
    placement: dict[str, list[int]] = {}
    for node, kept_ids in kept.items():
        if node in blocks:
            for device in kept_ids:
                free[device] = False
            placement[node] = list(kept_ids)
    for node in sorted(blocks, key=lambda n: -blocks[n][1]):
        replicas, size = blocks[node]
        ids = placement.setdefault(node, [])
        while len(ids) < replicas * size:
            offset = next((o for base, width in offsets.items() for o in range(base, base + width - size + 1, size)
                           if all(free[o:o + size])), None)
            if offset is None:
                return None
            free[offset:offset + size] = [False] * size
            ids.extend(range(offset, offset + size))
    return {node: tuple(ids) for node, ids in placement.items()}
