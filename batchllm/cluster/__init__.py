"""Running on a Ray cluster: connecting, the cluster's devices, a local test cluster."""
