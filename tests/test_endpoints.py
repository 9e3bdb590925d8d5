"""A DAG run through a real vLLM OpenAI server of the embedded model (one core, 127.0.0.1,
started and stopped here, with one LoRA adapter made here): the local run's units and texts,
exactly once across a driver `kill -9` and across the server's own death and restart, a node
on the served adapter, and bad endpoints refused with exit 2 before anything runs. Slow:
marked `endpoint` (one server for the module)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import DeviceSet, engine_dtype
from batchllm.models.embedded import SMOLLM2_135M
from batchllm.runtime.launch import run_dag_file
from tests.test_real_engine import KILL_TEST_DAG

pytestmark = pytest.mark.endpoint
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the converted model, shared with the engine tests
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
SERVER_CORE = "1"  # the server's core; a local engine of the comparison runs on core 0
START_TIMEOUT_S = 300

# The kill test's DAG (answer, then critique, over the first QUESTIONS questions), one request at a time on a local engine:
# temperature 0 gives the same tokens as the server then.
DAG = KILL_TEST_DAG.replace("max_num_seqs: 4        # results arrive in waves, so a kill can land mid-node", "max_num_seqs: 1") \
    .replace("{path: %s, id_column: id}", "{path: %(questions)s, id_column: id}")
ENDPOINTS = """
endpoints:
  smollm2-135m:
    urls: [%(url)s]
    max_in_flight: %(in_flight)d
    slo: {ttft_p99_s: 30, itl_p99_s: 5}   # the test's own requests only: no online traffic to keep
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADAPTER = "sql-tuned"  # the server's name of its LoRA adapter (seeded random weights)


class VllmServer:
    """vLLM's OpenAI server of the embedded model on one core, on 127.0.0.1, serving `adapter` as ADAPTER."""

    def __init__(self, log: Path, adapter: Path):
        self.port, self.log, self.adapter, self.process = free_port(), log, adapter, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs its model itself instead of in a third process (on
        # the CPU platform); two processes import vLLM, not three (48 s to healthy instead of 63 s on an AVX2-only host)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": SERVER_CORE, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(SMOLLM2_135M.prepare(MODEL_HOME)),
                   "--served-model-name", "smollm2-135m", "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                   "--dtype", engine_dtype("cpu") or "bfloat16", "--kv-cache-memory-bytes", str(1 << 30),
                   "--max-model-len", "1024", "--scheduling-policy", "priority", "--seed", "0",
                   "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={self.adapter}"]
        # its own process group: vLLM's engine core is a child process, which a kill of the server alone leaves running
        self.process = subprocess.Popen(command, env=env, stdout=self.log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"the server did not come up in {START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def kill(self) -> None:
        """SIGKILL to the server and its engine core (the whole process group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # whatever of the group is left


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testkit.lora_adapters import make_lora_adapter

    os.environ["BATCHLLM_HOME"] = str(MODEL_HOME)
    folder = tmp_path_factory.mktemp("server")
    base_config = json.loads((SMOLLM2_135M.prepare(MODEL_HOME) / "config.json").read_text())
    running = VllmServer(folder / "server.log", make_lora_adapter(folder / "adapter", base_config, seed=1))
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture
def model_home(monkeypatch):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    return MODEL_HOME


QUESTIONS = 8  # the first 8 example questions: 16 units, 4 in flight: a kill after the first 4 lands with work left
COMPARED_QUESTIONS = 6  # the local run against the served one: one request at a time on each side


def write_dag(tmp_path: Path, url: str | None, in_flight: int = 1, extra: str = "", questions_count: int = QUESTIONS) -> Path:
    questions = tmp_path / "questions.parquet"
    pq.write_table(pq.read_table(REPO / "examples" / "questions.parquet").slice(0, questions_count), questions)
    text = DAG % {"questions": questions}
    if url is not None:
        text += ENDPOINTS % {"url": url, "in_flight": in_flight} + extra
    path = tmp_path / ("endpoint.yaml" if url else "local.yaml")
    path.write_text(text)
    return path


def results(out: Path, node: str) -> dict[tuple[int, int], str]:
    rows = pq.read_table(out / "nodes" / f"{node}.parquet").to_pylist()
    keys = [(r["row_id"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), f"{node}: a unit answered twice"
    return {(r["row_id"], r["step"]): r["text"] for r in rows}


def committed(out: Path) -> int:
    status = out / ".batchllm" / "status.json"
    try:
        return sum(n["committed"] for n in json.loads(status.read_text())["nodes"].values())
    except (OSError, ValueError, KeyError):
        return 0


def cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "BATCHLLM_HOME": str(MODEL_HOME)}
    return subprocess.Popen([BATCHLLM, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.1)


def test_a_dag_through_the_server_gives_the_local_runs_units_and_texts(server, tmp_path, model_home):
    quiet = Console(quiet=True)
    local_dag, served_dag = (write_dag(tmp_path, url, questions_count=COMPARED_QUESTIONS) for url in (None, server.url))
    run_dag_file(local_dag, tmp_path / "local", DeviceSet("cpu", (0,)), console=quiet, schedule="sequential", pilot=None)
    result, progress = run_dag_file(served_dag, tmp_path / "served", DeviceSet("cpu", (0,)), console=quiet, pilot=None)
    assert result.engines_started == 1  # the server's engine only: no engine started on the devices
    for node in ("answer", "critique"):
        local, served = results(tmp_path / "local", node), results(tmp_path / "served", node)
        assert sorted(served) == sorted(local) and len(served) == COMPARED_QUESTIONS
        assert served == local, node  # temperature 0, one request at a time on both sides: the same tokens
    assert progress.stats["answer"].output_tokens > 0
    guard_logs = list((tmp_path / "served" / ".batchllm" / "logs").glob("engine-*-endpoint0.log"))
    assert len(guard_logs) == 1, guard_logs  # the server's guard log, in the run folder
    header, *changes = guard_logs[0].read_text().splitlines()
    assert header.startswith("the latency guard of http://127.0.0.1:") and header.endswith(": each change of its phase or allowance")
    assert any(" UTC  " in line and "in flight <= 0 -> 1" in line for line in changes)  # nothing ran before the guard allowed one


def test_a_driver_killed_mid_run_resumes_and_commits_every_unit_once(server, tmp_path, model_home):
    out = tmp_path / "out"
    dag = write_dag(tmp_path, server.url, in_flight=4)
    driver = cli(["run", str(dag), "--out", str(out), "--no-pilot"])
    wait_for(lambda: committed(out) >= 4, driver)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert committed(out) < 2 * QUESTIONS, "the kill must land with work left"
    deadline = time.monotonic() + 30  # the server aborts what the dead driver had in flight
    while server.metric("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "requests of a killed driver kept running on the server"
        time.sleep(0.2)
    resumed = cli(["run", str(dag), "--out", str(out), "--no-pilot"])
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr
    assert len(results(out, "answer")) == QUESTIONS and len(results(out, "critique")) == QUESTIONS
    assert stdout == f"critiqued: {out}/critiqued.parquet\n"


def test_a_server_killed_mid_run_and_started_again_loses_and_repeats_nothing(server, tmp_path, model_home):
    out = tmp_path / "out"
    driver = cli(["run", str(write_dag(tmp_path, server.url, in_flight=4)), "--out", str(out), "--no-pilot"])
    wait_for(lambda: committed(out) >= 4, driver)
    server.kill()
    before = committed(out)
    assert before < 2 * QUESTIONS, "the kill must land with work left"
    server.start()  # about 20-45 s: the run waits for it, sending again what was in flight
    stdout, stderr = driver.communicate(timeout=900)
    assert driver.returncode == 0, stderr
    answers, critiques = results(out, "answer"), results(out, "critique")
    assert len(answers) == QUESTIONS and len(critiques) == QUESTIONS and all(answers.values())


def test_a_model_the_server_does_not_serve_is_exit_2_before_anything_runs(server, tmp_path, model_home):
    dag = write_dag(tmp_path, server.url, extra="    model: no-such-model\n")
    done = cli(["run", str(dag), "--out", str(tmp_path / "out")])
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 2, stderr
    assert f"the server {server.url} does not serve 'no-such-model'; it serves 'smollm2-135m'" in stderr
    assert not (tmp_path / "out").exists()


ADAPTER_DAG = """
inputs:
  questions: {path: questions.parquet, id_column: id}
nodes:
  base: {model: smollm2-135m, prompt: "{{ question }}", sampling: {max_tokens: 12}}
  tuned: {model: smollm2-135m, adapter: %s, prompt: "{{ question }}", sampling: {max_tokens: 12}}
endpoints:
  smollm2-135m: {urls: [%s], slo: {ttft_p99_s: 30, itl_p99_s: 5}}
"""


def test_a_node_on_the_servers_adapter_runs_with_it_and_an_adapter_it_lacks_is_exit_2(server, tmp_path, model_home):
    """vLLM lists its LoRA module with the base as `parent`: the check takes the adapter's name; the
    node's texts differ from the base's (the adapter's weights moved them)."""
    pq.write_table(pq.read_table(REPO / "examples" / "questions.parquet").slice(0, 3), tmp_path / "questions.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text(ADAPTER_DAG % (ADAPTER, server.url))
    run_dag_file(dag, tmp_path / "out", DeviceSet("cpu", (0,)), console=Console(quiet=True), pilot=None)
    base, tuned = results(tmp_path / "out", "base"), results(tmp_path / "out", "tuned")
    assert sorted(base) == sorted(tuned) and len(base) == 3 and all(tuned.values())
    assert base != tuned
    dag.write_text(ADAPTER_DAG % ("no-such-adapter", server.url))
    done = cli(["run", str(dag), "--out", str(tmp_path / "refused")])
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 2, stderr
    assert f"the server {server.url} does not serve the adapter 'no-such-adapter'; it serves '{ADAPTER}' as adapters" in stderr
    assert not (tmp_path / "refused").exists()
