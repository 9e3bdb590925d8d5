"""A LoRA adapter directory (PEFT's files: `adapter_config.json` and `adapter_model.safetensors`),
read without loading its weights: its rank, the layers and modules it adapts with their input
widths (from the safetensors header); and, on request, a digest of its files' bytes.

What it is checked against: the base model's `config.json` (each adapted module's input width
and layer must exist in the base: an adapter made for another base fails here, not in the
engine) and vLLM's LoRA ranks (`max_lora_rank` takes one of ENGINE_RANKS).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices (vllm.config.lora.MaxLoRARanks)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> layer 3, module q_proj
LORA_A = re.compile(r"\.layers\.(\d+)\.(?:[a-z_]+\.)?([a-z_]+)\.lora_A(?:\.[a-z_]+)?\.weight$")


class AdapterError(ValueError):
    """What is wrong with an adapter directory, and how to fix it."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class LoraAdapter:
    path: Path
    rank: int
    in_features: dict[str, int]  # adapted module (q_proj, v_proj, ...) -> its input width
    layers: int  # one more than the highest layer it adapts

    @classmethod
    def read(cls, path: Path) -> LoraAdapter:
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not path.is_dir():
            raise AdapterError(f"adapter directory {str(path)!r} does not exist", "give the folder PEFT's save_pretrained wrote")
        missing = [p.name for p in (config_path, weights_path) if not p.is_file()]
        if missing:
            raise AdapterError(f"adapter directory {str(path)!r} has no {' and no '.join(missing)}",
                               f"give the folder PEFT's save_pretrained wrote ({CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as error:
            raise AdapterError(f"{config_path} is not JSON: {error}", "give the file PEFT wrote") from None
        if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA" or not isinstance(config.get("r"), int):
            raise AdapterError(f"{config_path} is not a LoRA adapter's config (peft_type LORA, an integer r)",
                               "batchllm runs LoRA adapters only")
        header = _safetensors_header(weights_path)
        widths: dict[str, int] = {}
        layers = 0
        for name, tensor in header.items():
            found = LORA_A.search(name)
            if found and isinstance(tensor, dict) and len(tensor.get("shape", ())) == 2:
                widths[found.group(2)] = int(tensor["shape"][1])
                layers = max(layers, int(found.group(1)) + 1)
        if not widths:
            raise AdapterError(f"{weights_path} holds no lora_A weights of numbered layers", "give the file PEFT wrote")
        return cls(path, int(config["r"]), widths, layers)

    def digest(self) -> str:
        """sha256 of its config and weights files (read whole: for fingerprints, once a run)."""
        digest = hashlib.sha256()
        for file in (self.path / CONFIG_FILE, self.path / WEIGHTS_FILE):
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()[:32]

    def engine_rank(self) -> int:
        """The smallest `max_lora_rank` vLLM takes that holds this adapter's rank; AdapterError over the largest."""
        for rank in ENGINE_RANKS:
            if rank >= self.rank:
                return rank
        raise AdapterError(f"adapter {str(self.path)!r} has rank {self.rank}, over the {ENGINE_RANKS[-1]} vLLM's engine takes",
                           f"use an adapter of rank <= {ENGINE_RANKS[-1]}")

    def misfit(self, base_config: dict) -> str | None:
        """Why the adapter does not fit a base model's config (another base), or None."""
        hidden = base_config.get("hidden_size")
        heads, head_dim = base_config.get("num_attention_heads"), base_config.get("head_dim")
        attention = heads * (head_dim or hidden // heads) if isinstance(heads, int) and isinstance(hidden, int) else None
        expected = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "gate_proj": hidden, "up_proj": hidden,
                    "o_proj": attention, "down_proj": base_config.get("intermediate_size")}
        for module, width in sorted(self.in_features.items()):
            if expected.get(module) is not None and expected[module] != width:
                return f"its {module} takes {width} inputs where the base's takes {expected[module]}"
        layers = base_config.get("num_hidden_layers")
        if isinstance(layers, int) and self.layers > layers:
            return f"it adapts layer {self.layers - 1}, and the base has {layers} layers"
        return None


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets} (8 bytes of length, then JSON)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise AdapterError(f"{path} is not a safetensors file: {error}", "give the file PEFT wrote") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a safetensors file: its header is not a mapping", "give the file PEFT wrote")
    return header
