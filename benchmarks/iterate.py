"""Edit a pipeline and run it again: what reuse through the result store saves, whole commands timed from outside.

    .venv/bin/python benchmarks/iterate.py [--questions 300] [--out benchmarks/results/iterate-<date>.txt]

The ensemble-and-judge DAG (dags/ensemble_judge.yaml: two generators and a judge, the embedded
model) over held-out ShareGPT first turns (profiles/prompts/first_turns.parquet from row 500 on,
20-600 characters: rows no test uses), in a home of its own with the models
linked in, each command a process of its own:

  first      `batchllm run` of the DAG (the store empty: everything computed, and filed)
  edited     the judge's prompt edited, `batchllm run` into a new folder: the generators' answers
             come from the store, the judge's are computed
  scratch    the edited DAG with --no-reuse into a new folder: what the edit costs without reuse
  unchanged  the edited DAG again into a new folder: every answer is in the store

Last line: `iterate: edited judge <a>x faster than from scratch; nothing changed: <t> s for the
whole command` (a = scratch / edited). Targets (issue 69): a >= 1.7, t <= 5.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.models.embedded import SMOLLM2_135M  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from benchmarks.reporting import host_line, publish  # noqa: E402

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
FIRST_UNUSED = 500
JUDGE_LINE = "Which answer is more helpful? Reply with A or B and one sentence why."
EDITED_LINE = "Which answer is better? Reply with A or B only."


def questions(count: int) -> list[str]:
    turns = pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()[FIRST_UNUSED:]
    picked = [t for t in turns if 20 <= len(t) <= 600][:count]
    if len(picked) < count:
        raise SystemExit(f"only {len(picked)} held-out questions of 20-600 characters; ask for fewer with --questions")
    return picked


def write_dags(work: Path, count: int) -> tuple[Path, Path]:
    """The example DAG over the held-out questions, and the same with its judge's prompt edited."""
    pq.write_table(pa.table({"id": [f"h{i:04d}" for i in range(count)], "question": questions(count)}), work / "questions.parquet")
    text = (REPO / "dags" / "ensemble_judge.yaml").read_text().replace("../examples/questions.parquet", str(work / "questions.parquet"))
    if JUDGE_LINE not in text:
        raise SystemExit("dags/ensemble_judge.yaml's judge prompt changed: update JUDGE_LINE")
    (work / "first.yaml").write_text(text)
    (work / "edited.yaml").write_text(text.replace(JUDGE_LINE, EDITED_LINE))
    return work / "first.yaml", work / "edited.yaml"


def timed(args: list[str], env: dict[str, str], log: Path) -> float:
    started = time.monotonic()
    with open(log, "w") as handle:
        done = subprocess.run([BATCHLLM, *args], env=env, stdout=handle, stderr=subprocess.STDOUT)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"`batchllm {' '.join(args)}` exited {done.returncode}: see {log}")
    return took


def summary(log: Path) -> str:
    """The lines of a run's summary that say what was taken from the store and what the engines did."""
    keep = ("units", "taken from the result store", "Nothing to compute", "stage", "before them")
    return "\n".join(f"    {line}" for line in log.read_text().splitlines() if any(k in line for k in keep) and "%" not in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    work = REPO / "benchmarks" / "results" / "iterate-work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "home").mkdir(parents=True)
    SMOLLM2_135M.prepare(batchllm_home())  # once, in the shared home; linked into this benchmark's own
    os.symlink(batchllm_home() / "models", work / "home" / "models")
    env = {**os.environ, "BATCHLLM_HOME": str(work / "home"), "BATCHLLM_STORE": str(work / "store.sqlite")}
    first, edited = write_dags(work, args.questions)
    lines = [f"iterate, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {host_line()}",
             f"ensemble-and-judge over {args.questions} held-out ShareGPT first turns; each command a process of its own"]
    times = {}
    for label, dag, extra in (("first", first, []), ("edited", edited, []), ("scratch", edited, ["--no-reuse"]),
                              ("unchanged", edited, [])):
        log = work / f"{label}.log"
        times[label] = timed(["run", str(dag), "--out", str(work / label), *extra], env, log)
        lines += [f"  {label:<9} {times[label]:7.1f} s  batchllm run {dag.name} {' '.join(extra)}".rstrip(), summary(log)]
    speedup = times["scratch"] / times["edited"]
    lines.append(f"iterate: edited judge {speedup:.2f}x faster than from scratch; nothing changed: {times['unchanged']:.1f} s "
                 f"for the whole command")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
