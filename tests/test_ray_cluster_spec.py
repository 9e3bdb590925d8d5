"""Cluster specs, the cluster's devices as (node, device), placement inside nodes, and what
happens to the device set when a node is lost: no Ray needed (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchllm.cluster.loopback import is_loopback
from batchllm.cluster.replan import NodeLossReplanner
from batchllm.cluster.session import cluster_address, nodes_devices
from batchllm.core.errors import RunIncomplete, UserError
from batchllm.costmodel.profile import ReplicaShape
from batchllm.engines.devices import DeviceSet, NodeDevices, Replica
from batchllm.engines.protocol import EngineConfig
from batchllm.engines.ray_engine import replica_bundle
from batchllm.planner.cluster import Cluster, candidate_plans, parse_cluster, place
from batchllm.planner.plan_file import PROFILES_ROOT, plan_dag_file
from batchllm.runtime.sequential_stages import SequentialStages

REPO = Path(__file__).resolve().parent.parent
TWO_NODES = DeviceSet("cpu", (0, 1, 2), (NodeDevices("node-a", (0, 1)), NodeDevices("node-b", (5,))))


def ray_node(node_id: str, alive: bool = True, head: bool = False, **resources: float) -> dict:
    extra = {"node:__internal_head__": 1.0} if head else {}
    return {"NodeID": node_id, "Alive": alive, "Resources": {"memory": 1e9, **extra, **resources}}


def test_cluster_address_from_option_and_environment():
    assert cluster_address(None, {}) is None
    assert cluster_address(None, {"RAY_ADDRESS": "10.0.0.5:6379"}) == "10.0.0.5:6379"
    assert cluster_address("local", {"RAY_ADDRESS": "10.0.0.5:6379"}) is None
    assert cluster_address("ray", {}) == "auto"
    assert cluster_address("ray", {"RAY_ADDRESS": "ray://head:10001"}) == "ray://head:10001"
    assert cluster_address("ray://head:10001", {}) == "ray://head:10001"
    assert cluster_address("127.0.0.1:6390", {}) == "127.0.0.1:6390"
    with pytest.raises(UserError, match="bad cluster 'kubernetes'"):
        cluster_address("kubernetes", {})


def test_loopback_addresses():
    assert is_loopback("127.0.0.1:6390") and is_loopback("ray://localhost:10001")
    assert not is_loopback("10.0.0.5:6379") and not is_loopback("auto")


def test_nodes_devices_reads_cores_it_owns_head_first_and_skips_dead_nodes():
    devices = nodes_devices([ray_node("b", CPU=1.0, core1=1.0), ray_node("a", head=True, CPU=1.0, core0=1.0),
                             ray_node("c", alive=False, CPU=4.0)])
    assert devices == DeviceSet("cpu", (0, 1), (NodeDevices("a", (0,)), NodeDevices("b", (1,))))
    plain = nodes_devices([ray_node("x", head=True, CPU=4.0)])  # a machine of its own: cores 0..3
    assert plain.nodes == (NodeDevices("x", (0, 1, 2, 3)),)


def test_nodes_devices_prefers_gpus_and_refuses_an_empty_cluster():
    devices = nodes_devices([ray_node("a", head=True, CPU=8.0), ray_node("b", CPU=32.0, GPU=8.0)])
    assert devices.kind == "gpu" and devices.nodes == (NodeDevices("b", tuple(range(8))),)
    with pytest.raises(UserError, match="no cpu devices"):
        nodes_devices([ray_node("a", head=True, CPU=0.0)])


def test_replicas_map_indices_to_one_nodes_devices():
    assert TWO_NODES.node_sizes == (2, 1)
    assert TWO_NODES.replica((0, 1), 1) == Replica("cpu", (0, 1), 1, node="node-a")
    assert TWO_NODES.replica((2,), 1) == Replica("cpu", (5,), 1, node="node-b")
    with pytest.raises(ValueError, match=r"spans nodes \['node-a', 'node-b'\]"):
        TWO_NODES.replica((1, 2), 1)
    assert DeviceSet("cpu", (0, 1)).replica((1,), 1) == Replica("cpu", (1,), 1)  # one machine: as before


def test_a_lost_node_leaves_the_others_renumbered():
    assert TWO_NODES.without_nodes({"node-a"}) == DeviceSet("cpu", (2,), (NodeDevices("node-b", (5,)),))
    assert TWO_NODES.without_nodes({"node-a"}).replica((0,), 1) == Replica("cpu", (5,), 1, node="node-b")
    replanner = NodeLossReplanner(alive_nodes=lambda: {"node-b"}, planning_for=lambda devices: ("stages for", devices))
    surviving, stages = replanner.after_loss(TWO_NODES)
    assert surviving.node_sizes == (1,) and stages == ("stages for", surviving)
    assert NodeLossReplanner(lambda: {"node-a", "node-b"}, lambda d: d).after_loss(TWO_NODES) is None  # an engine crash, not a node
    with pytest.raises(RunIncomplete, match="every node of the cluster is lost"):
        NodeLossReplanner(lambda: set(), lambda d: d).after_loss(TWO_NODES)


def test_cluster_spec_parses_nodes_and_keeps_replicas_inside_them():
    cluster = parse_cluster("2x8xA100-80G", PROFILES_ROOT)
    assert (cluster.devices, cluster.nodes, str(cluster)) == (16, (8, 8), "2x8xA100-80G")
    assert parse_cluster("8xA100-80G", PROFILES_ROOT).nodes == (8,)
    with pytest.raises(UserError, match="'0x8xA100-80G': 0 nodes"):
        parse_cluster("0x8xA100-80G", PROFILES_ROOT)
    # three replicas of 3 on 2 nodes of 8: two fit in the first node, the third starts the second
    assert place({"a": (3, 3)}, {}, 16, (8, 8)) == {"a": (0, 1, 2, 3, 4, 5, 8, 9, 10)}
    assert place({"a": (1, 2)}, {}, 2, (1, 1)) is None  # two cores, but on two nodes


def test_candidate_plans_never_exceed_a_node():
    class Shapes:
        shapes = {"w1-tp1": None, "w2-tp1": None}

    one_core_nodes = Cluster("cpu", "cpu-x", 2, node_sizes=(1, 1))
    assert {(p.dp, p.shape) for p in candidate_plans(Shapes, one_core_nodes)} == {(1, ReplicaShape(1, 1)), (2, ReplicaShape(1, 1))}
    assert any(p.shape == ReplicaShape(2, 1) for p in candidate_plans(Shapes, Cluster("cpu", "cpu-x", 2)))


@pytest.mark.parametrize("spec", ["2x8xA100-80G", "4x8xH100-80G"])
def test_plans_for_a_cluster_keep_tensor_parallel_groups_inside_nodes(spec):
    report = plan_dag_file(REPO / "dags" / "chain_summary.yaml", spec)
    per_node = report.cluster.nodes[0]
    for stage in report.chosen.stages:
        for name, plan in stage.plans.items():
            ids, size = stage.placement[name], plan.shape.devices
            for k in range(plan.dp):
                assert len({d // per_node for d in ids[k * size:(k + 1) * size]}) == 1, (spec, name, plan, ids)
    assert any("stays inside one node" in note for note in report.problem.notes)


def test_sequential_stages_on_a_cluster_run_one_engine_per_node():
    stages = SequentialStages(TWO_NODES, ["a"])
    from batchllm.runtime.run_state import NodeProgress

    stage = stages.choose({"a": NodeProgress(0, 4, True)}, {}).stage
    plan = stage.plans["a"]
    assert (plan.dp, plan.shape.devices, stage.placement["a"]) == (2, 1, (0, 2))


def test_a_cpu_replica_reserves_its_cores_and_their_core_resources():
    config = EngineConfig("m", Replica("cpu", (1,), 1, node="b"))
    assert replica_bundle(config, {"CPU": 1.0, "core1": 1.0}) == {"CPU": 1.0, "core1": 1.0}
    assert replica_bundle(config, {"CPU": 8.0}) == {"CPU": 1.0}
    gpu = EngineConfig("m", Replica("gpu", (0, 1), 2, node="b"))
    assert replica_bundle(gpu, {"CPU": 8.0, "GPU": 8.0}) == {"GPU": 2.0, "CPU": 1.0}


def test_plan_tables_name_each_nodes_own_devices():
    from batchllm.planner.report import _devices_text

    assert _devices_text((8, 9, 10, 11), (8, 8)) == "n2:0-3"
    assert _devices_text((6, 7, 8, 9), (8, 8)) == "n1:6-7 n2:0-1"
    assert _devices_text((0, 1, 2), ()) == "0-2"
