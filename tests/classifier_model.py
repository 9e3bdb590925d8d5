"""A sequence-classification model made at test time, never downloaded: the embedded all-MiniLM-L6-v2
encoder (its weights, tokenizer and pooler) as a `BertForSequenceClassification` with a seeded
random classification head. Its labels mean nothing; its loading, pooling and head are vLLM's
real ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from testkit.lora_adapters import write_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def make_classifier(folder: Path, encoder: Path, labels: tuple[str, ...], *, seed: int, weight_std: float = 0.5) -> Path:
    """`encoder`: a BERT folder (config.json, model.safetensors, tokenizer); the classifier in `folder`."""
    from safetensors.numpy import load_file  # in the engine's environment, as the real-engine tests are

    config = json.loads((encoder / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={str(k): label for k, label in enumerate(labels)},
                  label2id={label: k for k, label in enumerate(labels)})
    weights = {f"bert.{name}": array for name, array in load_file(str(encoder / "model.safetensors")).items()
               if name != "embeddings.position_ids"}
    rng = np.random.default_rng(seed)
    weights["classifier.weight"] = rng.normal(0.0, weight_std, (len(labels), config["hidden_size"]))
    weights["classifier.bias"] = np.zeros(len(labels))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", weights)
    for name in TOKENIZER_FILES:
        if (encoder / name).is_file():
            shutil.copy2(encoder / name, folder / name)
    return folder
