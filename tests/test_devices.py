"""What a replica's devices become in its worker's environment."""

from __future__ import annotations

from batchllm.engines.devices import Replica


def test_a_cpu_replica_binds_its_cores_and_runs_as_many_openmp_threads():
    assert Replica("cpu", (1,)).environment() == {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    assert Replica("cpu", (0, 1, 2, 3), tp=2).environment() == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "OMP_NUM_THREADS": "2"}


def test_a_gpu_replica_sees_only_its_gpus():
    assert Replica("gpu", (2, 3), tp=2).environment() == {"CUDA_VISIBLE_DEVICES": "2,3"}
