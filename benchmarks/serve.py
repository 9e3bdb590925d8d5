"""`batchllm serve` against `batchllm run-batch` on the same file and cores.

    .venv/bin/python benchmarks/serve.py [--requests 203] [--rounds 2] [--out FILE]

The file: ShareGPT first turns (profiles/prompts/first_turns.parquet rows 300-503, 203 chat
requests for the embedded smollm2-135m, max_tokens 96, temperature 0). In turns, round after
round (the order swapped each round, so the machine's noise falls on both alike):

- `batchllm run-batch -i FILE -o OUT`: the whole command, start to exit;
- the service: a `batchllm serve` started beforehand (its start not counted: a service is up
  before its users come), then with the official `openai` client: upload the file, create the
  batch, poll it every 0.5 s, download its output file. Timed from the upload to the download.

Both with --no-reuse (every request computed) and a fresh folder each time. Each side's median;
the last line: `serve: <x>x the time of run-batch for the same file` (below 1: the service is faster).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.batch_files import sharegpt_chat_file  # noqa: E402
from benchmarks.reporting import publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
FIRST_ROW, MAX_TOKENS = 300, 96


def run_batch(requests: Path, folder: Path) -> float:
    started = time.monotonic()
    done = subprocess.run([BATCHLLM, "run-batch", "-i", str(requests), "-o", str(folder / "out.jsonl"), "--run-dir",
                           str(folder / "run"), "--no-reuse"], capture_output=True, text=True)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"run-batch failed ({done.returncode}): {done.stderr[-2000:]}")
    return took


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(requests: Path, folder: Path, lines: int) -> float:
    from openai import OpenAI

    port = free_port()
    with open(folder / "server.log", "wb") as log:
        server = subprocess.Popen([BATCHLLM, "serve", "--data", str(folder / "data"), "--port", str(port), "--no-reuse"],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up: {(folder / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        started = time.monotonic()
        with open(requests, "rb") as handle:
            uploaded = client.files.create(file=handle, purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        if batch.status != "completed" or batch.output_file_id is None:
            raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
        output = client.files.content(batch.output_file_id).text
        took = time.monotonic() - started
        if output.count("\n") != lines:
            raise SystemExit(f"the output has {output.count(chr(10))} lines, not {lines}")
        return took
    finally:
        server.terminate()
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=203)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"run-batch": [], "serve": []}
    lines = [f"serve vs run-batch: {args.requests} ShareGPT chat requests (rows {FIRST_ROW}-{FIRST_ROW + args.requests}), "
             f"max_tokens {MAX_TOKENS}, temperature 0, smollm2-135m, {os.cpu_count()} cores, {args.rounds} rounds"]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        requests = root / "requests.jsonl"
        sharegpt_chat_file(requests, FIRST_ROW, args.requests, MAX_TOKENS)
        for round_ in range(args.rounds):
            order = ["run-batch", "serve"] if round_ % 2 == 0 else ["serve", "run-batch"]
            for side in order:
                folder = root / f"{side}-{round_}"
                folder.mkdir()
                took = run_batch(requests, folder) if side == "run-batch" else serve(requests, folder, args.requests)
                times[side].append(took)
                lines.append(f"round {round_ + 1}: {side} {took:.1f} s")
                print(lines[-1], flush=True)
    medians = {side: statistics.median(values) for side, values in times.items()}
    lines.append(f"medians: run-batch {medians['run-batch']:.1f} s (whole command), serve {medians['serve']:.1f} s (upload to "
                 "downloaded output, server already up)")
    lines.append(f"serve: {medians['serve'] / medians['run-batch']:.2f}x the time of run-batch for the same file")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
