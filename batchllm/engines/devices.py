"""Devices an engine replica runs on: GPUs on a GPU machine, CPU cores elsewhere.

Everything above this module speaks of devices by index; only here do they become
environment variables (`CUDA_VISIBLE_DEVICES`, or vLLM's CPU thread binding).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.engines.hardware import cpu_engine_dtype, name_slug, this_machine

# On CPUs vLLM would otherwise size the KV cache as a share of all RAM; 1 GiB holds
# about 44,000 tokens of the embedded model in bfloat16 (half that in float32).
CPU_KV_CACHE_DEFAULT_BYTES = 1 << 30
_SPEC = re.compile(r"(cpu|gpu):(\d+)\Z|(cpu|gpu):(\d+(?:,\d+)+)\Z")


@dataclass(frozen=True)
class NodeDevices:
    """One cluster node's devices: its id and its own device numbers (cores or GPUs)."""

    node: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class DeviceSet:
    """Devices by index. On one machine `ids` are its device numbers; on a cluster
    (`nodes` given) they are labels 0..N-1 over the nodes' devices, node after node, and
    keep their labels when a node is lost."""

    kind: str  # "cpu" (cores) or "gpu"
    ids: tuple[int, ...]
    nodes: tuple[NodeDevices, ...] = ()

    def __str__(self) -> str:
        if self.nodes:
            return f"{self.kind}:{len(self.ids)} on {len(self.nodes)} nodes"
        return f"{self.kind}:{','.join(map(str, self.ids))}"

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """Devices per node (one machine: one node of all its devices)."""
        return tuple(len(n.ids) for n in self.nodes) if self.nodes else (len(self.ids),)

    def replica(self, indices: tuple[int, ...], tp: int) -> Replica:
        """The replica on these device indices; on a cluster they must share one node."""
        if not self.nodes:
            return Replica(self.kind, tuple(self.ids[i] for i in indices), tp)  # indices are positions in `ids`
        where = [self._locate(i) for i in indices]
        nodes = {node for node, _ in where}
        if len(nodes) != 1:
            raise ValueError(f"replica on device indices {indices} spans nodes {sorted(nodes)}: a replica stays inside one node")
        return Replica(self.kind, tuple(local for _, local in where), tp, node=where[0][0])

    def _locate(self, index: int) -> tuple[str, int]:
        for node in self.nodes:
            if index < len(node.ids):
                return node.node, node.ids[index]
            index -= len(node.ids)
        raise ValueError(f"device index {index} is beyond the cluster's {len(self.ids)} devices")

    def without_nodes(self, lost: set[str]) -> DeviceSet:
        """The cluster's devices once the `lost` nodes are gone (the others keep their labels)."""
        ids: list[int]
        kept, ids, position = [], [], 0
        for node in self.nodes:
            if node.node not in lost:
                kept.append(node)
                ids.extend(self.ids[position:position + len(node.ids)])
            position += len(node.ids)
        return DeviceSet(self.kind, tuple(ids), tuple(kept))


@dataclass(frozen=True)
class Replica:
    """One engine replica: its devices, split into `tp` tensor-parallel ranks; on a
    cluster also its node (the device numbers are that node's own)."""

    kind: str
    device_ids: tuple[int, ...]
    tp: int = 1
    node: str | None = None

    def environment(self) -> dict[str, str]:
        if self.kind == "gpu":
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.device_ids))}
        per_rank = len(self.device_ids) // self.tp
        ranks = [self.device_ids[i * per_rank:(i + 1) * per_rank] for i in range(self.tp)]
        # Without OMP_NUM_THREADS the OpenMP runtime adds a thread per machine core outside
        # the binding: measured, a one-core replica then spins on the other cores too, and
        # two replicas on cores 0 and 1 slowed each other down 4.7x (1.06x with it set).
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(_core_list(r) for r in ranks), "OMP_NUM_THREADS": str(per_rank)}


def _core_list(cores: tuple[int, ...]) -> str:
    if list(cores) == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def parse_devices(text: str) -> DeviceSet:
    """`auto`, `cpu:N` / `gpu:N` (the first N), or explicit ids like `cpu:0,1`."""
    if text == "auto":
        gpus = _visible_gpu_count()
        return DeviceSet("gpu", tuple(range(gpus))) if gpus else DeviceSet("cpu", tuple(range(os.cpu_count() or 1)))
    match = _SPEC.match(text)
    if not match:
        raise UserError(f"bad device spec {text!r}", where="--devices", hint="use auto, cpu:N, gpu:N, or explicit ids such as cpu:0,1")
    kind = match.group(1) or match.group(3)
    if match.group(2):
        count = int(match.group(2))
        if count < 1:
            raise UserError(f"bad device spec {text!r}: at least one device is needed", where="--devices")
        ids = tuple(range(count))
    else:
        ids = tuple(int(i) for i in match.group(4).split(","))
        if len(set(ids)) != len(ids):
            raise UserError(f"bad device spec {text!r}: a device is listed twice", where="--devices")
    available = (os.cpu_count() or 1) if kind == "cpu" else _visible_gpu_count()
    if max(ids) >= available:
        raise UserError(f"device spec {text!r} asks for {kind} {max(ids)}, but this machine has {available} {kind}s",
                        where="--devices", hint=f"use at most {kind}:{available}" if available else "use cpu:N")
    return DeviceSet(kind, ids)


def _visible_gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def hardware_name(kind: str) -> str:
    """A stable name for this machine's kind of device, used to file profiles:
    `cpu-intel-xeon` from /proc/cpuinfo, `gpu-nvidia-a100-sxm4-80gb` from nvidia-smi."""
    name = platform.processor() or platform.machine()
    if kind == "gpu":
        try:
            listing = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout.splitlines()
            name = listing[0] if listing else "unknown"
        except (OSError, subprocess.SubprocessError):
            name = "unknown"
    else:
        try:
            name = next(line.split(":", 1)[1] for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return f"{kind}-{name_slug(name)}"


def engine_dtype(kind: str) -> str | None:
    """The weights' dtype an engine should use on this machine's devices; None keeps the
    model's own. CPUs without bfloat16 arithmetic (avx512_bf16 or AMX) run float32 faster
    (hardware.cpu_engine_dtype has the measurements)."""
    return cpu_engine_dtype(this_machine("cpu").cpu_flags) if kind == "cpu" else None


def engine_dtype_reason(kind: str) -> str:
    """Why `engine_dtype(kind)` is what it is, naming the host's fact, for messages."""
    if engine_dtype(kind) == "float32":
        return "this CPU has no bfloat16 arithmetic (avx512_bf16 or AMX), so float32 runs faster"
    return "the model's own dtype"


def whole_set_replica(devices: DeviceSet) -> Replica:
    """One replica on all devices: threads over all cores, or tensor parallel over all GPUs."""
    return Replica(devices.kind, devices.ids, tp=len(devices.ids) if devices.kind == "gpu" else 1)
