"""The driver's connection to a Ray cluster: which cluster (`--cluster`, RAY_ADDRESS), its
nodes' devices as a DeviceSet of (node, device), and which of them are still alive.

Without `--cluster` and without RAY_ADDRESS, batchllm runs engines as local processes.
The driver (ledger, journals, inputs and outputs) stays on the machine that runs
`batchllm run`; only engines run on the cluster's nodes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchllm.cluster.loopback import is_loopback, keep_on_loopback
from batchllm.core.errors import UserError
from batchllm.engines.devices import DeviceSet, NodeDevices

_ADDRESS = re.compile(r"(ray://)?[\w.-]+:\d+\Z")
_CORE = re.compile(r"core(\d+)\Z")


def cluster_address(option: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray address to run on, None for local processes.

    `--cluster local`: local processes. `--cluster ray`: RAY_ADDRESS, else the cluster this
    machine belongs to (`auto`). `--cluster ray://host:port` or `host:port`: that one.
    No option: RAY_ADDRESS when it is set, else local processes."""
    environ = os.environ if environ is None else environ
    ray_address = environ.get("RAY_ADDRESS") or None
    if option is None:
        return ray_address
    if option == "local":
        return None
    if option == "ray":
        return ray_address or "auto"
    if _ADDRESS.match(option):
        return option
    raise UserError(f"bad cluster {option!r}", where="--cluster",
                    hint="use local, ray (RAY_ADDRESS or this machine's cluster), ray://host:port or host:port")


def nodes_devices(nodes: list[dict]) -> DeviceSet:
    """The devices of the alive nodes of `ray.nodes()`: GPUs when any node has one, else CPU
    cores. A node that advertises `core<N>` resources owns those cores (several nodes on
    one machine); otherwise its cores are 0..CPU-1. Head node first, then by node id."""
    alive = sorted((n for n in nodes if n.get("Alive")),
                   key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
    kind = "gpu" if any(n["Resources"].get("GPU", 0) >= 1 for n in alive) else "cpu"
    members = []
    for node in alive:
        resources = node["Resources"]
        if kind == "gpu":
            ids = tuple(range(int(resources.get("GPU", 0))))
        else:
            cores = sorted(int(m.group(1)) for key in resources if (m := _CORE.match(key)))
            ids = tuple(cores) if cores else tuple(range(int(resources.get("CPU", 0))))
        if ids:
            members.append(NodeDevices(node["NodeID"], ids))
    if not members:
        raise UserError(f"the Ray cluster has no {kind} devices: nodes {[n['NodeID'][:8] for n in alive]}", where="--devices ray")
    return DeviceSet(kind, tuple(range(sum(len(m.ids) for m in members))), tuple(members))


@dataclass
class RaySession:
    address: str

    @classmethod
    def connect(cls, address: str) -> RaySession:
        """ray.init on `address` (a loopback cluster stays on 127.0.0.1); an error quotes the address."""
        try:
            import ray
        except ImportError:
            raise UserError(f"--cluster {address!r} needs Ray", hint="pip install 'batchllm[ray]'") from None
        if address == "auto" or is_loopback(address):
            keep_on_loopback()
        extra: dict[str, Any] = {"_node_ip_address": "127.0.0.1"} if is_loopback(address) and not address.startswith("ray://") else {}
        if not ray.is_initialized():
            try:
                # Ray annotates logging_level as int but takes level names too (its own default is "info")
                ray.init(address=address, log_to_driver=False, logging_level="warning",
                         configure_logging=True, **extra)
            except (ConnectionError, RuntimeError, ValueError) as error:
                raise UserError(f"cannot connect to the Ray cluster at {address!r}: {error}", where="--cluster",
                                hint="start one with `ray start --head`, or check RAY_ADDRESS") from None
        return cls(address)

    def devices(self) -> DeviceSet:
        import ray

        return nodes_devices(ray.nodes())

    def alive_nodes(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def close(self) -> None:
        import ray

        ray.shutdown()


def open_cluster(cluster: str | None, devices: str) -> RaySession | None:
    """The session `batchllm run --cluster C --devices D` runs on, None for local processes.
    `--devices ray` alone means `--cluster ray`; on a cluster the devices are its nodes'
    (`--devices ray`, or left at `auto`)."""
    address = cluster_address(cluster)
    if address is None and devices == "ray":
        address = cluster_address("ray")
    if address is None:
        return None
    if devices not in ("auto", "ray"):
        raise UserError(f"--devices {devices!r} with --cluster {address!r}: on a cluster the devices are its nodes'",
                        where="--devices", hint="use --devices ray (or leave --devices out)")
    return RaySession.connect(address)
