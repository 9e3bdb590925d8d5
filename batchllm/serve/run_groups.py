"""Run groups: batches that run as one DAG in one run folder, `<data>/runs/<group id>/`.

Batches queued together run together: the worker makes one group of the queued batches (at
most MAX_BATCHES, oldest first), and the planner runs their models side by side where that
is faster, as it runs the nodes of one DAG. Each batch's nodes carry its prefix (`b1_`, `b2_`,
...; none in a group of one), its results file is `results-<batch id>.jsonl`.

Invariant: a group's members and prefixes are fixed when it is made (`members.json`, written
before its first run and never changed), so every later run of the folder has the same node
names, and with them the same journals: a restart, a crash or a member's cancel resumes what
finished, never computes it again. A member cancelled or ended leaves the DAG of the next run;
the others go on. The group's id is its first member's batch id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchllm.core.files import write_text_atomically
from batchllm.serve.runner import JobBatch, RunJob

MAX_BATCHES = 8
MEMBERS_FILE = "members.json"


@dataclass(frozen=True)
class RunGroup:
    id: str
    prefixes: dict[str, str]  # batch id -> the prefix of its nodes, in the order the batches were queued

    def owns_node(self, batch_id: str, node: str) -> bool:
        return node.startswith(self.prefixes[batch_id])


class RunGroups:
    def __init__(self, runs: Path):
        self.runs = runs

    def folder(self, group_id: str) -> Path:
        return self.runs / group_id

    def run_dir(self, group_id: str) -> Path:
        return self.folder(group_id) / "run"

    def results(self, group_id: str, batch_id: str) -> Path:
        return self.folder(group_id) / f"results-{batch_id}.jsonl"

    def make(self, batch_ids: list[str]) -> RunGroup:
        """A new group of these batches (the one made of them before a crash, if there is one)."""
        if not batch_ids:
            raise ValueError("a run group needs at least one batch")
        group_id = batch_ids[0]
        if (self.folder(group_id) / MEMBERS_FILE).is_file():
            return self.get(group_id)
        prefixes = {batch_ids[0]: ""} if len(batch_ids) == 1 else {b: f"b{k}_" for k, b in enumerate(batch_ids, start=1)}
        self.folder(group_id).mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.folder(group_id) / MEMBERS_FILE, json.dumps({"prefixes": prefixes}, indent=1) + "\n")
        return RunGroup(group_id, prefixes)

    def get(self, group_id: str) -> RunGroup:
        return RunGroup(group_id, json.loads((self.folder(group_id) / MEMBERS_FILE).read_text())["prefixes"])

    def job(self, group: RunGroup, members: list[tuple[str, Path]], partial: str | None = None) -> RunJob:
        """The run of `members` (batch id, request file) of the group, on its folder."""
        batches = tuple(JobBatch(batch_id, requests, self.results(group.id, batch_id), group.prefixes[batch_id])
                        for batch_id, requests in members)
        return RunJob(group.id, batches, self.run_dir(group.id), self.folder(group.id) / "run.log", partial)
