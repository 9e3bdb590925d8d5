"""Only the optional C accelerator lives here; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the prefix tree
hashes blocks in Python (same ids, about three times slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("batchllm.ordering._block_ids", ["batchllm/ordering/_block_ids.c"], optional=True)])
