"""LoRA adapters made at test time, never downloaded: PEFT's files (`adapter_config.json`,
`adapter_model.safetensors`) with seeded random weights on a base model's attention
projections. B is not zero (PEFT's own initialisation), so the adapted model's answers differ
from the base's. The safetensors file is written here (8 bytes of header length, the JSON
header, the raw little-endian tensors), so making one needs numpy only."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def make_lora_adapter(folder: Path, base_config: dict, *, seed: int, rank: int = 8, weight_std: float = 0.05) -> Path:
    """A LoRA adapter of `rank` on every layer's q_proj and v_proj of the base `base_config` describes."""
    hidden, layers = base_config["hidden_size"], base_config["num_hidden_layers"]
    heads = base_config["num_attention_heads"]
    kv_width = base_config.get("num_key_value_heads", heads) * base_config.get("head_dim", hidden // heads)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module, width in (("q_proj", hidden), ("v_proj", kv_width)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0.0, weight_std, (rank, hidden))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0.0, weight_std, (width, rank))
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": base_config.get("_name_or_path", "base")}))
    return folder


TINY_BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 32}  # a config for tests whose engine is scripted
