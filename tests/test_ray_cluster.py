"""batchllm on a two-node Ray cluster on this machine (127.0.0.1), one core per node, with
real vLLM engines in Ray actors (slow: marked `ray`).

The cluster is started once for the module and stopped at its end, with a check that
none of its processes is left. Runs go through the `batchllm` command as a user's would.
"""

from __future__ import annotations

import os
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


def batchllm_run(dag: Path, out: Path, *options: str) -> subprocess.Popen:
    env = {**os.environ, "BATCHLLM_HOME": str(MODEL_HOME)}
    env.pop("RAY_ADDRESS", None)
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
    run = batchllm_run(dag, tmp_path / "out", "--cluster", cluster.address)
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
