"""One batch file through `batchllm run-batch` and through vLLM's own run_batch
(`python -m vllm.entrypoints.openai.run_batch`), on the embedded model at temperature 0,
one request in flight per engine on both sides (batch composition changes the numerics):
every line succeeds in both, the texts are identical, and every batchllm line validates
against vLLM's own output models, logprobs included. Slow: marked `engine`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from batchllm.engines.devices import engine_dtype
from batchllm.models.embedded import SMOLLM2_135M

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the converted model, shared with test_real_engine.py


def chat(custom_id: str, messages: list[dict], **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smol", "messages": messages, "temperature": 0, "max_tokens": 24, **body}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


LINES = [
    chat("multi-turn", [{"role": "system", "content": "You answer with a single word."},
                        {"role": "user", "content": "What is the capital of France?"},
                        {"role": "assistant", "content": "Paris."},
                        {"role": "user", "content": "And of Italy?"}]),
    chat("stop", user("Count from one to ten in words, separated by commas."), stop=[","]),
    chat("penalties", user("Describe a light switch."), presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
    chat("top-k-min-p", user("Name three colours."), top_k=5, min_p=0.1),
    chat("logprobs", user("Is the sky blue? Answer yes or no."), logprobs=True, top_logprobs=3, max_tokens=8),
    # answers that end by the end-of-sequence token (short answers, room to spare; which ones do differs
    # between hosts): their logprobs hold that token too, as vLLM's server's do
    *(chat(f"logprobs-eos-{k}", user(question), logprobs=True, top_logprobs=2, max_tokens=96)
      for k, question in enumerate(["What colour is the sky? Answer with one word.", "Say hello.", "What is 2 + 2?"])),
    chat("system", [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Why do cats purr?"}]),
]


@pytest.fixture(scope="module")
def both_outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-batch")
    requests = root / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    os.environ["BATCHLLM_HOME"] = str(MODEL_HOME)
    model_dir = SMOLLM2_135M.prepare(MODEL_HOME)
    dtype = engine_dtype("cpu") or "bfloat16"

    from batchllm.openai_batch.run import run_batch

    ours = root / "batchllm.jsonl"
    run_batch(requests, ours, {"smol": "smollm2-135m"}, run_dir=root / "run", devices="cpu:2", schedule="sequential",
              console=Console(quiet=True), engine={"max_num_seqs": 1})
    theirs = root / "vllm.jsonl"
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs the model itself, not in a worker process of its own
    # (one import of vLLM fewer; the numerics are the same)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(requests), "-o", str(theirs),
                           "--model", str(model_dir), "--served-model-name", "smol", "--max-num-seqs", "1", "--enforce-eager",
                           "--dtype", dtype, "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    read = lambda path: {line["custom_id"]: line for line in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    return read(ours), read(theirs)


def test_every_line_succeeds_in_both_with_identical_texts(both_outputs):
    ours, theirs = both_outputs
    assert sorted(ours) == sorted(theirs) == sorted(line["custom_id"] for line in LINES)
    for custom_id in ours:
        assert ours[custom_id]["error"] is None and theirs[custom_id]["error"] is None, (custom_id, ours[custom_id], theirs[custom_id])
        mine = ours[custom_id]["response"]["body"]["choices"][0]
        vllms = theirs[custom_id]["response"]["body"]["choices"][0]
        assert mine["message"]["content"] == vllms["message"]["content"], custom_id
        assert mine["finish_reason"] == vllms["finish_reason"], custom_id
    assert "," not in ours["stop"]["response"]["body"]["choices"][0]["message"]["content"]


def test_every_batchllm_line_validates_against_vllms_own_output_models(both_outputs):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    ours, theirs = both_outputs
    for line in ours.values():
        BatchRequestOutput.model_validate(line)
        ChatCompletionResponse.model_validate(line["response"]["body"])
    for custom_id, top in (("logprobs", 3), ("logprobs-eos-0", 2), ("logprobs-eos-1", 2), ("logprobs-eos-2", 2)):
        mine = ours[custom_id]["response"]["body"]["choices"][0]["logprobs"]["content"]
        vllms = theirs[custom_id]["response"]["body"]["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in mine] == [t["token"] for t in vllms], custom_id
        assert [t["logprob"] for t in mine] == pytest.approx([t["logprob"] for t in vllms], abs=1e-3)
        assert all(len(t["top_logprobs"]) == top for t in mine)
        for k, (a, b) in enumerate(zip(mine, vllms)):  # the same top tokens, each with its logprob (tied ones in either order)
            assert sorted(x["token"] for x in a["top_logprobs"]) == sorted(x["token"] for x in b["top_logprobs"]), (custom_id, k)
            theirs_by_token = {x["token"]: x["logprob"] for x in b["top_logprobs"]}
            assert all(x["logprob"] == pytest.approx(theirs_by_token[x["token"]], abs=1e-3) for x in a["top_logprobs"]), (custom_id, k)
    ended = [theirs[f"logprobs-eos-{k}"]["response"]["body"]["choices"][0] for k in range(3)]
    ended = [choice for choice in ended if choice["finish_reason"] == "stop"]
    assert ended, "none of the short answers ended by the end-of-sequence token: the case these lines are for"
    for choice in ended:  # the text leaves the end-of-sequence token out; the logprobs end with it
        joined = "".join(t["token"] for t in choice["logprobs"]["content"])
        assert joined.startswith(choice["message"]["content"]) and len(joined) > len(choice["message"]["content"])
