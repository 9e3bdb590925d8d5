"""The local profile store: what runs (and `batchllm profile --quick`) measured on this
machine, so the next plan starts from it.

    $BATCHLLM_HOME/profiles/<hardware folder>-<identity digest>/<model>-<settings digest>/
        profile.json, output_lengths.csv   a Profile of kind "learnt" (Profile.save)
        store.json                          its key in full, when and from what it was learnt

The key is the hardware identity (every field: CPU name, kernel flags, dtype; GPU name,
memory, count), the model's profile name, and the engine settings a run knows before it
starts (`KEY_SETTINGS` of `planner.cluster.run_settings`): a different machine, engine
version or dtype finds nothing and starts from the shipped profile. Committed profiles
under `profiles/` are never written. A save replaces the entry whole (written beside it,
then renamed), so a reader sees the old entry or the new one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.files import replacing
from batchllm.costmodel.profile import Profile
from batchllm.engines.hardware import HardwareIdentity

STORE_FOLDER = "profiles"
RECORD_FILE = "store.json"
LORA_SETTING = "lora_adapters"  # an engine that serves LoRA adapters: learnt apart from the base's (costmodel.lora_cost)
# LORA_SETTING's value for such an engine: the revision of the LoRA path batchllm's engines run (on CPUs its own
# ops, engines/cpu_lora_ops.py), so that a profile learnt on older ops is not taken for these: skipping the modules
# no adapter targets made adapter steps 1.7x faster in decode (lora-step-cost-2026-11-29-avx512-skipped-slices.txt),
# and the profile learnt before it then over-estimated a 300-question run 3.3x (57 s ran, 189 s estimated).
LORA_REVISION = "cpu-ops-2"
KEY_SETTINGS = ("engine_version", "dtype", "enforce_eager", "max_num_seqs", LORA_SETTING)


def _digest(body: object) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:10]


def hardware_folder(identity: HardwareIdentity) -> str:
    """The folder of everything kept for this hardware identity."""
    return f"{identity.folder_name}-{_digest(identity.to_dict())}"


def key_settings(settings: dict[str, object]) -> dict[str, object]:
    """The settings that key an entry: those of KEY_SETTINGS the run knows."""
    return {key: settings[key] for key in KEY_SETTINGS if key in settings}


@dataclass(frozen=True)
class StoredProfile:
    profile: Profile
    record: dict  # store.json: identity, model, settings, saved_at, runs, source, evidence
    folder: Path

    def describe(self) -> str:
        """`learnt on this machine (2 runs, last 2026-11-23T08:40:00+00:00 from dag w1: 812 steps, 150 outputs)`."""
        evidence = self.record.get("evidence", {})
        runs = int(self.record.get("runs", 1))
        return (f"learnt on this machine ({runs} run{'s' if runs != 1 else ''}, last {self.record.get('saved_at', '?')} "
                f"from {self.record.get('source', '?')}: {int(evidence.get('steps', 0)):,} steps, "
                f"{int(evidence.get('outputs', 0)):,} outputs; {self.folder})")


@dataclass(frozen=True)
class ProfileStore:
    root: Path

    @classmethod
    def at_home(cls, home: Path) -> ProfileStore:
        return cls(Path(home) / STORE_FOLDER)

    def folder(self, identity: HardwareIdentity, model: str, settings: dict[str, object]) -> Path:
        return self.root / hardware_folder(identity) / f"{model.replace('/', '_')}-{_digest(key_settings(settings))}"

    def load(self, identity: HardwareIdentity, model: str, settings: dict[str, object]) -> StoredProfile | None:
        """The entry for this key, or None when there is none."""
        folder = self.folder(identity, model, settings)
        if not (folder / RECORD_FILE).is_file():
            return None
        try:
            record = json.loads((folder / RECORD_FILE).read_text())
            return StoredProfile(Profile.load(folder), record, folder)
        except (ValueError, KeyError, TypeError, OSError) as error:
            raise UserError(f"the learnt profile in {str(folder)!r} cannot be read ({error})",
                            hint="delete that folder; the next run learns it again") from error

    def save(self, profile: Profile, identity: HardwareIdentity, settings: dict[str, object], *, source: str,
             evidence: dict[str, object]) -> Path:
        """Write `profile` (kind "learnt") as the entry for this key, replacing the old one."""
        folder = self.folder(identity, profile.model, settings)
        previous = self.load(identity, profile.model, settings) if (folder / RECORD_FILE).is_file() else None
        record = {"identity": identity.to_dict(), "model": profile.model, "settings": key_settings(settings),
                  "saved_at": datetime.now(UTC).isoformat(timespec="seconds"), "source": source,
                  "runs": (int(previous.record.get("runs", 1)) + 1) if previous else 1, "evidence": evidence}
        folder.parent.mkdir(parents=True, exist_ok=True)
        with replacing(folder) as fresh:
            profile.save(fresh.path)
            (fresh.path / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        return folder
