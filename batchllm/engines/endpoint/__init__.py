"""Engines behind OpenAI-compatible servers that already serve online traffic (vLLM, SGLang)."""
