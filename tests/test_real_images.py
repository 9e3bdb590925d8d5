"""Images on the real engine (slow: marked `engine`): a node with `images:` on a vision-language
model made here (Idefics3's architecture, the embedded SmolLM2 as its language model, a seeded
random vision tower: tests/vision_model.py) gives the tokens vLLM's own `LLM.chat` gives for the
same image as an OpenAI content part, at temperature 0; the same images as bytes give the same
tokens as their paths; a missing or unreadable image fails its row only. The same chats as lines of
an OpenAI batch file give the same texts through `run-batch`, each line valid as vLLM's own response
models have it, and a line whose image is not one fails alone."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import engine_dtype, parse_devices
from batchllm.models.embedded import SMOLLM2_135M
from batchllm.runtime.launch import run_dag_file
from tests.vision_model import IMAGE_TOKENS, make_vision_model

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the prepared models, shared with the other real-engine tests
MAX_TOKENS = 10
QUESTIONS = ("What is in the picture?", "Describe the colours.", "What is in the picture?")

VLLM_IMAGE_CHAT = """
import json, sys
from vllm import LLM, SamplingParams
chats = json.load(sys.stdin)
llm = LLM(model=sys.argv[1], max_num_seqs=1, enforce_eager=True, dtype=sys.argv[2], seed=0, max_model_len=2048)
outputs = llm.chat(chats, SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0))
print("TEXTS " + json.dumps([[output.outputs[0].text, len(output.prompt_token_ids)] for output in outputs]))
"""

DAG = """
inputs:
  photos: {path: photos.parquet, id_column: id}
nodes:
  look: {model: vlm, prompt: "{{ question }}", images: "{{ photo }}", sampling: {max_tokens: %d}}
  look_bytes: {model: vlm, prompt: "{{ question }}", images: "{{ photo_bytes }}", sampling: {max_tokens: %d}}
engine:
  max_num_seqs: 1   # one request at a time, as the reference runs them: a batch's shape moves float32 sums, and a tie flips a token
  max_model_len: 2048
"""


def _png(path: Path, seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path, format="PNG")
    return path.read_bytes()


def test_an_image_node_gives_vllms_own_chat_tokens_and_a_bad_image_fails_its_row_only(tmp_path, monkeypatch, shared_engines):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    make_vision_model(tmp_path / "vlm", SMOLLM2_135M.prepare(MODEL_HOME), seed=7)
    (tmp_path / "images").mkdir()
    pictures = [_png(tmp_path / "images" / f"p{k}.png", seed=k, size=size) for k, size in enumerate([(96, 128), (128, 64), (40, 40)])]
    (tmp_path / "images" / "notes.png").write_text("not an image")
    rows = [("good0", QUESTIONS[0], "images/p0.png", pictures[0]), ("good1", QUESTIONS[1], "images/p1.png", pictures[1]),
            ("good2", QUESTIONS[2], "images/p2.png", pictures[2]), ("missing", QUESTIONS[0], "images/gone.png", None),
            ("unreadable", QUESTIONS[0], "images/notes.png", b"not an image")]
    pq.write_table(pa.table({"id": [r[0] for r in rows], "question": [r[1] for r in rows], "photo": [r[2] for r in rows],
                             "photo_bytes": pa.array([r[3] for r in rows], pa.binary())}), tmp_path / "photos.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text(DAG % (MAX_TOKENS, MAX_TOKENS))
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    answers = {node: {r["row_id"]: r for r in pq.read_table(tmp_path / "out" / "nodes" / f"{node}.parquet").to_pylist()}
               for node in ("look", "look_bytes")}
    chats = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}},
                                           {"type": "text", "text": q}]}] for p, q in zip(pictures, QUESTIONS)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", VLLM_IMAGE_CHAT, str(tmp_path / "vlm"), engine_dtype("cpu") or "auto", str(MAX_TOKENS)],
                          input=json.dumps(chats), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("TEXTS ")).removeprefix("TEXTS "))
    for node in ("look", "look_bytes"):
        ours = answers[node]
        assert [ours[f"good{k}"]["text"] for k in range(3)] == [text for text, _ in theirs], node
        assert [ours[f"good{k}"]["num_prompt_tokens"] for k in range(3)] == [tokens for _, tokens in theirs], node
        assert ours["missing"]["finish_reason"].startswith("error: image 1 ")
        assert ours["unreadable"]["finish_reason"].startswith("error: image 1 is not an image PIL can read")
    assert "cannot be read: No such file or directory" in answers["look"]["missing"]["finish_reason"]
    assert "is empty (a null" in answers["look_bytes"]["missing"]["finish_reason"]
    assert all(tokens > IMAGE_TOKENS for _, tokens in theirs)  # the image's tokens are in the prompt's count
    assert theirs[0][0] != theirs[2][0]  # the same question, another image: another answer (the image is read)
    _a_batch_file_of_the_same_chats_gives_the_same_texts(tmp_path, chats, [text for text, _ in theirs], shared_engines)


def _a_batch_file_of_the_same_chats_gives_the_same_texts(tmp_path: Path, chats: list, texts: list[str], shared_engines) -> None:
    """`run-batch` on the chats above (data URIs, on the engine the DAG ran on), and one whose image is not one."""
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    from batchllm.openai_batch.run import run_batch

    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}},
                                        {"type": "text", "text": QUESTIONS[0]}]}]
    lines = [{"custom_id": f"chat-{k}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "vlm", "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0}} for k, chat in enumerate([*chats, bad])]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = run_batch(tmp_path / "requests.jsonl", tmp_path / "results.jsonl", {"vlm": str(tmp_path / "vlm")}, run_dir=tmp_path / "batch-run",
                      devices="cpu:2", engine_factory=shared_engines, console=Console(quiet=True),
                      engine={"max_num_seqs": 1, "max_model_len": 2048})
    assert (batch.counts.lines, batch.counts.succeeded, batch.counts.failed) == (4, 3, {"request_failed": 1})
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert sorted(results) == [f"chat-{k}" for k in range(4)]  # each line once
    for k, text in enumerate(texts):
        BatchRequestOutput.model_validate(results[f"chat-{k}"])
        body = ChatCompletionResponse.model_validate(results[f"chat-{k}"]["response"]["body"])
        assert body.choices[0].message.content == text
    failed = results["chat-3"]
    assert failed["response"] is None and "image 1 is not an image PIL can read" in failed["error"]["message"], failed
