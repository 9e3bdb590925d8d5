"""The status file of a run (`<out>/.batchllm/status.json`) and `batchllm status`.

The running driver rewrites the file every few seconds and at its end (atomically: a
reader sees the old file or the new one). A file that says "running" whose driver is
gone (killed, crashed) describes an interrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from batchllm.errors import UserError

STATUS_FILE = Path(".batchllm") / "status.json"


@dataclass(frozen=True)
class NodeStatus:
    model: str
    committed: int
    total: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    eta_s: float | None


@dataclass(frozen=True)
class RunStatus:
    state: str  # running | finished | incomplete | interrupted
    elapsed_s: float
    nodes: dict[str, NodeStatus]
    pid: int = field(default_factory=os.getpid)
    updated_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))


def write_status(path: Path, status: RunStatus) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(asdict(status), indent=1) + "\n")
    os.replace(temporary, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_status(out: Path) -> RunStatus:
    path = out / STATUS_FILE
    if not path.is_file():
        raise UserError(f"{str(out)!r} has no batchllm run", where="OUT",
                        hint="give the --out folder of a run, or start one with `batchllm run DAG --out OUT`")
    data = json.loads(path.read_text())
    nodes = {name: NodeStatus(**node) for name, node in data.pop("nodes").items()}
    status = RunStatus(**data, nodes=nodes)
    if status.state == "running" and not _alive(status.pid):
        status = replace(status, state="interrupted")
    return status


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def status_lines(out: Path, status: RunStatus) -> list[str]:
    """What `batchllm status` prints: fits 80 columns, one line per node."""
    advice = {"interrupted": " (run the same command again to resume)", "incomplete": " (a node failed; fix it and run again)"}
    lines = [f"{out}: {status.state}{advice.get(status.state, '')}, {format_duration(status.elapsed_s)} elapsed, "
             f"updated {status.updated_at}"]
    width = max((len(n) for n in status.nodes), default=4)
    for name, node in status.nodes.items():
        share = f"{node.committed / node.total:.0%}" if node.total else "-"
        eta = "" if status.state != "running" else f", ETA {'?' if node.eta_s is None else format_duration(node.eta_s)}"
        failed = f", {node.failed:,} failed" if node.failed else ""
        lines.append(f"  {name:<{width}}  {node.committed:,}/{node.total:,} ({share}){failed}, "
                     f"{node.output_tokens:,} output tok{eta}")
    return lines


def status_json(status: RunStatus) -> dict:
    return {"state": status.state, "elapsed_s": status.elapsed_s, "updated_at": status.updated_at,
            "nodes": {name: {"committed": n.committed, "total": n.total, "failed": n.failed, "prompt_tokens": n.prompt_tokens,
                             "output_tokens": n.output_tokens, "eta_s": n.eta_s} for name, n in status.nodes.items()}}
