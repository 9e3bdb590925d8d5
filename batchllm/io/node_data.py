"""What each node of a DAG will read, before anything runs: one summary per node, computed
once from its input (without loading it) and handed to the planner, which never reads
data itself.

Per node:
- rows it will run: its input's rows, no more than its upstream nodes produce; a `where:`
  over input columns only is counted on the data (and the sample is taken from the rows it
  keeps); one that reads an upstream output is assumed to take an equal share with its
  sibling `where:` nodes (nodes reading the same upstream nodes), since the router has not
  answered yet;
- rounds of an iterating node: the list lengths of its `iterate.over` column;
- a sample of its rendered prompts (the first `SAMPLE_ROWS` rows it keeps): prompt tokens
  per row, counted by the model's tokenizer when the model is on this machine (chat template
  included), else at 4 characters a token, plus what is not known yet (each upstream node's
  expected output, and for iteration the item and the previous step's output: plain numbers
  the caller gives, from its profiles);
- prefix-cache hits per sample row: the whole cache blocks of its rendered text it shares
  with other rows (the runtime sends requests in prefix order);
- rows over the model's context (prompt tokens + 1 > max_model_len: the engine refuses
  them), exact on the sample and scaled to the rows;
- for each sample row, what a length model reads of the request, as plain values.

The io layer: no cost model, no planner. Row counts come from the Parquet footer, the
sample from the first rows, an iterating node's rounds from its list column's lengths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchllm.core.errors import UserError
from batchllm.core.images import ImageSource, order_key_ids
from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest
from batchllm.core.text_tokens import CHARS_PER_TOKEN, estimated_tokens
from batchllm.dag.context import nearest_samples, template_context, upstream_stand_ins
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.dag.node_prompt import NodePrompt
from batchllm.dag.sql_names import sql_identifiers
from batchllm.io.input_source import ROW_ID, InputSource
from batchllm.io.sql import rows_where
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.registry import resolve_model
from batchllm.models.tokens import PromptTokenizer
from batchllm.ordering.prefix_tree import PrefixTree

CHAT_OVERHEAD_TOKENS = 12  # role markers of a chat template
SAMPLE_ROWS = 1000

Sources = Mapping[str, InputSource]  # input name -> its table, as `check_dag` opens them


@dataclass(frozen=True)
class NodeFacts:
    """What the summary needs from a node's model profile, as plain numbers."""

    expected_output_tokens: float  # the node's mean output length, capped by its max_tokens
    block_tokens: int = 16  # the engine's prefix-cache block
    max_model_len: int | None = None  # the engine's context; None: not known, nothing counted over it


@dataclass(frozen=True)
class NodeSummary:
    name: str
    model: str
    rows: float  # rows (units before `n`) it will run, estimated as the module says
    share: float  # of the rows it reads, what its `where:` keeps (1.0 without one)
    share_assumed: bool  # its `where:` reads upstream outputs: the share is assumed, not counted
    rounds: tuple[int, ...]  # requests per round (`n` included): (N,) for a plain node, per step for an iterating one
    requests_per_unit: int  # the node's sampling.n
    prompt_tokens: np.ndarray  # per sample row
    cached_tokens: np.ndarray  # per sample row: prompt tokens the prefix cache serves
    tokens_counted: bool  # by the model's tokenizer (else 4 characters a token)
    tokens_estimated: bool  # the prompt tokens include estimates (characters, upstream outputs, iteration items)
    samples: tuple[LengthPrompt, ...]  # what a length model reads of each sample row, in the order of `prompt_tokens`
    max_model_len: int | None
    sample_over_context: int  # sample rows whose prompt leaves no room for one output token
    rows_over_context: int  # the same, scaled to `rows` when the sample is not all of them
    notes: tuple[str, ...] = ()

    @property
    def requests(self) -> int:
        return sum(self.rounds)

    @property
    def sample_is_all_rows(self) -> bool:
        return not self.share_assumed and len(self.prompt_tokens) == round(self.rows)

    @property
    def over_context_estimated(self) -> bool:
        """The count of rows over context is an estimate: from a sample, or of estimated tokens."""
        return not self.sample_is_all_rows or self.tokens_estimated

    def prompt_token_stats(self) -> dict[str, int]:
        """p50, p90 and max of the sample's prompt tokens (0 without a sample)."""
        if not len(self.prompt_tokens):
            return {"p50": 0, "p90": 0, "max": 0}
        p50, p90 = np.percentile(self.prompt_tokens, [50, 90])
        return {"p50": int(round(p50)), "p90": int(round(p90)), "max": int(self.prompt_tokens.max())}


UNKNOWN_ANSWER_TOKENS = 128  # an upstream node the caller gave no facts of: the default max_tokens
UNKNOWN_IMAGE_TOKENS = 576  # an image of a model whose files are not here: LLaVA-1.5's (336 px in patches of 14)


def summarize_dag(dag: DagSpec, sources: Sources, facts: Mapping[str, NodeFacts], *,
                  home: Path | None = None) -> dict[str, NodeSummary]:
    """Every node's summary, in topological order. `facts`: per node, from its profile;
    `home`: $BATCHLLM_HOME, where prepared models' tokenizers count prompts exactly (None:
    every prompt is estimated from its characters)."""
    tokenizers: dict[str, PromptTokenizer | None] = {}
    rows_of: dict[str, float] = {}
    summaries: dict[str, NodeSummary] = {}
    first_records: dict[str, dict] | None = None  # each input's first row, for the nearest lists' stand-ins
    for name in dag.topological_order():
        node = dag.nodes[name]
        source = sources[node.input_name]
        share, sample = _where_share(dag, node, source)
        input_only = _where_reads_input_only(dag, node)
        notes = (f"{name}: `where` assumed to keep {share:.0%} of rows (shared with its sibling routes)",) \
            if share < 1 and not input_only else ()
        rows = min([source.num_rows] + [_rows_read(dag, r, rows_of, source.num_rows) for r in node.reads]) * share
        rows_of[name] = rows
        upstream_tokens = sum(max(facts[m].expected_output_tokens if m in facts else UNKNOWN_ANSWER_TOKENS
                                  for m in dag.merges.get(r, (r,))) for r in node.reads)
        if home is not None and node.model not in tokenizers:
            tokenizers[node.model] = local_tokenizer(node.model, dag.path.parent, home)
        tokenizer = tokenizers.get(node.model)
        own = facts[name]
        if node.nearest_read and first_records is None:  # read once, for the first node that needs them
            first_records = {n: sources[n].head_rows(1).to_pylist()[0] for n in dag.inputs}
        nearest = nearest_samples(dag, node, first_records) if first_records is not None else {}
        prompts, cached, rendered = _prompt_tokens(node, sample, upstream_tokens, own.expected_output_tokens,
                                                   own.block_tokens, tokenizer, {**upstream_stand_ins(dag, node), **nearest})
        n = node.sampling.n
        if node.iterate:
            rounds = tuple(int(round(c * share * n)) for c in _rows_longer(source.list_lengths(node.iterate.over)))
        else:
            rounds = (int(round(rows * n)),)
        if sum(rounds) == 0:
            rounds = (0,)
        samples = tuple(LengthPrompt.of(r, node.name, int(t)) for r, t in zip(rendered, prompts))
        over = int(np.count_nonzero(prompts + 1 > own.max_model_len)) if own.max_model_len is not None else 0
        assumed = bool(node.where) and not input_only
        all_rows = not assumed and len(prompts) == round(rows)
        rows_over = over if all_rows or not len(prompts) else int(round(over / len(prompts) * rows))
        summaries[name] = NodeSummary(name, node.model, rows, share, assumed, rounds, n, prompts, cached, tokenizer is not None,
                                      tokenizer is None or upstream_tokens > 0 or node.iterate is not None, samples,
                                      own.max_model_len, over, rows_over, notes)
    return summaries


def _rows_longer(lengths: np.ndarray) -> np.ndarray:
    """Element k: how many rows have more than k list elements (k = 0 .. longest - 1)."""
    per_length = np.bincount(lengths, minlength=1)
    return len(lengths) - np.cumsum(per_length)[:-1]


def _rows_read(dag: DagSpec, name: str, rows_of: dict[str, float], rows: int) -> float:
    """Rows with an output of what a node reads: an upstream node's, or a merge's (its
    members' rows together, at most every row); a node not in this DAG (on servers, left
    out of the planner's part) counts as answering every row."""
    members = dag.merges.get(name, (name,))
    return min(sum(rows_of.get(m, rows) for m in members), rows)


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


def _image_tokens_beside_text(tokenizer: PromptTokenizer | None) -> int:
    """An image's prompt tokens besides what its text counts: the tokenizer counts its placeholder,
    which the engine expands to the image's tokens; without the model's files, LLaVA-1.5's."""
    if tokenizer is not None and tokenizer.image_tokens is not None:
        return tokenizer.image_tokens - 1
    return UNKNOWN_IMAGE_TOKENS


def _prefix_key(images: tuple[ImageSource, ...], text: str) -> list[int]:
    """A row's key in the prefix tree, a character a token: its images' stand-in tokens (as the
    runtime's prefix order keys them, see core.images.order_key_ids), then its text."""
    return [i for i in order_key_ids(images) for _ in range(CHARS_PER_TOKEN)] + [ord(c) for c in text]


def _prompt_tokens(node: NodeSpec, rows: list[dict], upstream_tokens: float, own_output_tokens: float,
                   block_tokens: int, tokenizer: PromptTokenizer | None, upstream: Mapping[str, object]
                   ) -> tuple[np.ndarray, np.ndarray, list[EngineRequest]]:
    """Estimated prompt tokens per row, the tokens of it the prefix cache serves when the
    requests go in prefix order (whole blocks of the rendered text shared with others;
    upstream outputs, unknown yet, count as not shared), and the rendered prompts. With the
    model's `tokenizer`, the rendered text is counted exactly (chat template included) and
    only what is not known yet (upstream outputs, iteration items) is estimated. `upstream`: what
    the node reads by name, as stand-ins (empty texts, 0.0 for scores; nearest lists as their
    corpus's first row, k times)."""
    node_prompt = NodePrompt(node)
    estimated: list[float] = []
    texts: list[str] = []
    keys: list[list[int]] = []  # the prefix order's: the text after its images' digests
    requests: list[EngineRequest] = []
    pairs: list[EngineRequest] = []  # a score node's second texts: prompt tokens of its request too
    for row in rows:
        context = template_context(node, row, upstream, step=1, previous="")
        extra = upstream_tokens
        if node.iterate:  # a step's item counts by the mean length of the row's items, in `extra`
            items = row.get(node.iterate.over) or [""]
            context[node.iterate.item_name] = ""
            extra += estimated_tokens(sum(len(i) for i in items) / len(items)) + own_output_tokens * (len(items) - 1) / len(items)
        rendered = node_prompt.render(context, where=f"nodes.{node.name}")
        text = rendered.text
        texts.append(text)
        keys.append(_prefix_key(rendered.images, text))
        requests.append(EngineRequest(str(len(requests)), rendered.prompt, rendered.system or None, node.chat, node.sampling,
                                      messages=rendered.messages, images=rendered.images, adapter=node.adapter))
        extra += len(rendered.images) * _image_tokens_beside_text(tokenizer)
        if rendered.pair is not None:
            pairs.append(EngineRequest(str(len(pairs)), rendered.pair, chat=False))
        estimated.append(estimated_tokens(len(text)) + extra + (CHAT_OVERHEAD_TOKENS if node.chat else 0))
    counts = np.array(estimated, float)
    if tokenizer is not None and requests:
        counted = np.array([len(ids) for ids in tokenizer.token_ids_many(requests)], float)
        if pairs:  # text (rendered.text) holds the pair: counted apart, as the engine takes it
            counted += [len(ids) for ids in tokenizer.token_ids_many(pairs)]
        counts = counted + (counts - [estimated_tokens(len(t)) + (CHAT_OVERHEAD_TOKENS if node.chat else 0) for t in texts])
    tokens = np.maximum(np.round(counts), 1).astype(np.int64)
    tree = PrefixTree(keys, block_tokens * CHARS_PER_TOKEN)
    cached = np.zeros(len(texts), dtype=np.int64)
    cached[tree.order] = tree.cached_tokens() // CHARS_PER_TOKEN
    return tokens, np.minimum(cached, tokens - 1), requests
