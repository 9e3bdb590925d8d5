"""What a command costs the user outside its engines' stages, measured and kept per host.

A command's **start** runs from its process's start to its first stage: the interpreter, the
imports, the checks of the DAG, its data and the engine settings (vLLM's own, which imports
vLLM), the model's preparation, the planning. Its **end** runs from its last result to its
return: the engines stopped, the outputs written, what it learnt filed. Neither is in the
stages the cost model simulates (engine starts and loads are: a stage pays its engines'
load times), yet the user waits for both: on an AVX2-only host about 40 s a command.

They are kept like step latencies, per host and per what they depend on: the hardware
identity (the profile store's folder), the command, and the DAG's models (the settings check
and the preparation are per model). A new measurement moves the kept one by a running mean
over at most KEPT_COMMANDS commands, so one slow start (a cold file cache) does not set it.

    $BATCHLLM_HOME/profiles/<hardware folder>-<identity digest>/commands.json
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from batchllm.core.files import write_text_atomically
from batchllm.costmodel.calibration.store import ProfileStore, hardware_folder
from batchllm.engines.hardware import HardwareIdentity

COMMANDS_FILE = "commands.json"
KEPT_COMMANDS = 8  # a new measurement weighs at least 1/8


@dataclass(frozen=True)
class CommandTimes:
    start_s: float
    end_s: float
    commands: int = 1  # how many commands measured it
    checks_s: float = 0.0  # of the start: vLLM's settings check, which a later command skips while its verdict is kept

    @property
    def total_s(self) -> float:
        return self.start_s + self.end_s

    def with_measured(self, start_s: float, end_s: float, checks_s: float = 0.0) -> CommandTimes:
        weight = 1.0 / min(self.commands + 1, KEPT_COMMANDS)
        return CommandTimes(self.start_s + weight * (start_s - self.start_s), self.end_s + weight * (end_s - self.end_s),
                            self.commands + 1, self.checks_s + weight * (checks_s - self.checks_s))

    def with_checks_kept(self) -> CommandTimes:
        """As a later command of the same DAG would take it: vLLM's settings check answered by
        the verdict the first one kept (a `run` after `plan --pilot`)."""
        return CommandTimes(max(0.0, self.start_s - self.checks_s), self.end_s, self.commands, 0.0)


def command_key(command: str, models: Iterable[str]) -> str:
    """`run smollm2-135m`: the command and the DAG's models, sorted."""
    return " ".join([command, *sorted(set(models))])


@dataclass(frozen=True)
class CommandTimesStore:
    store: ProfileStore

    @classmethod
    def at_home(cls, home: Path) -> CommandTimesStore:
        return cls(ProfileStore.at_home(home))

    def path(self, identity: HardwareIdentity) -> Path:
        return self.store.root / hardware_folder(identity) / COMMANDS_FILE

    def load(self, identity: HardwareIdentity, key: str) -> CommandTimes | None:
        entry = self._entries(identity).get(key)
        return CommandTimes(**entry) if entry is not None else None

    def record(self, identity: HardwareIdentity, key: str, start_s: float, end_s: float, checks_s: float = 0.0) -> CommandTimes:
        """Fold one command's measured start (`checks_s` of it in vLLM's settings check) and end
        into what is kept for `key`, and keep it."""
        entries = self._entries(identity)
        kept = CommandTimes(**entries[key]).with_measured(start_s, end_s, checks_s) if key in entries \
            else CommandTimes(start_s, end_s, 1, checks_s)
        entries[key] = asdict(kept)
        path = self.path(identity)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
        return kept

    def _entries(self, identity: HardwareIdentity) -> dict[str, dict]:
        try:
            entries = json.loads(self.path(identity).read_text())
        except (OSError, ValueError):  # none kept yet, or unreadable: measured again from the next command
            return {}
        return {k: v for k, v in entries.items() if isinstance(v, dict) and {"start_s", "end_s", "commands"} <= set(v)} \
            if isinstance(entries, dict) else {}
