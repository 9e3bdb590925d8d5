"""A command's engines start while its driver checks and plans (runtime/early_engines.py), on the
real engine and the embedded model (slow: marked `engine`), as a user runs `batchllm run`:

1. a first command keeps the engines its plan started first in its home;
2. a command of the same models, devices and settings over bad data starts them at once, and its
   check stops them before its exit 2, nothing written;
3. a good command adopts the engine it started early: its run folder's engine log is a link to
   the early engine's log in the home.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the prepared models, shared with the other real-engine tests
BATCHLLM = str(Path(sys.executable).parent / "batchllm")

DAG = """\
name: early
inputs:
  questions: {{path: {rows}, id_column: id}}
nodes:
  answer:
    model: smollm2-135m
    prompt: "{{{{ question }}}}"
    sampling: {{max_tokens: 4, temperature: 0}}
outputs:
  answers: {{columns: {{id: id, answer: answer}}}}
"""


def dag_over(folder: Path, column: str) -> Path:
    rows = folder / "rows.parquet"
    pq.write_table(pa.table({"id": ["q1", "q2"], column: ["What is a prime number?", "Why is the sky blue?"]}), rows)
    path = folder / "dag.yaml"
    path.write_text(DAG.format(rows=rows))
    return path


def command(dag: Path, out: Path, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([BATCHLLM, "run", str(dag), "--out", str(out), "--devices", "cpu:1", "--no-reuse"],
                          env={**os.environ, "BATCHLLM_HOME": str(home)}, capture_output=True, text=True, timeout=900)


def holders(path: Path) -> list[int]:
    """Processes that have `path` open."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:
            continue
    return found


def test_engines_start_while_the_driver_checks_a_bad_input_stops_them_and_a_good_one_adopts_them(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(MODEL_HOME / "models")  # the prepared models; the rest of the home is this test's
    good, bad = (tmp_path / "good", tmp_path / "bad")
    good.mkdir()
    bad.mkdir()

    first = command(dag_over(good, "question"), tmp_path / "out1", home)
    assert first.returncode == 0, first.stderr[-3000:]
    [kept] = json.loads((home / "first-engines.json").read_text()).values()
    assert [c["replica"]["device_ids"] for c in kept["configs"]] == [[0]]
    assert not (home / "engine-logs").exists()  # nothing was kept before it: it started no engine early

    refused = command(dag_over(bad, "query"), tmp_path / "out2", home)  # the prompt's column is missing
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "question" in refused.stderr and not (tmp_path / "out2").exists()
    [early_log] = (home / "engine-logs").glob("*.log")  # it started the kept engine as it began
    header = early_log.read_text().splitlines()[0]
    assert header.startswith("batchllm: engine process ") and "started early" in header
    engine_pid = int(header.split()[3])
    assert not Path(f"/proc/{engine_pid}").exists() and holders(early_log) == []  # and no engine outlived the command

    again = command(dag_over(good, "question"), tmp_path / "out3", home)
    assert again.returncode == 0, again.stderr[-3000:]
    [run_log] = (tmp_path / "out3" / ".batchllm" / "logs").glob("engine-*.log")
    adopted = run_log.resolve()
    assert run_log.is_symlink() and adopted.parent == (home / "engine-logs").resolve() and adopted != early_log.resolve()
    assert "started early" in adopted.read_text().splitlines()[0] and "Resolved architecture" in adopted.read_text()  # vLLM's lines follow
    answers = pq.read_table(tmp_path / "out3" / "answers.parquet").to_pylist()
    assert [a["id"] for a in answers] == ["q1", "q2"] and all(a["answer"] for a in answers)
    first_answers = pq.read_table(tmp_path / "out1" / "answers.parquet").to_pylist()
    assert answers == first_answers  # greedy: the adopted engine answers as the first command's did
