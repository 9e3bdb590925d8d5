"""The lowest layer: the types every other layer shares (errors a user can act on, engine
requests and results, output constraints, paths). It imports nothing else of batchllm."""
