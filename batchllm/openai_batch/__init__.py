"""OpenAI batch files: `batchllm run-batch -i requests.jsonl -o results.jsonl`.

`request_lines` parses and checks one request line; `model_map` maps body.model to local
models; `batch_input` converts the file once into the run folder; `batch_dag` makes the DAG
(one node per model, endpoint and sampling); `results` writes the OpenAI output lines;
`run` ties them together, resumable exactly once as `batchllm run` is.
"""

from batchllm.openai_batch.model_map import model_map
from batchllm.openai_batch.run import BatchFile, BatchRun, run_batch, run_batches

__all__ = ["BatchFile", "BatchRun", "model_map", "run_batch", "run_batches"]
