"""The service's page (`GET /`): every batch with its progress, plain HTML made on the server.

No script and no front-end build: a `<meta http-equiv="refresh">` reloads it every
REFRESH_S seconds; at most 80 characters wide (a monospace column of 80ch), so it reads
in a narrow terminal browser too. Each batch shows its status, a `<progress>` bar of its
finished lines, the time left (the run's own estimate) and its output tokens a second while
it runs, and links to its input, output and error files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from batchllm.runtime.status import format_time_left

REFRESH_S = 3
SHOWN = 100  # batches on the page, newest first

STYLE = """body{font-family:monospace;max-width:80ch;margin:1em auto;padding:0 1ch;line-height:1.4}
h1{font-size:1.2em} .batch{border-top:1px solid #aaa;padding:.4em 0} progress{width:40ch;vertical-align:middle}
.completed{color:#176c2a} .failed,.expired{color:#a31515} .cancelled,.cancelling{color:#8a5a00}"""


@dataclass(frozen=True)
class BatchView:
    batch: dict  # the Batch object, with live request counts
    eta_s: float | None = None
    output_tokens_per_s: float | None = None


def _time(stamp: int | None) -> str:
    return "" if stamp is None else f"{datetime.fromtimestamp(stamp, UTC):%Y-%m-%d %H:%M:%S} UTC"


def _file_link(label: str, file_id: str | None) -> str:
    if not file_id:
        return ""
    return f'{label} <a href="/v1/files/{escape(file_id)}/content">{escape(file_id)}</a>'


def _batch(view: BatchView) -> str:
    b = view.batch
    counts = b.get("request_counts") or {"total": 0, "completed": 0, "failed": 0}
    total, done, failed = counts["total"], counts["completed"], counts["failed"]
    status = escape(b["status"])
    lines = [f'<div><b>{escape(b["id"])}</b> <span class="status {status}">{status}</span></div>',
             f"<div>{escape(b['endpoint'])}, created {_time(b['created_at'])}</div>"]
    bar = f'<progress value="{done + failed}" max="{max(total, 1)}">{done + failed}/{total}</progress>'
    lines.append(f"<div>{bar} {done + failed:,}/{total:,} ({done:,} ok, {failed:,} failed)</div>")
    if b["status"] == "in_progress":
        pace = [f"ETA {format_time_left(view.eta_s)}" if view.eta_s is not None else "ETA ?"]
        if view.output_tokens_per_s is not None:
            pace.append(f"{view.output_tokens_per_s:,.0f} output tok/s")
        lines.append(f"<div class=pace>{', '.join(pace)}</div>")
    for label in ("completed_at", "failed_at", "cancelled_at", "expired_at"):
        if b.get(label):
            lines.append(f"<div>{label.removesuffix('_at')} {_time(b[label])}</div>")
    links = [link for link in (_file_link("input", b["input_file_id"]), _file_link("output", b.get("output_file_id")),
                               _file_link("errors", b.get("error_file_id"))) if link]
    lines += [f"<div>{link}</div>" for link in links]
    for error in ((b.get("errors") or {}).get("data") or [])[:5]:
        where = f"line {error['line']}: " if error.get("line") is not None and "line" not in (error.get("message") or "") else ""
        lines.append(f"<div class=failed>{escape(where + (error.get('message') or ''))}</div>")
    if b.get("metadata"):
        lines.append("<div>" + escape(", ".join(f"{k}={v}" for k, v in b["metadata"].items())) + "</div>")
    return f'<div class="batch" id="{escape(b["id"])}">\n' + "\n".join(lines) + "\n</div>"


def render_page(views: Sequence[BatchView], files: int, stored_bytes: int) -> str:
    running = sum(v.batch["status"] == "in_progress" for v in views)
    head = (f"<p>{len(views):,} batches, {running:,} in progress; {files:,} files, {stored_bytes / 1e6:,.1f} MB stored. "
            f"API: <code>/v1</code> (OpenAI's Files and Batches).</p>")
    body = "\n".join(_batch(v) for v in views[:SHOWN]) or "<p>No batches yet.</p>"
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n<meta http-equiv="refresh" content="{REFRESH_S}">\n'
            f"<title>batchllm serve</title>\n<style>{STYLE}</style></head>\n<body>\n<h1>batchllm serve</h1>\n{head}\n{body}\n"
            "</body></html>\n")
