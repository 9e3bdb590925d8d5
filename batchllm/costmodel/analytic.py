"""Analytic (roofline) profiles for GPUs this project cannot run on.

Each step-latency coefficient is the time of the work it stands for on the hardware's
peak compute or memory bandwidth, at a fixed efficiency:

    base_s                weights read once per step (memory-bound decode) + per-layer
                          all-reduce latency under tensor parallelism + a fixed overhead
    per_prefill_token_s   2 x active parameters FLOPs per token
    per_attention_unit_s  4 x layers x hidden FLOPs per (token, context token)
    per_decode_seq_s      2 x active parameters FLOPs per sequence + sampling
    per_context_token_s   the KV cache bytes of one token, read once per step

Load time follows the SamuLLM artifact's A100 figures (fixed start-up + weights at a
disk rate, + process-group set-up under tensor parallelism). Profiles made here say
`kind: analytic`; a measured profile of the same (hardware, model) wins.

    python -m batchllm.costmodel.analytic    # writes profiles/analytic/<hardware>/<model>/
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from batchllm.costmodel.latency import StepLatencyModel
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.profile import ModelFacts, Profile, ReplicaShape, ShapeProfile

CATALOG = Path(__file__).resolve().parent.parent.parent / "profiles" / "analytic" / "catalog.yaml"
COMPUTE_EFFICIENCY = 0.5  # share of peak FLOP/s reached by large matrix products
MEMORY_EFFICIENCY = 0.8  # share of peak bandwidth reached by streaming reads
STEP_OVERHEAD_S = 0.004  # scheduling, input preparation and output handling per step
SAMPLING_PER_SEQ_S = 20e-6
# Two all-reduces per layer under tensor parallelism: inside an NVLink group, or over PCIe.
ALLREDUCE_LATENCY_S = {"nvlink": 10e-6, "pcie": 40e-6}
LINK_BANDWIDTH_BPS = {"nvlink": 300e9, "pcie": 25e9}
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 2e9  # per GPU
ENGINE_SETTINGS = {"engine_version": "vllm (analytic)", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "block_size_tokens": 16, "dtype": "bfloat16", "enforce_eager": False}


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_bf16_tflops: float
    memory_gb: float
    memory_bandwidth_gbps: float
    nvlink_group: int


@dataclass(frozen=True)
class CatalogModel:
    name: str
    facts: ModelFacts
    active_parameters: float
    length_mean: float
    length_median: float

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.facts.parameters

    @property
    def kv_bytes_per_token(self) -> float:
        head_dim = self.facts.hidden_size / self.facts.attention_heads
        return 2 * self.facts.layers * self.facts.kv_heads * head_dim * 2  # K and V, bf16


def load_catalog(path: Path = CATALOG) -> tuple[dict[str, GpuSpec], dict[str, CatalogModel]]:
    body = yaml.safe_load(path.read_text())
    gpus = {name: GpuSpec(name, **spec) for name, spec in body["hardware"].items()}
    models = {}
    for name, m in body["models"].items():
        facts = ModelFacts(parameters=int(m["parameters_b"] * 1e9), layers=m["layers"], hidden_size=m["hidden_size"],
                           attention_heads=m["attention_heads"], kv_heads=m["kv_heads"], max_model_len=m["max_model_len"])
        models[name] = CatalogModel(name, facts, m["active_parameters_b"] * 1e9, m["length_mean"], m["length_median"])
    return gpus, models


def lognormal_lengths(mean: float, median: float, max_len: int) -> LengthDistribution:
    """A discretised log-normal with the given mean and median, capped at max_len."""
    mu = math.log(median)
    sigma = math.sqrt(max(2 * (math.log(mean) - mu), 1e-6))
    support = np.arange(1, max_len + 1)
    cdf = 0.5 * (1 + np.vectorize(math.erf)((np.log(support + 0.5) - mu) / (sigma * math.sqrt(2))))
    cdf[-1] = 1.0
    return LengthDistribution(support, cdf, censored_at=max_len)


def shape_profile(model: CatalogModel, gpu: GpuSpec, tp: int) -> ShapeProfile | None:
    """None when the shape is invalid: heads not divisible, or weights + one sequence do not fit.

    A tensor-parallel group larger than an NVLink group is valid but all-reduces over PCIe.
    """
    if model.facts.attention_heads % tp:
        return None
    link = "nvlink" if tp <= gpu.nvlink_group else "pcie"
    allreduce_s = 2 * model.facts.layers * ALLREDUCE_LATENCY_S[link] if tp > 1 else 0.0
    # bytes each token's activations move per step through the all-reduces (ring: 2 (tp-1)/tp)
    per_token_comm_s = (2 * model.facts.layers * model.facts.hidden_size * 2 * 2 * (tp - 1) / tp / LINK_BANDWIDTH_BPS[link]) if tp > 1 else 0.0
    flops = gpu.peak_bf16_tflops * 1e12 * COMPUTE_EFFICIENCY * tp
    bandwidth = gpu.memory_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY * tp
    usable = tp * (gpu.memory_gb * 1e9 * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_BYTES) - model.weight_bytes
    kv_tokens = int(usable / model.kv_bytes_per_token)
    if kv_tokens < model.facts.max_model_len:
        return None
    latency = StepLatencyModel(
        base_s=model.weight_bytes / bandwidth + STEP_OVERHEAD_S + allreduce_s,
        per_prefill_token_s=2 * model.active_parameters / flops + per_token_comm_s,
        per_attention_unit_s=4 * model.facts.layers * model.facts.hidden_size / flops,
        per_decode_seq_s=2 * model.active_parameters / flops + SAMPLING_PER_SEQ_S + per_token_comm_s,
        per_context_token_s=model.kv_bytes_per_token / bandwidth,
    )
    load_time_s = 6.0 + model.weight_bytes / 1e9 / 1.3 / tp + (15.0 if tp > 1 else 0.0)
    return ShapeProfile(round(load_time_s, 2), kv_tokens, latency)


def analytic_profile(model: CatalogModel, gpu: GpuSpec) -> Profile:
    shapes = {}
    for tp in (1, 2, 4, 8):
        shape = shape_profile(model, gpu, tp)
        if shape is not None:
            shapes[ReplicaShape(tp, tp).key] = shape
    lengths = lognormal_lengths(model.length_mean, model.length_median, model.facts.max_model_len)
    engine = {**ENGINE_SETTINGS, "max_model_len": model.facts.max_model_len}
    return Profile("analytic", gpu.name, model.name, engine, model.facts, shapes, lengths,
                   notes={"method": "roofline", "compute_efficiency": COMPUTE_EFFICIENCY, "memory_efficiency": MEMORY_EFFICIENCY,
                          "nvlink_group": gpu.nvlink_group})


def write_all(root: Path) -> list[Path]:
    gpus, models = load_catalog()
    written = []
    for gpu in gpus.values():
        for model in models.values():
            directory = root / gpu.name / model.name
            analytic_profile(model, gpu).save(directory)
            written.append(directory)
    return written


if __name__ == "__main__":
    for directory in write_all(CATALOG.parent):
        print(directory)
