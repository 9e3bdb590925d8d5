"""The DAG's `endpoints:` section, and `--endpoint MODEL=URL` given on the command line.

    endpoints:
      smollm2-135m:                        # a model as the nodes name it
        urls: [http://gpu-box:8000/v1]     # OpenAI-compatible servers that serve it
        model: smol                        # optional: the name they serve it under
        api_key_env: GPU_BOX_KEY           # optional: the variable holding the API key
        slo: {ttft_p99_s: 1.0, itl_p99_s: 0.1}   # optional: what their online traffic keeps
        max_in_flight: 64                  # optional: the most requests at once per server
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchllm.core.errors import UserError
from batchllm.core.latency_slo import LatencySlo
from batchllm.dag.model import DagSpec, EndpointSpec, NodeSpec
from batchllm.dag.yaml_section import Section

KEYS = {"urls", "model", "api_key_env", "slo", "max_in_flight"}
SLO_KEYS = {"ttft_p99_s", "itl_p99_s"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def is_server_url(text: str) -> bool:
    return bool(re.match(r"https?://[^/\s]+", text))


def parse_endpoints(top: Section, path: Path, nodes: dict[str, NodeSpec]) -> dict[str, EndpointSpec]:
    if "endpoints" not in top.mapping:
        return {}
    raw = top.get("endpoints", dict, expect="a mapping of models to {urls: [...], ...}")
    section = Section(path, raw, "endpoints", top.line("endpoints"), {node.model for node in nodes.values()})
    return {model: _endpoint(Section(path, body, f"endpoints.{model}", section.line(model), KEYS), section.line(model))
            for model, body in raw.items()}


def _endpoint(item: Section, line: int) -> EndpointSpec:
    urls = item.get("urls", list, check=lambda v: v and all(isinstance(u, str) and is_server_url(u) for u in v),
                    expect="a list of server URLs such as http://gpu-box:8000/v1")
    api_key_env = item.get("api_key_env", str, default=None, check=lambda v: bool(_ENV_NAME.match(v)),
                           expect="the name of an environment variable (the key itself is never written in a DAG)")
    slo = None
    if "slo" in item.mapping:
        body = Section(item.file, item.mapping["slo"], f"{item.where}.slo", item.line("slo"), SLO_KEYS)
        bound: dict[str, Any] = dict(default=None, check=lambda v: v > 0, expect="a number of seconds > 0")
        slo = LatencySlo(body.get("ttft_p99_s", (int, float), **bound), body.get("itl_p99_s", (int, float), **bound))
    return EndpointSpec(urls=tuple(u.rstrip("/") for u in urls), served_model=item.get("model", str, default=None),
                        api_key_env=api_key_env, slo=slo,
                        max_in_flight=item.get("max_in_flight", int, default=64, check=lambda v: v >= 1, expect="an integer >= 1"),
                        line=line)


def with_endpoint_options(dag: DagSpec, options: list[str]) -> DagSpec:
    """The DAG with `--endpoint MODEL=URL` options applied: a model's URLs given there replace
    the DAG's (its other endpoint settings stay)."""
    urls: dict[str, list[str]] = {}
    models = {node.model for node in dag.nodes.values()}
    for option in options:
        model, _, url = option.partition("=")
        if not url or not is_server_url(url):
            raise UserError(f"--endpoint {option!r} is not MODEL=URL", where="--endpoint",
                            hint="give a model as the DAG's nodes name it and a server URL, e.g. --endpoint smollm2-135m=http://gpu-box:8000/v1")
        if model not in models:
            raise UserError(f"--endpoint names model {model!r}, which no node uses", where="--endpoint",
                            hint=f"use one of {', '.join(sorted(models))}")
        urls.setdefault(model, []).append(url.rstrip("/"))
    endpoints = dict(dag.endpoints)
    for model, given in urls.items():
        endpoints[model] = replace(endpoints.get(model, EndpointSpec(())), urls=tuple(given))
    return replace(dag, endpoints=endpoints)
