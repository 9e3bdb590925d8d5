"""The pure parts of `batchllm profile` (the engine parts run in the real-engine benchmark)."""

from __future__ import annotations

import json
import struct

from batchllm.costmodel.profile import ReplicaShape
from batchllm.engines.devices import DeviceSet
from batchllm.engines.protocol import StepRecord
from batchllm.profiling.profiler import feature_rows, model_facts, shapes_to_profile


def test_cpu_shapes_are_thread_widths_plus_tensor_parallel_where_heads_divide():
    assert shapes_to_profile(DeviceSet("cpu", (0, 1)), attention_heads=9) == [ReplicaShape(1, 1), ReplicaShape(2, 1)]
    assert shapes_to_profile(DeviceSet("cpu", (0, 1)), attention_heads=4) == [ReplicaShape(1, 1), ReplicaShape(2, 1), ReplicaShape(2, 2)]


def test_gpu_shapes_are_tensor_parallel_degrees_that_divide_the_heads():
    assert shapes_to_profile(DeviceSet("gpu", tuple(range(8))), attention_heads=40) == [ReplicaShape(1, 1), ReplicaShape(2, 2), ReplicaShape(4, 4), ReplicaShape(8, 8)]
    assert shapes_to_profile(DeviceSet("gpu", (0, 1, 2)), attention_heads=6) == [ReplicaShape(1, 1), ReplicaShape(2, 2)]


def test_step_features_approximate_prefill_attention_per_request():
    steps = [StepRecord(0.5, 100, 2, 0, 0, 0, 0), StepRecord(0.1, 0, 0, 8, 400, 0, 0)]
    assert feature_rows(steps).tolist() == [[100, 5000, 0, 0], [0, 0, 8, 400]]


def test_model_facts_count_parameters_from_the_safetensors_header(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2}))
    header = json.dumps({"a": {"dtype": "BF16", "shape": [8, 8], "data_offsets": [0, 128]},
                         "b": {"dtype": "BF16", "shape": [8], "data_offsets": [128, 144]}, "__metadata__": {}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(144))
    facts = model_facts(tmp_path, max_model_len=512)
    assert (facts.parameters, facts.layers, facts.kv_heads, facts.max_model_len) == (72, 2, 2, 512)
