"""A DAG and its data -> the planner's problem, before anything runs.

What is known before running is estimated, and each estimate is stated in the
problem's notes:
- requests per node: its input's rows, no more than its upstream nodes produce, times
  `n`; a `where:` over input columns only is counted on the data (and prompt sizes are
  sampled from the rows it keeps); one that reads an upstream output is assumed to take an
  equal share with its sibling `where:` nodes (nodes reading the same upstream nodes),
  since the router has not answered yet;
- rounds of an iterating node: the list lengths of its `iterate.over` column;
- prompt tokens per row: the template rendered on the row with upstream outputs left
  empty, counted by the model's tokenizer when the model is on this machine (chat template
  included), else at 4 characters a token, plus each upstream node's expected output length
  (its profile's mean, capped by its max_tokens), plus for iteration the item and the
  previous step's output;
- prefix-cache hits per row: the whole cache blocks of its rendered text it shares with
  other rows (the runtime sends requests in prefix order), so the simulated prefill
  skips them.

The data is read without loading it: row counts from the Parquet footer, prompt sizes from
the first `SAMPLE_ROWS` rows, an iterating node's rounds from its list column's lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.work import CHARS_PER_TOKEN, estimated_tokens
from batchllm.core.requests import EngineRequest
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.registry import resolve_model
from batchllm.models.tokens import PromptTokenizer
from batchllm.core.errors import UserError
from batchllm.io.input_source import ROW_ID, InputSource
from batchllm.dag.sql_names import sql_identifiers
from batchllm.io.sql import rows_where
from batchllm.ordering.prefix_tree import PrefixTree
from batchllm.planner.cluster import Cluster, candidate_plans, cluster_profile, run_settings
from batchllm.planner.problem import NodeWorkload, too_big
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.dag.context import template_context
from batchllm.dag.node_prompt import NodePrompt

CHAT_OVERHEAD_TOKENS = 12  # role markers of a chat template
SAMPLE_ROWS = 1000


@dataclass(frozen=True)
class DagWorkloads:
    nodes: list[NodeWorkload]
    notes: tuple[str, ...]


def profile_names(model: str) -> list[str]:
    """Profile folder names a DAG's model may be filed under: `owner/name` -> owner_name, name."""
    base = model.rstrip("/").split("/")[-1]
    return list(dict.fromkeys([model.replace("/", "_"), base, base.lower()]))


def _profile_for(model: str, cluster: Cluster, profiles_root: Path, where: str,
                 settings: dict[str, object], store: ProfileStore | None = None) -> tuple[Profile, tuple[str, ...]]:
    """The profile a model is planned with: what the local store learnt on this machine
    (with these settings) when it has it, else the shipped one, with its notes."""
    for name in profile_names(model):
        try:
            shipped, notes = cluster_profile(cluster, name, profiles_root, settings)
        except UserError:
            shipped, notes = None, ()
        if store is not None and cluster.local and cluster.identity is not None:
            learnt = store.load(cluster.identity, shipped.model if shipped else name, settings)  # filed as the profile names it
            if learnt is not None:
                return learnt.profile, (f"prior for {model}: {learnt.describe()}",)
        if shipped is not None:
            return shipped, notes
    available = sorted({p.parent.name for p in profiles_root.glob(f"**/{cluster.hardware}/*/profile.json")})
    raise UserError(f"no profile for model {model!r} on {cluster.hardware}", where=where,
                    hint=f"profiled models there: {', '.join(available) or 'none'}; run `batchllm profile --model {model}` on that hardware")


def dag_workloads(dag: DagSpec, sources: dict[str, InputSource], cluster: Cluster, profiles_root: Path,
                  store: ProfileStore | None = None, home: Path | None = None) -> DagWorkloads:
    """`store`: the local profile store, consulted first when the cluster is this machine;
    `home`: $BATCHLLM_HOME, where prepared models' tokenizers count prompts exactly."""
    tokenizers: dict[str, PromptTokenizer | None] = {}
    notes: list[str] = []
    profiles: dict[str, Profile] = {}
    counts: dict[str, float] = {}
    mean_output: dict[str, float] = {}
    nodes: list[NodeWorkload] = []
    for name in dag.topological_order():
        node = dag.nodes[name]
        where = dag.where(node.line, f"nodes.{name}")
        profile, profile_notes = _profile_for(node.model, cluster, profiles_root, f"{where}.model", run_settings(dag.engine, cluster),
                                              store)
        notes += [note for note in profile_notes if note not in notes]  # hardware or settings the profile differs in
        if not candidate_plans(profile, cluster):
            raise too_big(node.model, profile, cluster, f"{where}.model")
        profiles[name] = profile
        source = sources[node.input_name]
        share, sample = _where_share(dag, node, source)
        if share < 1 and not _where_reads_input_only(dag, node):
            notes.append(f"{name}: `where` assumed to keep {share:.0%} of rows (shared with its sibling routes)")
        rows = min([source.num_rows] + [_rows_read(dag, r, counts, source.num_rows) for r in node.reads]) * share
        mean_output[name] = min(profile.lengths.mean(), node.sampling.max_tokens)
        upstream_tokens = sum(max(mean_output[m] for m in dag.merges.get(r, (r,))) for r in node.reads)
        if home is not None and node.model not in tokenizers:
            tokenizers[node.model] = local_tokenizer(node.model, dag.path.parent, home)
        prompts, cached = _prompt_tokens(node, sample, upstream_tokens, mean_output[name],
                                         int(profile.engine.get("block_size_tokens", 16)), tokenizers.get(node.model))
        if node.iterate:
            rounds = tuple(int(round(c * share * node.sampling.n)) for c in _rows_longer(source.list_lengths(node.iterate.over)))
            counts[name] = rows * node.sampling.n
        else:
            rounds = (int(round(rows * node.sampling.n)),)
            counts[name] = rows * node.sampling.n
        if sum(rounds) == 0:
            rounds = (0,)
        workload = Workload.of(np.repeat(prompts, node.sampling.n), node.sampling.max_tokens,
                               cached_tokens=np.repeat(cached, node.sampling.n))
        nodes.append(NodeWorkload(name, profile, workload, rounds, tuple(u for u in node.upstream if u != name), node.sampling.n))
    return DagWorkloads(nodes, tuple(notes))


def _rows_longer(lengths: np.ndarray) -> np.ndarray:
    """Element k: how many rows have more than k list elements (k = 0 .. longest - 1)."""
    per_length = np.bincount(lengths, minlength=1)
    return len(lengths) - np.cumsum(per_length)[:-1]


def _rows_read(dag: DagSpec, name: str, counts: dict[str, float], rows: int) -> float:
    """Rows with an output of what a node reads: an upstream node's, or a merge's (its
    members' rows together, at most every row)."""
    members = dag.merges.get(name, (name,))
    return min(sum(counts[m] / dag.nodes[m].sampling.n for m in members), rows)


def _where_share(dag: DagSpec, node: NodeSpec, source: InputSource) -> tuple[float, list[dict]]:
    """The share of rows a node's `where:` keeps, and sample rows for its prompt sizes: counted
    on the data when the predicate reads input columns only, else an equal share with its
    sibling routes (the router has not answered yet) and the first rows."""
    if node.where and _where_reads_input_only(dag, node):
        kept, sample = rows_where(source, node.where, where=dag.where(node.line, f"nodes.{node.name}.where"),
                                  sample_rows=SAMPLE_ROWS)
        return kept / max(source.num_rows, 1), sample.to_pylist() or source.head_rows(1).to_pylist()
    sample = source.head_rows(SAMPLE_ROWS).to_pylist()
    if not node.where:
        return 1.0, sample
    siblings = [n for n in dag.nodes.values() if n.where and set(n.upstream) == set(node.upstream)]
    return 1.0 / len(siblings), sample


def _where_reads_input_only(dag: DagSpec, node: NodeSpec) -> bool:
    names = sql_identifiers(node.where or "")
    return bool(node.where) and not names & (set(dag.nodes) | set(dag.merges) | {ROW_ID})


def local_tokenizer(model: str, dag_dir: Path, home: Path) -> PromptTokenizer | None:
    """The model's own tokenizer when the model is on this machine already (an embedded
    model prepared, or a local directory); never downloads or converts anything."""
    try:
        ref = resolve_model(model, dag_dir=dag_dir, home=home, where="model")
    except UserError:
        return None
    if ref.kind == "embedded":
        embedded = EMBEDDED_MODELS[ref.location]
        directory = embedded.converted_dir(home) if embedded.is_prepared(home) else None
    else:
        directory = Path(ref.location) if ref.kind == "local" else None
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return None
    try:
        return PromptTokenizer(directory)
    except Exception:  # noqa: BLE001  a tokenizer that does not load: the estimate from characters
        return None


def _prompt_tokens(node: NodeSpec, rows: list[dict], upstream_tokens: float, own_output_tokens: float,
                   block_tokens: int, tokenizer: PromptTokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Estimated prompt tokens per row, and the tokens of it the prefix cache serves when
    the requests go in prefix order (whole blocks of the rendered text shared with others;
    upstream outputs, unknown yet, count as not shared). With the model's `tokenizer`, the
    rendered text is counted exactly (chat template included) and only what is not known
    yet (upstream outputs, iteration items) is estimated."""
    node_prompt = NodePrompt(node)
    estimated: list[float] = []
    texts: list[str] = []
    requests: list[EngineRequest] = []
    for row in rows:
        context = template_context(node, row, {r: "" for r in node.reads}, step=1, previous="")
        extra = upstream_tokens
        if node.iterate:  # a step's item counts by the mean length of the row's items, in `extra`
            items = row.get(node.iterate.over) or [""]
            context[node.iterate.item_name] = ""
            extra += estimated_tokens(sum(len(i) for i in items) / len(items)) + own_output_tokens * (len(items) - 1) / len(items)
        rendered = node_prompt.render(context, where=f"nodes.{node.name}")
        text = rendered.text
        texts.append(text)
        requests.append(EngineRequest(str(len(requests)), rendered.prompt, rendered.system or None, node.chat,
                                      messages=rendered.messages))
        estimated.append(estimated_tokens(len(text)) + extra + (CHAT_OVERHEAD_TOKENS if node.chat else 0))
    counts = np.array(estimated, float)
    if tokenizer is not None and requests:
        counted = np.array([len(ids) for ids in tokenizer.token_ids_many(requests)], float)
        counts = counted + (counts - [estimated_tokens(len(t)) + (CHAT_OVERHEAD_TOKENS if node.chat else 0) for t in texts])
    tokens = np.maximum(np.round(counts), 1).astype(np.int64)
    tree = PrefixTree([[ord(c) for c in t] for t in texts], block_tokens * CHARS_PER_TOKEN)
    cached = np.zeros(len(texts), dtype=np.int64)
    cached[tree.order] = tree.cached_tokens() // CHARS_PER_TOKEN
    return tokens, np.minimum(cached, tokens - 1)
