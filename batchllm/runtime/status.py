"""The status file of a run (`<out>/.batchllm/status.json`) and what `batchllm status` shows.

Invariant: the running driver is the only writer; it rewrites the file every few seconds
and at its end, atomically (`core.files`), so a reader sees the old file or
the new one, never a part. A file that says "running" whose driver process is gone
(killed, crashed) describes an interrupted run, and is reported so.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.files import write_text_atomically
from batchllm.runtime.run_dir import RunDir

END_STATES = ("finished", "incomplete", "interrupted")
STATES = ("running", *END_STATES)
ADVICE = {
    "interrupted": "run the same `batchllm run` command again to resume",
    "incomplete": "a node failed (its cause was printed); fix it and run the same command again",
}


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class NodeStatus:
    model: str
    committed: int
    total: int
    failed: int  # results whose finish_reason starts with "error:"; these three count every invocation's results
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float  # this invocation's
    eta_s: float | None  # None: no rate known yet
    failure: str | None = None  # why the node stopped with work left (its engine's failure); None: it did not fail
    servers: tuple[str, ...] = ()  # a node on servers: per server, what its latency guard allows and reads
    reused: int = 0  # of `committed`, units taken from the result store (computed by earlier runs)


@dataclass(frozen=True)
class RunStatus:
    state: str  # one of STATES
    elapsed_s: float
    nodes: dict[str, NodeStatus]
    pid: int = field(default_factory=os.getpid)
    started_at: str = field(default_factory=_now_iso)  # ISO 8601, UTC
    updated_at: str = field(default_factory=_now_iso)
    rest_s: float | None = None  # the calibrated cost model's time to the run's end; None: not estimated


def write_status(path: Path, status: RunStatus) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = asdict(status)
    if body["rest_s"] is None:
        del body["rest_s"]  # a run without a calibrated estimate writes the file it always wrote
    for node in body["nodes"].values():
        if node["failure"] is None:
            del node["failure"]
        if not node["reused"]:
            del node["reused"]  # a run that reused nothing writes the file it always wrote
    write_text_atomically(path, json.dumps(body, indent=1) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def earlier_status(path: Path) -> RunStatus | None:
    """The status file a run finds in its folder as it starts (None: none, or one it cannot read)."""
    try:
        return read_status(path.parent.parent) if path.is_file() else None
    except UserError:
        return None


def read_status(out: Path) -> RunStatus:
    """The run's status; "running" becomes "interrupted" when its driver is gone."""
    path = RunDir(out).status_path
    if not path.is_file():
        if path.parent.is_dir():
            raise UserError(f"{str(out)!r} holds a batchllm run that has not written {path.relative_to(out)} (an older batchllm, or "
                            "a run stopped before it began)", where="OUT", hint="run the same `batchllm run` command again")
        raise UserError(f"{str(out)!r} has no batchllm run", where="OUT",
                        hint="give the --out folder of a run, or start one with `batchllm run DAG --out OUT`")
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(RunStatus)}
        nodes = {name: NodeStatus(**{**node, "servers": tuple(node.get("servers", ()))}) for name, node in data["nodes"].items()}
        status = RunStatus(**{k: v for k, v in data.items() if k in known and k != "nodes"}, nodes=nodes)
        if status.state not in STATES:
            raise ValueError(f"unknown state {status.state!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        why = f"no {error.args[0]!r} field" if isinstance(error, KeyError) else str(error)
        raise UserError(f"{str(path)!r} is not a status file this batchllm can read ({why})", where="OUT",
                        hint="run the same `batchllm run` command again to rewrite it") from None
    if status.state == "running" and not _alive(status.pid):
        status = replace(status, state="interrupted")
    return status


def format_duration(seconds: float) -> str:
    """h:mm:ss, e.g. 3661 -> 1:01:01."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_time_left(seconds: float) -> str:
    """Time left as people read it: 42s, 7m05s, 3h12m, 2d04h (not h:mm:ss, which reads as a clock time)."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
    return f"{seconds // 86400}d{seconds // 3600 % 24:02d}h"


def ends_at(seconds: float, now: datetime | None) -> str:
    """` (ends 2026-11-25 18:02 UTC)`: when something `seconds` from `now` ends; empty when
    `now` is unknown or nothing is left."""
    if now is None or seconds < 1:
        return ""
    return f" (ends {(now + timedelta(seconds=seconds)).astimezone(UTC):%Y-%m-%d %H:%M} UTC)"


def eta_text(seconds: float | None, now: datetime | None) -> str:
    """`ETA 3h12m (ends 2026-11-25 18:02 UTC)`, `ETA ?` while unknown."""
    return "ETA ?" if seconds is None else f"ETA {format_time_left(seconds)}{ends_at(seconds, now)}"


def _parsed(iso: str) -> datetime | None:
    try:
        return datetime.fromisoformat(iso)
    except ValueError:
        return None


def status_lines(out: Path, status: RunStatus) -> list[str]:
    """What `batchllm status` prints: a head line, then two short lines per node (80 columns).
    Times left count from the status's `updated_at`."""
    updated = _parsed(status.updated_at)
    left = (f", about {format_time_left(status.rest_s)} left{ends_at(status.rest_s, updated)}"
            if status.state == "running" and status.rest_s is not None else "")
    lines = [f"{out}: {status.state}, {format_duration(status.elapsed_s)} elapsed{left} (updated {status.updated_at})"]
    if status.state in ADVICE:
        lines.append(f"  {ADVICE[status.state]}")
    for name, node in status.nodes.items():
        share = f" ({node.committed / node.total:.0%})" if node.total else ""
        failed = f", {node.failed:,} failed" if node.failed else ""
        failed += f", {node.reused:,} reused" if node.reused else ""
        eta = "" if status.state != "running" else f", {eta_text(node.eta_s, updated)}"
        lines.append(f"{name}: {node.committed:,}/{node.total:,} units{share}{failed}{eta}")
        lines.append(f"  tokens: prompt {node.prompt_tokens:,}, output {node.output_tokens:,}, "
                     f"{node.output_tokens_per_s:,.0f} output tok/s")
        lines += [f"  server {server}" for server in node.servers] if status.state == "running" else []
        if node.failure:
            lines.append(f"  failed: {node.failure}")
    return lines


def status_json(status: RunStatus) -> dict:
    """What `batchllm status --json` prints."""
    return {"state": status.state, "started_at": status.started_at, "updated_at": status.updated_at,
            "elapsed_s": status.elapsed_s, **({"rest_s": status.rest_s} if status.rest_s is not None else {}), "pid": status.pid,
            "nodes": {name: {"model": n.model, "committed": n.committed, "total": n.total, "failed": n.failed,
                             "prompt_tokens": n.prompt_tokens, "output_tokens": n.output_tokens,
                             "output_tokens_per_s": n.output_tokens_per_s, "eta_s": n.eta_s,
                             **({"reused": n.reused} if n.reused else {}),
                             **({"failure": n.failure} if n.failure else {}), **({"servers": list(n.servers)} if n.servers else {})}
                      for name, n in status.nodes.items()}}
