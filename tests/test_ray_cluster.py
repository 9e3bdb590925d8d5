"""batchllm on a two-node Ray cluster on this machine (127.0.0.1), one core per node, with
real vLLM engines in Ray actors (slow: marked `ray`).

The cluster is started once for the module and stopped at its end, with a check that
none of its processes is left. Runs go through the `batchllm` command as a user's would.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.cluster.local import LocalRayCluster
from batchllm.io.node_journal import read_records

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # as in test_real_engine: the model is converted once per checkout
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
RUN_LIMIT_S = 900  # a safety net for a hung run, not a measurement


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    started = LocalRayCluster.start([(0,), (1,)], port=free_port())
    yield started
    started.stop()
    assert started.leftovers() == []


def batchllm_run(dag: Path, out: Path, cluster: LocalRayCluster, *options: str) -> subprocess.Popen:
    env = {**cluster.driver_env(), "BATCHLLM_HOME": str(MODEL_HOME)}  # the cluster's own Ray settings (its token)
    return subprocess.Popen([BATCHLLM, "run", str(dag), "--out", str(out), "--fresh", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=RUN_LIMIT_S)
    assert process.returncode == 0, f"batchllm run exited {process.returncode}:\n{err[-3000:]}"
    return out + err


def keys(out: Path, node: str) -> list[tuple[str, int]]:
    table = pq.read_table(out / "nodes" / f"{node}.parquet", columns=["row_id", "step"])
    return sorted(zip(table.column("row_id").to_pylist(), table.column("step").to_pylist()))


def engine_nodes(out: Path) -> set[str]:
    """Node id prefixes in the engine log names (engine-<model>-cpu<node>-<cores>.log)."""
    return {p.stem.rsplit("-", 2)[1].removeprefix("cpu") for p in (out / ".batchllm" / "logs").glob("engine-*.log")}


def committed(out: Path, node: str) -> int:
    folder = out / ".batchllm" / "journal" / node
    return read_records(folder).num_rows if folder.exists() else 0


def test_a_run_on_two_nodes_that_loses_one_is_replanned_and_every_unit_runs_once(cluster, tmp_path):
    """Engines on both nodes, then the worker node's raylet killed mid-run: the head takes the rest.
    (The DAG's own logic, several nodes and their dependencies, is the same on Ray as on one
    machine: the local real-engine tests run the example DAGs.)"""
    rows = 24  # each engine runs 4 at a time: the kill lands with most of them left
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)],
                             "topic": [f"the number {i}" for i in range(rows)]}), tmp_path / "topics.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("name: lost-node\ninputs:\n  topics: {path: topics.parquet, id_column: id}\nengine: {max_model_len: 1024, max_num_seqs: 4}\n"
                   "nodes:\n  story:\n    model: smollm2-135m\n    prompt: \"Write a long story about {{ topic }}.\"\n"
                   "    sampling: {max_tokens: 32}\n")
    worker = cluster.nodes[1]  # not the head: the head holds the cluster's control store
    both = {n.node_id[:8] for n in cluster.nodes}
    run = batchllm_run(dag, tmp_path / "out", cluster, "--cluster", cluster.address)
    try:
        while committed(tmp_path / "out", "story") < 4:  # a first wave is done; each engine runs 4 at a time, so both have more
            assert run.poll() is None, run.communicate()[1][-3000:]
            time.sleep(0.2)
        assert worker.node_id[:8] in engine_nodes(tmp_path / "out")
        cluster.kill_raylet(worker)
        text = finish(run)
    finally:
        if run.poll() is None:
            run.kill()
        cluster.add_node(worker.cores)  # the teardown stops the two nodes it started, and checks none is left
    assert "cpu:2 on 2 nodes" in text and "re-planning" in text
    assert engine_nodes(tmp_path / "out") == both  # engines ran on both nodes before the loss
    assert committed(tmp_path / "out", "story") == rows  # each unit committed once: none lost, none twice
    assert keys(tmp_path / "out", "story") == sorted((f"r{i}", 0) for i in range(rows))


# A driver that runs a task on each of the cluster's nodes (by its `core<N>` resource) and prints where they ran.
ON_EACH_NODE = """
import sys
import ray
from batchllm.cluster.session import RaySession
RaySession.connect(sys.argv[1])
@ray.remote
def where():
    return ray.get_runtime_context().get_node_id()
print("ran on", *sorted(ray.get([where.options(resources={r: 1}, num_cpus=0).remote() for r in sys.argv[2:]])))
"""


def test_a_stale_ray_token_in_the_users_home_leaves_the_cluster_working(tmp_path, monkeypatch):
    """Ray keeps a token in ~/.ray/auth_token (any `ray.init` of a new local cluster writes one), and a
    `ray start --head` that finds one turns token authentication on; a worker node, or a driver given an
    address, did not read it and failed to join (InvalidAuthToken). The cluster and its drivers use
    Ray settings of their own: a stale token in the home they run with changes nothing."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)  # a token of a cluster long gone
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    started = LocalRayCluster.start([(0,), (1,)], port=free_port())
    try:
        assert len(started.nodes) == 2
        done = subprocess.run([sys.executable, "-c", ON_EACH_NODE, started.address, "core0", "core1"],
                              env=started.driver_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        ran = next(line for line in done.stdout.splitlines() if line.startswith("ran on")).split()[2:]
        assert ran == sorted(n.node_id for n in started.nodes)  # a task on each node: the worker node joined
    finally:
        started.stop()
    assert started.leftovers() == []
    assert (home / ".ray" / "auth_token").read_text() == "0" * 64  # the user's file is left as it was
