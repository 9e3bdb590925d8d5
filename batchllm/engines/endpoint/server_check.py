"""A DAG's endpoints checked before anything runs: each server answers, serves the model and
the LoRA adapters its nodes name, takes the API key; and what it is (vLLM or SGLang, priority
scheduling or not).

Every problem is a UserError (exit 2) naming the `endpoints:` entry, the URL and the fix.
What is found is an `Endpoint` per server: what its engine (`http_engine`) needs.
"""

from __future__ import annotations

import os

import httpx

from batchllm.core.endpoint import Endpoint
from batchllm.core.errors import UserError
from batchllm.dag.model import DagSpec, EndpointSpec

CHECK_TIMEOUT_S = 10.0
# What batch requests carry on a server that schedules by priority: vLLM runs lower values
# first (online requests default to 0); SGLang runs higher values first.
BATCH_PRIORITY = {"vllm": 100, "sglang": -100}


def check_endpoints(dag: DagSpec) -> dict[str, tuple[Endpoint, ...]]:
    """Each endpoint model's servers, checked (UserError on the first problem)."""
    return {model: tuple(check_server(dag, model, spec, url) for url in spec.urls) for model, spec in dag.endpoints.items()}


def check_server(dag: DagSpec, model: str, spec: EndpointSpec, url: str) -> Endpoint:
    where = dag.where(spec.line, f"endpoints.{model}") if spec.line else f"endpoints.{model}"
    if spec.api_key_env and not os.environ.get(spec.api_key_env):
        raise UserError(f"the API key variable {spec.api_key_env} (for {url}) is not set", where=where,
                        hint=f"export {spec.api_key_env}=<key> before running, or drop api_key_env if the server needs none")
    probe = Endpoint(url, spec.served_model or model, spec.api_key_env, spec.slo, spec.max_in_flight, "openai", None, None)
    with httpx.Client(timeout=CHECK_TIMEOUT_S, headers=probe.headers()) as client:
        cards = _model_cards(client, url, where)
        served = _served_name(cards, spec.served_model, model, url, where)
        _check_adapters(dag, model, cards, served, url)
        card = next(c for c in cards if c.get("id") == served)
        kind = str(card.get("owned_by", "")).lower()
        kind = kind if kind in BATCH_PRIORITY else "openai"
        length = card.get("max_model_len")
        probe = Endpoint(url, served, spec.api_key_env, spec.slo, spec.max_in_flight, kind, None,
                         int(length) if isinstance(length, int) else None)
        priority = _priority_taken(client, probe)
    return Endpoint(url, served, spec.api_key_env, spec.slo, spec.max_in_flight, kind, priority, probe.max_model_len)


def _model_cards(client: httpx.Client, url: str, where: str) -> list[dict]:
    try:
        response = client.get(f"{url}/models")
    except httpx.HTTPError as error:
        raise UserError(f"cannot reach the server {url}: {type(error).__name__}: {error}", where=where,
                        hint="start the server, or correct the URL (an OpenAI base URL ends in /v1)") from None
    if response.status_code in (401, 403):
        raise UserError(f"the server {url} refused the API key ({response.status_code})", where=where,
                        hint="set api_key_env to the variable that holds a key this server takes")
    if response.status_code != 200:
        raise UserError(f"{url}/models answered {response.status_code}, not an OpenAI model list", where=where,
                        hint="give the server's OpenAI base URL, e.g. http://host:8000/v1")
    try:
        cards = response.json()["data"]
        if not isinstance(cards, list):
            raise TypeError
        return [c for c in cards if isinstance(c, dict)]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{url}/models did not answer an OpenAI model list", where=where,
                        hint="give the server's OpenAI base URL, e.g. http://host:8000/v1") from None


def _served_name(cards: list[dict], named: str | None, model: str, url: str, where: str) -> str:
    """The name the server serves the model under: the one the DAG names (`model:`, else the
    nodes' model), or the server's only model when the DAG names none."""
    ids = [str(c.get("id")) for c in cards]
    wanted = named or model
    if wanted in ids:
        return wanted
    if named is None and len(ids) == 1:
        return ids[0]
    raise UserError(f"the server {url} does not serve {wanted!r}; it serves {', '.join(map(repr, ids)) or 'no model'}",
                    where=where, hint="point the model at a server that serves it, or name the served model in `model:`")


def _check_adapters(dag: DagSpec, model: str, cards: list[dict], served: str, url: str) -> None:
    """Each adapter the model's nodes name is served, on this base (a vLLM LoRA module's card names
    its base as `parent`)."""
    parents = {str(c.get("id")): c.get("parent") for c in cards}
    for node in dag.nodes.values():
        if node.model != model or node.adapter_name is None:
            continue
        name, where = node.adapter_name, dag.where(node.line, f"nodes.{node.name}.adapter")
        if name not in parents:
            adapters = [card for card, parent in parents.items() if parent is not None]
            raise UserError(f"the server {url} does not serve the adapter {name!r}; it serves "
                            f"{', '.join(map(repr, adapters)) + ' as adapters' if adapters else 'no adapter'}", where=where,
                            hint=f"start it with --enable-lora --lora-modules {name}=<adapter directory>, or name an adapter it serves")
        if parents[name] is not None and parents[name] != served:
            raise UserError(f"the server {url} serves the adapter {name!r} on {parents[name]!r}, not on {served!r}", where=where,
                            hint=f"give the node the adapter's base as its model, or an adapter of {served!r}")


def _priority_taken(client: httpx.Client, endpoint: Endpoint) -> int | None:
    """The priority batch requests carry, when a one-token request with it is taken (a vLLM
    server without `--scheduling-policy priority` refuses a non-zero priority)."""
    value = BATCH_PRIORITY.get(endpoint.server_kind)
    if value is None:
        return None
    body = {"model": endpoint.served_model, "prompt": "ok", "max_tokens": 1, "priority": value}
    try:
        response = client.post(f"{endpoint.url}/completions", json=body)
    except httpx.HTTPError:
        return None
    return value if response.status_code == 200 else None
