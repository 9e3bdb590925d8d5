"""Helpers that both the tests and the benchmarks use: LoRA adapters made at run time
(lora_adapters.py) and scripted servers on a fake clock for the latency guard (scripted_server.py).

They stand apart from tests/ so that a benchmark needs nothing of the test suite (a test in
tests/test_benchmark_imports.py keeps benchmarks/ and batchllm/ from importing `tests`), and apart
from batchllm/ because they are fakes and test inputs, never a product path: the package is not
installed with batchllm (pyproject.toml's packages are batchllm*); it is found from the repo root
(pytest's rootdir on sys.path, the benchmarks' own sys.path line)."""
