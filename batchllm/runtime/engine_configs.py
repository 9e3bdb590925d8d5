"""The engine settings a DAG's node gets on a replica: the DAG's `engine:` section,
device defaults (eager mode and a bounded KV cache on CPUs, float32 on CPUs without
AVX-512), and a log file per model and devices in the run folder; or, for a model on
servers, one config per server."""

from __future__ import annotations

from pathlib import Path

from batchllm.core.endpoint import Endpoint
from batchllm.core.errors import UserError
from batchllm.core.requests import ModelTask
from batchllm.dag.model import DagSpec
from batchllm.dag.node_task import engine_max_model_len, engine_task
from batchllm.engines.devices import CPU_KV_CACHE_DEFAULT_BYTES, DeviceSet, Replica, engine_dtype
from batchllm.engines.endpoint.http_engine import endpoint_config
from batchllm.engines.protocol import EngineConfig
from batchllm.models.lora_adapter import LoraAdapter
from batchllm.models.model_kind import ModelKind
from batchllm.models.registry import resolve_model
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.stage_chooser import StageChoice


def engine_config(dag: DagSpec, model: str, replica: Replica, run_dir: RunDir, home: Path,
                  task: ModelTask = ModelTask.GENERATE) -> EngineConfig:
    ref = resolve_model(model, dag_dir=dag.path.parent, home=home, where=f"model {model!r}")
    e = dag.engine
    devices = (f"{replica.node[:8]}-" if replica.node else "") + "-".join(map(str, replica.device_ids))
    task = engine_task(task, cross_encoder=task is ModelTask.SCORE and ModelKind.of(ref.config_dir(home)).classifies)
    max_loras, max_lora_rank = lora_settings(dag, model) if task is ModelTask.GENERATE else (0, None)
    return EngineConfig(
        model=ref.materialise(home), replica=replica, max_model_len=engine_max_model_len(e, task), max_num_seqs=e.max_num_seqs,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes or (CPU_KV_CACHE_DEFAULT_BYTES if replica.kind == "cpu" else None),
        enforce_eager=replica.kind == "cpu" if e.enforce_eager is None else e.enforce_eager, dtype=engine_dtype(replica.kind),
        log_path=str(run_dir.log_path(f"engine-{ref.name.replace('/', '_')}{'-' + task.value if task.pools else ''}-{replica.kind}{devices}")),
        task=task, max_loras=max_loras, max_lora_rank=max_lora_rank,
    )


def lora_settings(dag: DagSpec, model: str) -> tuple[int, int | None]:
    """The LoRA settings of a model's engine: its adapters in the DAG (every one held at once), and the
    smallest rank vLLM takes that holds the largest of them; (0, None) without adapters. One for all of
    the model's generation nodes, so the base's and its adapters' share one engine."""
    adapters = sorted({n.adapter for n in dag.nodes.values() if n.model == model and n.adapter is not None})
    if not adapters:
        return 0, None
    return len(adapters), max(LoraAdapter.read(Path(a)).engine_rank() for a in adapters)


def stage_configs(dag: DagSpec, choice: StageChoice, devices: DeviceSet, run_dir: RunDir, home: Path) -> dict[str, list[EngineConfig]]:
    """Each node of the stage: its replicas' engine settings, on the devices the stage places it on."""
    configs = {}
    for name, plan in choice.stage.plans.items():
        size, placed = plan.shape.devices, choice.stage.placement[name]
        replicas = [devices.replica(placed[k * size:(k + 1) * size], plan.shape.tp) for k in range(plan.dp)]
        configs[name] = [engine_config(dag, dag.nodes[name].model, r, run_dir, home, dag.nodes[name].task) for r in replicas]
    return configs


def endpoint_configs(dag: DagSpec, model: str, servers: tuple[Endpoint, ...], run_dir: RunDir, home: Path) -> list[EngineConfig]:
    """One config per server of a model; with the model's files here when it has them (its
    tokenizer gives the prefix order), else none (requests go in the order given). Its log is
    the server's latency guard's."""
    try:
        model_dir = resolve_model(model, dag_dir=dag.path.parent, home=home, where=f"model {model!r}").materialise(home)
    except UserError:
        model_dir = ""
    return [endpoint_config(model_dir, server, index, str(run_dir.log_path(f"engine-{model.replace('/', '_')}-endpoint{index}")))
            for index, server in enumerate(servers)]
