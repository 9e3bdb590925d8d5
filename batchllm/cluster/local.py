"""A Ray cluster of several nodes on this machine, all on 127.0.0.1: for tests, the
overhead benchmark and trying `--cluster` without a second machine.

Each node is a `ray start` of its own (`ray.cluster_utils.Cluster` hung here: its second
node looked for the head on the host's interface address) with its own cores, which it
advertises as resources `core<N>`: batchllm binds an engine on that node to exactly
those cores, as on one machine. Every process of the cluster has the cluster's own
temp folder on its command line, so `stop` ends exactly those processes (never other
Ray processes on the machine), and `kill_raylet` takes one node away as a lost machine.
The cluster's Ray settings are its own, whatever the user's (`ray_env`): token authentication
with a token made for the cluster, in its temp folder; a driver joins with `driver_env()`.
A watchdog process stops the cluster when its owner (the process that started it) ends
without stopping it, e.g. a test run killed by a timeout before its teardown.

    python -m batchllm.cluster.local watch OWNER_PID PORT TEMP_DIR   (started by `start`)
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import cast

# Lost nodes are noticed in about 3 s (the defaults take about 30 s): the GCS probes each raylet.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                      "RAY_health_check_timeout_ms": "1000", "RAY_health_check_initial_delay_ms": "1000"}

# What Ray 2.60 reads of a user's own set-up, none of which the cluster takes from the environment it starts in
# (ray/_private/authentication/authentication_token_setup.py and its C++ token loader): the token itself
# (RAY_AUTH_TOKEN, before any file), a token file (RAY_AUTH_TOKEN_PATH, before ~/.ray/auth_token), the mode
# (RAY_AUTH_MODE: when unset, `ray start --head` turns tokens on if it finds ~/.ray/auth_token, which any
# `ray.init` of a new local cluster writes, while `ray start --address` and `ray.init(address=...)` do not:
# a stale token there left the worker node out with InvalidAuthToken), and the cluster to join (RAY_ADDRESS).
USER_RAY_SETTINGS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS")


@dataclass(frozen=True)
class LocalNode:
    cores: tuple[int, ...]
    raylet_pid: int
    node_id: str


@dataclass
class LocalRayCluster:
    port: int
    temp_dir: Path
    nodes: list[LocalNode] = field(default_factory=list)
    _orphans: dict[int, list[str]] = field(default_factory=dict)  # children of killed raylets, by pid: they should end on their own

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, cores_per_node: list[tuple[int, ...]], port: int = 6390, temp_dir: Path | None = None) -> LocalRayCluster:
        """Head on the first cores, one worker node per further entry; stops what it started if a step fails,
        and when this process ends without calling `stop`."""
        cluster = cls(port, temp_dir or Path(f"/tmp/blray{port}"))
        subprocess.Popen([sys.executable, "-m", "batchllm.cluster.local", "watch", str(os.getpid()), str(port),
                          str(cluster.temp_dir)], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for cores in cores_per_node:
                cluster.add_node(cores)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def token_file(self) -> Path:
        return self.temp_dir / "auth_token"

    def ray_settings(self) -> dict[str, str]:
        """Token authentication on, with the cluster's own token file (never ~/.ray/auth_token, whatever HOME holds)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file)}

    def ray_env(self) -> dict[str, str]:
        """This process's environment with the cluster's Ray settings in place of the user's."""
        env = {name: value for name, value in os.environ.items() if name not in USER_RAY_SETTINGS}
        return {**env, **self.ray_settings()}

    def driver_env(self) -> dict[str, str]:
        """The environment of a driver of this cluster in a process of its own (`batchllm run --cluster ADDRESS`)."""
        return self.ray_env()

    def drive_from_here(self) -> None:
        """This process as a driver of the cluster: its Ray settings in place of the user's, before
        `RaySession.connect(self.address)`. Ray reads them when imported, so an imported Ray reads them
        again (as Ray's own `_enable_token_auth` does when it turns tokens on)."""
        for name in USER_RAY_SETTINGS:
            os.environ.pop(name, None)
        os.environ.update(self.ray_settings())
        if "ray._raylet" in sys.modules:
            from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # not in its stub

            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()

    def _new_token(self) -> None:
        """A token of the cluster's own, readable by this user only (a new one for each head)."""
        self.temp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.token_file.unlink(missing_ok=True)
        descriptor = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32))  # as Ray's own generate_new_authentication_token

    def add_node(self, cores: tuple[int, ...]) -> LocalNode:
        head = not self.nodes
        if head:
            self._new_token()
        resources = json.dumps({f"core{c}": 1 for c in cores})
        command = [sys.executable, "-m", "batchllm.cluster.loopback", "start", "--node-ip-address=127.0.0.1",
                   f"--num-cpus={len(cores)}", "--num-gpus=0", f"--resources={resources}", "--disable-usage-stats"]
        command += ([f"--port={self.port}", "--head", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
                    if head else [f"--address={self.address}"])
        before = set(self._raylets())
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**self.ray_env(), **FAST_HEALTH_CHECKS})
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-2000:]}")
        started = [pid for pid in self._raylets() if pid not in before]
        if len(started) != 1:
            raise RuntimeError(f"expected one new raylet after starting a node on cores {cores}, found {started}")
        node = LocalNode(tuple(cores), started[0], self._raylets()[started[0]])
        self.nodes.append(node)
        return node

    def _processes(self) -> dict[int, list[str]]:
        """pid -> command line of every process of this cluster (its temp folder on the line)."""
        markers = (str(self.temp_dir), f"--address={self.address}")  # the head's Ray client server names only the address
        table = {}  # pid -> (parent pid, command line)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # not a process, or it just ended
            if state[0] != "Z":  # a zombie has ended already
                table[int(entry.name)] = (int(state[1]), args)
        found = {pid: args for pid, (_, args) in table.items()
                 if (_is_ray(args) and any(m in arg for arg in args for m in markers)) or self._orphans.get(pid) == args}
        # workers rename themselves (ray::EngineActor): they are the raylets' children
        found.update({pid: args for pid, (parent, args) in table.items() if parent in found})
        return found

    def _raylets(self) -> dict[int, str]:
        """pid -> node id of this cluster's raylets."""
        raylets = {}
        for pid, args in self._processes().items():
            if args and args[0].endswith("/raylet"):
                raylets[pid] = next(a.split("=", 1)[1] for a in args if a.startswith("--node_id="))
        return raylets

    def kill_raylet(self, node: LocalNode) -> None:
        """The node is lost, as when its machine goes: its raylet is killed, and with it the node's workers."""
        processes = self._processes()
        self._orphans.update({pid: args for pid, args in processes.items() if _parent(pid) == node.raylet_pid})
        os.kill(node.raylet_pid, signal.SIGKILL)
        self.nodes.remove(node)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End every process of this cluster: SIGTERM, then SIGKILL what is left after `timeout_s`."""
        for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            for pid in self._processes():
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while self._processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.nodes.clear()

    def leftovers(self) -> list[str]:
        """Command lines of this cluster's processes still running (none after `stop`)."""
        return [" ".join(args)[:200] for args in self._processes().values()]


def _is_ray(args: list[str]) -> bool:
    """A Ray program: a binary or script of the ray package, or `python -m ray.<module>`
    (not a shell or editor whose command line merely mentions the cluster)."""
    spec = cast(ModuleSpec, importlib.util.find_spec("ray"))  # installed: Ray runs this cluster
    package = cast("list[str]", spec.submodule_search_locations)[0]  # a package: it has a folder
    return any(a.startswith(package) or a.startswith("ray.") for a in args[:3])


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def watch(owner_pid: int, port: int, temp_dir: Path, every_s: float = 2.0) -> None:
    """Once the owner process is gone, stop whatever is left of the cluster (nothing after a clean `stop`)."""
    while Path(f"/proc/{owner_pid}").exists():
        time.sleep(every_s)
    LocalRayCluster(port, temp_dir).stop()


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "watch":
        raise SystemExit(f"usage: python -m batchllm.cluster.local watch OWNER_PID PORT TEMP_DIR (got {sys.argv[1:]})")
    watch(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
