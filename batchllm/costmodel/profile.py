"""Profiles: what the cost model knows about one model on one kind of hardware.

On disk, `profiles/<hardware>/<model>/` holds plain files a person can read and diff:

    profile.json          engine settings, model facts, and per replica shape: load
                          time, KV capacity, fitted step-latency coefficients, fit error
    output_lengths.csv    the output-length CDF (length, cdf)
    steps-<shape>.csv     the raw step measurements the coefficients were fit on

`profile.json` also records the hardware identity the numbers were measured on
(`batchllm.engines.hardware`); a profile written before identities were recorded loads
with an unknown identity. A profile is used even where its hardware or engine settings
differ from a run's; `mismatches` names every difference, so none goes unsaid.

A replica shape is `w<devices>-tp<tp>`: a replica spanning that many devices with that
tensor-parallel degree (on GPUs w == tp; on CPUs w cores may serve one rank as threads).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from batchllm.core.errors import UserError
from batchllm.costmodel.latency import StepLatencyModel
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.engines.hardware import HardwareIdentity, differences

# Engine settings that change step times or scheduling; a profile taken with other
# values does not describe the run.
MATCHED_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "block_size_tokens", "dtype", "enforce_eager", "engine_version")


@dataclass(frozen=True)
class ReplicaShape:
    devices: int
    tp: int = 1

    @property
    def key(self) -> str:
        return f"w{self.devices}-tp{self.tp}"

    @classmethod
    def parse(cls, key: str) -> ReplicaShape:
        match = re.fullmatch(r"w(\d+)-tp(\d+)", key)
        if not match:
            raise ValueError(f"bad replica shape {key!r}; expected like 'w2-tp1'")
        return cls(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class ShapeProfile:
    load_time_s: float  # engine start until it can take requests
    kv_capacity_tokens: int
    latency: StepLatencyModel
    fit_median_error: float | None = None  # |predicted - measured| / measured over steps
    warmup_s: float = 0.0  # what a fresh engine's first steps take beyond the fitted model

    @property
    def start_cost_s(self) -> float:
        """What starting this replica costs before it runs at its measured speed."""
        return self.load_time_s + self.warmup_s


@dataclass(frozen=True)
class ModelFacts:
    parameters: int
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    max_model_len: int


@dataclass(frozen=True)
class Profile:
    kind: str  # "measured" | "analytic"
    hardware: str
    model: str
    engine: dict[str, Any]  # the engine settings it was measured with (JSON values)
    facts: ModelFacts
    shapes: dict[str, ShapeProfile]
    lengths: LengthDistribution
    notes: dict[str, object] = field(default_factory=dict)
    identity: HardwareIdentity | None = None  # what it was measured on; None: not recorded

    def shape(self, shape: ReplicaShape) -> ShapeProfile:
        if shape.key not in self.shapes:
            raise UserError(f"profile {self.hardware}/{self.model} has no replica shape {shape.key}",
                            hint=f"profiled shapes: {', '.join(self.shapes)}; run `batchllm profile` for more")
        return self.shapes[shape.key]

    def settings_differences(self, engine: dict[str, object]) -> list[str]:
        """One line per MATCHED_SETTINGS value of a run (`engine`, only the keys it knows)
        that differs from the profile's."""
        return [f"{key}: profile {self.engine.get(key, 'not recorded')}, run {engine[key]}"
                for key in MATCHED_SETTINGS if key in engine and engine[key] != self.engine.get(key)]

    def mismatches(self, here: HardwareIdentity | None, engine: dict[str, object], *, here_label: str = "this machine") -> list[str]:
        """Every way this profile may not describe a run on `here` (None: hardware not known,
        not compared) with engine settings `engine`: hardware differences, then settings. An
        analytic profile is computed for its hardware name, so only its settings are compared;
        the dtype is compared once, as part of the hardware when both identities are known."""
        if self.kind == "analytic" or here is None:
            return self.settings_differences(engine)
        hardware = differences(self.identity, here, here_label=here_label)
        settings = {key: value for key, value in engine.items() if key != "dtype" or self.identity is None}
        return hardware + self.settings_differences(settings)

    # -- files --------------------------------------------------------------
    def save(self, directory: Path, step_tables: dict[str, list[dict]] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        body = {
            "kind": self.kind, "hardware": self.hardware, "model": self.model, "engine": self.engine,
            "facts": asdict(self.facts), "notes": self.notes, "censored_at": self.lengths.censored_at,
            **({"identity": self.identity.to_dict()} if self.identity else {}),
            "shapes": {key: {"load_time_s": s.load_time_s, "warmup_s": s.warmup_s, "kv_capacity_tokens": s.kv_capacity_tokens,
                             "latency": s.latency.to_dict(), "fit_median_error": s.fit_median_error}
                       for key, s in self.shapes.items()},
        }
        (directory / "profile.json").write_text(json.dumps(body, indent=2) + "\n")
        _write_csv(directory / "output_lengths.csv", self.lengths.to_rows())
        for key, rows in (step_tables or {}).items():
            _write_csv(directory / f"steps-{key}.csv", rows)

    @classmethod
    def load(cls, directory: Path) -> Profile:
        path = directory / "profile.json"
        if not path.is_file():
            raise UserError(f"no profile at {str(directory)!r}", hint="run `batchllm profile`, or pick a profiled model")
        body = json.loads(path.read_text())
        with open(directory / "output_lengths.csv", newline="") as handle:
            rows = [{"length": int(r["length"]), "cdf": float(r["cdf"])} for r in csv.DictReader(handle)]
        shapes = {key: ShapeProfile(s["load_time_s"], s["kv_capacity_tokens"], StepLatencyModel(**s["latency"]),
                                    s.get("fit_median_error"), s.get("warmup_s", 0.0))
                  for key, s in body["shapes"].items()}
        identity = HardwareIdentity.from_dict(body["identity"]) if "identity" in body else None
        if identity is not None and identity.dtype is None:
            identity = replace(identity, dtype=body["engine"].get("dtype"))  # the dtype it ran is in its settings
        return cls(body["kind"], body["hardware"], body["model"], body["engine"], ModelFacts(**body["facts"]), shapes,
                   LengthDistribution.from_rows(rows, body["censored_at"]), body.get("notes", {}), identity)


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def profile_dir(root: Path, hardware: str, model: str) -> Path:
    return root / hardware / model


def find_profile(root: Path, hardware: str, model: str) -> Profile:
    """The measured profile if there is one, else the analytic one (profiles/analytic/...)."""
    for directory in (profile_dir(root, hardware, model), profile_dir(root / "analytic", hardware, model)):
        if (directory / "profile.json").is_file():
            return Profile.load(directory)
    raise UserError(f"no profile for model {model!r} on {hardware!r} under {str(root)!r}",
                    hint="run `batchllm profile` on that hardware, or add the model to profiles/analytic/catalog.yaml")
