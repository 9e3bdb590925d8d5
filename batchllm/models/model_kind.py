"""What a model directory can do, read from its files without loading its weights: whether it
generates text (a language-model head), the size of the vectors it embeds into, and the labels
a classification head gives (its config's `id2label` in id order, else `LABEL_<k>` for each of
its `num_labels`, as transformers names them).

The vector size follows sentence-transformers' files where they are: the last `Dense`
module's `out_features`, else the pooling module's `word_embedding_dimension`; else the
model's `hidden_size` (what vLLM pools a model without those files into).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATING_ARCHITECTURES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


@dataclass(frozen=True)
class ModelKind:
    architectures: tuple[str, ...]
    vector_dimensions: int | None  # None: its config names no size
    labels: tuple[str, ...] = ()  # a classification head's, in id order
    image_tokens: int | None = None  # prompt tokens an image takes (see `_image_tokens`); None: the model sees no images
    image_token: str = "<image>"  # its processor's placeholder for an image in the prompt, one per image

    @property
    def sees_images(self) -> bool:
        """A vision-language model: its config has a vision tower's (`vision_config`)."""
        return self.image_tokens is not None

    @property
    def generates(self) -> bool:
        """A model with a language-model head (an encoder such as BertModel has none)."""
        return any(a.endswith(GENERATING_ARCHITECTURES) for a in self.architectures)

    @property
    def classifies(self) -> bool:
        """A model with a classification head (a cross-encoder such as BertForSequenceClassification)."""
        return any(a.endswith("ForSequenceClassification") for a in self.architectures)

    @classmethod
    def of(cls, config_dir: Path) -> ModelKind:
        config = _json(config_dir / "config.json") or {}
        architectures = tuple(config.get("architectures") or ())
        size = config.get("hidden_size") or config.get("d_model")
        modules = _json(config_dir / "modules.json")
        if isinstance(modules, list):
            for module in modules:
                kind, path = str(module.get("type", "")), str(module.get("path", ""))
                module_config = _json(config_dir / path / "config.json") if path else None
                if module_config is None:
                    continue
                if kind.endswith(".Pooling") and module_config.get("word_embedding_dimension"):
                    size = module_config["word_embedding_dimension"]
                elif kind.endswith(".Dense") and module_config.get("out_features"):
                    size = module_config["out_features"]
        processor = _json(config_dir / "processor_config.json")
        processor = processor if isinstance(processor, dict) else {}
        return cls(architectures, int(size) if size else None, _labels(config), _image_tokens(config, processor),
                   str(processor.get("image_token") or "<image>"))


def _image_tokens(config: dict, processor: dict) -> int | None:
    """Prompt tokens per image, from the files (vLLM's processor gives the exact count at run time):
    Idefics3 and SmolVLM without image splitting, the processor's `image_seq_len` and the 3 tokens
    around it; otherwise one token per patch of the vision tower's input (LLaVA's default).
    A model that splits images into tiles takes more: this is a floor."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    if isinstance(processor.get("image_seq_len"), int):
        return processor["image_seq_len"] + 3
    size, patch = vision.get("image_size"), vision.get("patch_size")
    if isinstance(size, int) and isinstance(patch, int) and patch > 0:
        return (size // patch) ** 2 // int(config.get("scale_factor") or 1) ** 2
    return 1


def _labels(config: dict) -> tuple[str, ...]:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            return tuple(str(label) for _, label in sorted((int(k), v) for k, v in id2label.items()))
        except ValueError:
            return ()
    count = config.get("num_labels")
    return tuple(f"LABEL_{k}" for k in range(count)) if isinstance(count, int) and count > 0 else ()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
