"""The validated DAG: plain frozen records, built only by `dag.loader`.

A DAG has named Parquet inputs, LLM nodes whose prompt templates reference input
columns and upstream node outputs (that is where the edges come from), and named
output data sets assembled from those columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from batchllm.core.latency_slo import LatencySlo
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.requests import ModelTask
from batchllm.core.sampling import SamplingSpec

# What an input may be read from (`io.input_formats`), and what an output data set may be written as.
INPUT_FORMATS = ("parquet", "jsonl", "csv", "hf")
OUTPUT_FORMATS = ("parquet", "jsonl")


@dataclass(frozen=True)
class InputSpec:
    name: str
    path: Path  # a file, a folder or a glob
    id_column: str | None
    line: int
    format: str | None = None  # one of INPUT_FORMATS; None: from the extension (see io.input_formats)
    uri: str | None = None  # a pyarrow filesystem URI (s3://...) to read instead of `path` (see io.remote_files)


@dataclass(frozen=True)
class IterateSpec:
    """Run the node once per element of a list column, in order, per row.

    Step k's template sees `item_name` (the k-th element), `step` (k) and `previous`
    (step k-1's output, or None at step 0). Downstream nodes see the last step's output.
    """

    over: str
    item_name: str


@dataclass(frozen=True)
class MessageTemplate:
    role: str  # system, user or assistant
    content: str  # a template


@dataclass(frozen=True)
class NodeSpec:
    name: str
    model: str
    input_name: str
    prompt: str
    system: str | None
    chat: bool
    sampling: SamplingSpec
    where: str | None
    iterate: IterateSpec | None
    line: int
    upstream: tuple[str, ...] = ()
    columns_used: tuple[str, ...] = ()
    output: OutputConstraint | None = None
    merges_read: tuple[str, ...] = ()  # merges (see DagSpec.merges) its templates or `where` read; their members are in `upstream`
    reads: tuple[str, ...] = ()  # the upstream texts it reads by name: upstream nodes it names, and merges
    # The chat as turns (a template each), or as one expression that yields the list (see dag.node_prompt);
    # `prompt` and `system` are "" and None then.
    messages: tuple[MessageTemplate, ...] | str | None = None
    task: ModelTask = ModelTask.GENERATE  # EMBED: one vector a unit, of its prompt as plain text; SCORE: one number (see dag.node_task)
    nearest_read: tuple[str, ...] = ()  # nearest-row lists (see DagSpec.nearest) its templates read; their nodes are in `upstream`
    pair: str | None = None  # a score node's second text, a template (`prompt` is its first)
    adapter: str | None = None  # a LoRA adapter directory (absolute) its requests run with, on its `model` as the base
    # `adapter:` as written; on a model served from `endpoints:`, the adapter's name on the servers (their --lora-modules name)
    adapter_name: str | None = None
    # `images:` as expressions, each a row's image or list of images (see core.images), shown before the
    # prompt's text; relative paths are taken from `image_dir`, the input file's folder
    images: tuple[str, ...] = ()
    image_dir: str = "."

    def request_adapter(self, on_servers: bool) -> str | None:
        """What its requests name as their adapter: the directory on engines here, the name on servers."""
        return self.adapter_name if on_servers else self.adapter


@dataclass(frozen=True)
class NearestSpec:
    """Per row of `query`'s input, the `k` rows of `corpus`'s input whose vectors are nearest the
    row's `query` vector (cosine similarity), nearest first: retrieval inside the DAG. Both are embed
    nodes of one model; a node that reads the name runs over `query`'s input, once `corpus` is done."""

    name: str
    query: str  # an embed node
    corpus: str  # an embed node, over the input the rows are taken from
    k: int
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class ColumnRef:
    """An output column: an input column (`node` is None) or a node's result field."""

    node: str | None
    field: str
    json_type: str | None = None  # a JSON-schema output's property (see OutputConstraint.json_fields), not a result field


@dataclass(frozen=True)
class OutputSpec:
    name: str
    input_name: str
    columns: dict[str, ColumnRef]
    line: int
    format: str = "parquet"  # one of OUTPUT_FORMATS: `<out>/<name>.<format>`
    copy_to: str | None = None  # a path or pyarrow filesystem URI the written file is also copied to


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings shared by every model of the DAG (None: the engine's default)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None  # None: eager on CPUs (compiling costs ~100 s there), compiled on GPUs
    line: int = field(default=0, compare=False)  # of the `engine:` section in the DAG file (0: none, or no file)


@dataclass(frozen=True)
class Price:
    """What a model's tokens cost, per million (any currency), for the run summary."""

    prompt_per_1m: float
    output_per_1m: float

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_1m + output_tokens * self.output_per_1m) / 1e6


@dataclass(frozen=True)
class EndpointSpec:
    """Servers that already serve a model (OpenAI-compatible: vLLM's or SGLang's): the nodes of
    that model send their requests there instead of to engines batchllm starts on its devices,
    as many at once as the latency guard allows beside the servers' online traffic."""

    urls: tuple[str, ...]  # OpenAI base URLs, e.g. http://gpu-box:8000/v1
    served_model: str | None = None  # the name the servers serve it under (None: the one they list, else the DAG's name)
    api_key_env: str | None = None  # the environment variable that holds the API key (the key is never written)
    slo: LatencySlo | None = None  # None: online latency within 1.25x of what a server showed before the batch
    max_in_flight: int = 64  # the most requests batchllm keeps in flight on one server
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class DagSpec:
    path: Path
    name: str
    inputs: dict[str, InputSpec]
    nodes: dict[str, NodeSpec]
    outputs: dict[str, OutputSpec]
    engine: EngineSpec = field(default_factory=EngineSpec)
    # A merge names the output of whichever of its member nodes produced one for a row (the
    # first listed that did): routed branches joined again, e.g. {"answer": ("tech", "general")}.
    merges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    prices: dict[str, Price] = field(default_factory=dict)  # model (as nodes name it) -> its price
    nearest: dict[str, NearestSpec] = field(default_factory=dict)  # name -> the nearest rows templates read under it
    endpoints: dict[str, EndpointSpec] = field(default_factory=dict)  # model (as nodes name it) -> the servers that serve it

    def on_devices(self) -> DagSpec:
        """The DAG of the nodes that run on devices (the planner's part): nodes on servers
        left out, and with them the edges from them."""
        if not self.endpoints:
            return self
        kept = {name: node for name, node in self.nodes.items() if node.model not in self.endpoints}
        nodes = {name: replace(node, upstream=tuple(u for u in node.upstream if u in kept)) for name, node in kept.items()}
        return replace(self, nodes=nodes, endpoints={})

    def ancestors(self, node: str) -> set[str]:
        """The nodes whose outputs reach this one, directly or through others."""
        seen: set[str] = set()
        todo = list(self.nodes[node].upstream)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.nodes[name].upstream)
        return seen

    def on_endpoints(self, node: str) -> bool:
        """Whether the node's requests go to servers (`endpoints:`), not to engines on devices."""
        return self.nodes[node].model in self.endpoints

    def where(self, line: int, key_path: str, *, in_file: bool = True) -> str:
        """Where a part of the DAG is, for an error: `<file>, line N, key.path` in a YAML file
        (without the key path when `in_file` is False: the message names it); the key path
        alone in a DAG given as a mapping (it has no file and no lines)."""
        if not line:
            return key_path
        return f"{self.path}, line {line}, {key_path}" if in_file else f"{self.path}, line {line}"

    def topological_order(self) -> list[str]:
        """Node names, every node after all of its upstream nodes (stable by file order)."""
        done: list[str] = []
        placed: set[str] = set()
        while len(done) < len(self.nodes):
            for name, node in self.nodes.items():
                if name not in placed and all(u in placed for u in node.upstream):
                    done.append(name)
                    placed.add(name)
        return done
