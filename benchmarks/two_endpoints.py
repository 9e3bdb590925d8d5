"""Two servers of one model, one of them slower: do they end together?

Two real vLLM OpenAI servers of the embedded model on 127.0.0.1, one core each: server A
with vLLM's default of 128 sequences at once, server B held to `--slow-seqs` (4), so it
runs several times slower. `batchllm run` sends one node of real prompts to both
(`endpoints:` with both URLs, no SLO: the latency guard's default). Each server's end is
the last moment its `vllm:generation_tokens_total` grew (scraped every 0.5 s). Target: the
two ends differ by at most 10 % of the run (the split by predicted work, then the faster
server taking the back half of the slower one's queue when its own runs dry, as long as more
wait there than the slower server runs).

Last line: `ends differ by <x> % of the run (<a> s vs <b> s of <r> s); A answered <n> %`.

    .venv/bin/python benchmarks/two_endpoints.py [--rows 600] [--max-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coserve import MODEL, load_prompts, scrape_sync, start_server, stop_process, wait_healthy, write_batch_input  # noqa: E402

from batchllm.models.embedded import SMOLLM2_135M  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402

SCRAPE_S = 0.5
RUN_TIMEOUT_S = 1800


def write_dag(folder: Path, batch_file: Path, urls: list[str], max_tokens: int) -> Path:
    path = folder / "two.yaml"
    path.write_text(f"""name: two-endpoints
inputs:
  rows: {{path: {batch_file}, id_column: id}}
endpoints:
  {MODEL}:
    urls: [{', '.join(urls)}]
nodes:
  answer:
    model: {MODEL}
    prompt: '{{{{ prompt }}}}'
    sampling: {{max_tokens: {max_tokens}}}
outputs:
  answers: {{columns: {{answer: answer}}}}
""")
    return path


class EndWatch:
    """Scrapes each server until stopped; a server's end is the last time its generated tokens grew."""

    def __init__(self, bases: list[str]):
        self.bases, self.last_growth = bases, {b: None for b in bases}
        self.tokens = dict.fromkeys(bases, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> EndWatch:
        self.started = time.monotonic()
        self.first = {b: (scrape_sync(b).generation_tokens or 0.0) for b in self.bases}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.wait(SCRAPE_S):
            for base in self.bases:
                try:
                    tokens = (scrape_sync(base).generation_tokens or 0.0) - self.first[base]
                except Exception:  # noqa: BLE001  a scrape missed: the next one counts
                    continue
                if tokens > self.tokens[base]:
                    self.tokens[base], self.last_growth[base] = tokens, time.monotonic() - self.started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slow-seqs", type=int, default=4, help="server B's --max-num-seqs (A: 128)")
    parser.add_argument("--ports", default="8441,8442")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    ports = [int(p) for p in args.ports.split(",")]
    work = Path(tempfile.mkdtemp(prefix="two-endpoints-"))
    model_dir = SMOLLM2_135M.prepare(batchllm_home())
    servers = []
    try:
        for core, (port, seqs) in enumerate(zip(ports, (128, args.slow_seqs))):
            servers.append(start_server(model_dir, port, core, seqs, work / f"server-{core}.log"))
        bases = [f"http://127.0.0.1:{p}" for p in ports]
        for base, server, core in zip(bases, servers, (0, 1)):
            wait_healthy(base, server, work / f"server-{core}.log")
        _, batch = load_prompts(seed=0)
        batch_file = write_batch_input(work, batch[:args.rows], args.rows)
        dag = write_dag(work, batch_file, [f"{b}/v1" for b in bases], args.max_tokens)
        say(f"two-endpoints: {args.rows} rows x max_tokens {args.max_tokens}; server A (core 0, 128 seqs), "
            f"server B (core 1, {args.slow_seqs} seqs)")
        batchllm = str(Path(sys.executable).parent / "batchllm")
        with EndWatch(bases) as watch:
            done = subprocess.run([batchllm, "run", str(dag), "--out", str(work / "out"), "--fresh"], capture_output=True,
                                  text=True, timeout=RUN_TIMEOUT_S, cwd=work)
            run_s = time.monotonic() - watch.started
            time.sleep(2 * SCRAPE_S)
        if done.returncode != 0:
            raise SystemExit(f"batchllm run exited {done.returncode}:\n{done.stderr[-3000:]}")
        ends = [watch.last_growth[b] or 0.0 for b in bases]
        share = watch.tokens[bases[0]] / max(sum(watch.tokens.values()), 1.0)
        for name, base, end in zip("AB", bases, ends):
            say(f"server {name}: {watch.tokens[base]:,.0f} output tokens, last at {end:.1f} s")
        say(f"run: {run_s:.1f} s (batchllm's command, start to exit)")
        say(f"ends differ by {abs(ends[0] - ends[1]) / run_s:.1%} of the run ({ends[0]:.1f} s vs {ends[1]:.1f} s of {run_s:.1f} s); "
            f"A answered {share:.0%}")
    finally:
        for server in servers:
            stop_process(server, signal.SIGTERM)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
