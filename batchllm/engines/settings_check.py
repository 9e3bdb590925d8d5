"""The engine settings each model will be given, checked by vLLM's own configuration
classes before anything runs: `max_model_len` within the model's positions, the dtype and
the model's quantization supported on this platform, and a KV cache that holds at least
one sequence of `max_model_len` tokens. No weights are read: vLLM builds its `ModelConfig`
from config.json alone (for an embedded model, the config shipped with batchllm).

Importing vLLM takes seconds, and the driver should not carry it: the check runs in a
short-lived child process (`python -m batchllm.engines.settings_check`), and its verdict
is kept under `$BATCHLLM_HOME/checks/`, keyed by the vLLM release, the model's config and
the settings, so a DAG checked once is checked at once the next time.
Not checked here (they need the engine): whether the weights fit the device's memory, and
kernels the device lacks; an engine that fails on them says why when it starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.files import write_text_atomically
from batchllm.core.requests import ModelTask
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.dag.node_task import engine_max_model_len, engine_task
from batchllm.engines.devices import CPU_KV_CACHE_DEFAULT_BYTES, engine_dtype, engine_dtype_reason
from batchllm.engines.protocol import exception_cause
from batchllm.engines.version import installed_vllm
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.registry import resolve_model

CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class EngineSettings:
    """What an engine of one model is given, as far as its configuration goes."""

    config_dir: str  # a directory with the model's config.json
    max_model_len: int | None
    kv_cache_memory_bytes: int | None
    dtype: str | None
    dtype_reason: str = ""  # why `dtype` (a fact of this host), for messages


@dataclass(frozen=True)
class SettingsVerdict:
    problem: str | None  # None: vLLM takes the settings
    setting: str = "model"  # the DAG key the problem is about: `max_model_len`, `kv_cache_memory_bytes` or `model`


def check_engine_settings(dag: DagSpec, home: Path, device_kind: str) -> None:
    """UserError (exit 2) naming the setting, the model and the fix, when vLLM would refuse
    to start an engine of a DAG's model with the DAG's engine settings on these devices."""
    if importlib.util.find_spec("vllm") is None:
        return  # no engine installed: nothing could run, and the run says so
    e = dag.engine
    first_node: dict[tuple[str, ModelTask], NodeSpec] = {}
    for node in dag.nodes.values():
        if node.model not in dag.endpoints:  # a server's model runs on settings of its own
            first_node.setdefault((node.model, engine_task(node.task)), node)
    settings = {}
    for (model, task), node in first_node.items():
        ref = resolve_model(model, dag_dir=dag.path.parent, home=home, where=dag.where(node.line, f"nodes.{node.name}.model"))
        config_dir = EMBEDDED_MODELS[ref.location].config_dir() if ref.kind == "embedded" else Path(ref.location)
        settings[model, task] = EngineSettings(str(config_dir), engine_max_model_len(e, task),
                                         e.kv_cache_memory_bytes or (CPU_KV_CACHE_DEFAULT_BYTES if device_kind == "cpu" else None),
                                         engine_dtype(device_kind), engine_dtype_reason(device_kind))
    verdicts = _verdicts(list(settings.values()), home / "checks")
    for ((model, _), node), verdict in zip(first_node.items(), verdicts):
        if verdict.problem is None:
            continue
        if verdict.setting == "model":
            where = dag.where(node.line, f"nodes.{node.name}.model")
            hint = "use a model this vLLM supports on these devices"
        else:
            where = dag.where(e.line, f"engine.{verdict.setting}")
            hint = ("lower engine.max_model_len, or raise engine.kv_cache_memory_bytes"
                    if verdict.setting == "kv_cache_memory_bytes" else "lower engine.max_model_len, or leave it out (the model's own)")
        raise UserError(f"vLLM refuses model {model!r} with these engine settings: {verdict.problem}", where=where, hint=hint)


def _verdicts(settings: list[EngineSettings], cache_dir: Path) -> list[SettingsVerdict]:
    keys = [_cache_key(s) for s in settings]
    cached = {key: _read_cached(cache_dir / f"{key}.json") for key in keys}
    unknown = [s for s, key in zip(settings, keys) if cached[key] is None]
    if unknown:
        for s, verdict in zip(unknown, _check_in_child(unknown)):
            cached[_cache_key(s)] = verdict
            cache_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomically(cache_dir / f"{_cache_key(s)}.json", json.dumps(asdict(verdict)) + "\n")
    return [cached[key] or SettingsVerdict(None) for key in keys]


def _cache_key(settings: EngineSettings) -> str:
    config = Path(settings.config_dir) / "config.json"
    body = json.dumps([installed_vllm(), asdict(settings), config.read_text(errors="replace") if config.is_file() else None])
    return "engine-settings-" + hashlib.sha256(body.encode()).hexdigest()[:24]


def _read_cached(path: Path) -> SettingsVerdict | None:
    try:
        return SettingsVerdict(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _check_in_child(settings: list[EngineSettings]) -> list[SettingsVerdict]:
    try:
        done = subprocess.run([sys.executable, "-m", "batchllm.engines.settings_check"], input=json.dumps([asdict(s) for s in settings]),
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        lines = done.stdout.strip().splitlines()
        return [SettingsVerdict(**item) for item in json.loads(lines[-1])] if done.returncode == 0 and lines else []
    except (subprocess.TimeoutExpired, ValueError, TypeError, IndexError):
        return []  # the check itself failed: the engine's start will say what is wrong


def _verdict(settings: EngineSettings) -> SettingsVerdict:
    """In the child: what vLLM's ModelConfig says of the settings."""
    from vllm.config import ModelConfig, ParallelConfig

    try:
        # vLLM's annotations are narrower than what it takes: max_model_len=None is its own default, and any
        # dtype name is checked when it runs (a refusal lands below)
        config = ModelConfig(model=settings.config_dir, max_model_len=settings.max_model_len, dtype=settings.dtype or "auto",
                             skip_tokenizer_init=True)
    except Exception as error:  # noqa: BLE001  pydantic's ValidationError, ValueError: the refusal is the answer
        cause = exception_cause(error)
        return SettingsVerdict(cause, "max_model_len" if "max_model_len" in cause else "model")
    parallel = ParallelConfig()
    # vLLM annotates the dtype field as its input (a name or a torch.dtype); __post_init__ makes it a torch.dtype
    per_token = 2 * config.get_num_layers(parallel) * config.get_num_kv_heads(parallel) * config.get_head_size() * config.dtype.itemsize
    needed = per_token * config.max_model_len
    if settings.kv_cache_memory_bytes is not None and settings.kv_cache_memory_bytes < needed:
        dtype = str(config.dtype).removeprefix("torch.")
        why = "the model's own dtype" if settings.dtype is None else settings.dtype_reason
        return SettingsVerdict(f"a KV cache of {settings.kv_cache_memory_bytes:,} bytes holds "
                               f"{settings.kv_cache_memory_bytes // per_token:,} tokens, less than one sequence of max_model_len "
                               f"{config.max_model_len:,} tokens ({needed:,} bytes at {per_token:,} bytes a token in {dtype}: "
                               f"{why})", "kv_cache_memory_bytes")
    return SettingsVerdict(None)


if __name__ == "__main__":
    queries = [EngineSettings(**item) for item in json.loads(sys.stdin.read())]
    print(json.dumps([asdict(_verdict(q)) for q in queries]))
