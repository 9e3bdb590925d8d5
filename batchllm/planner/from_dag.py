"""A DAG and its data -> the planner's problem, before anything runs.

The planner reads no data: each node's data summary (`io.node_data`: rows it runs, rounds,
a sample of its prompts with their tokens and prefix-cache hits, rows over the context) is
made once, one layer below, from plain numbers the profiles give (each node's expected
output length, the engine's block size and context). What is known before running is
estimated, and each estimate is stated in the problem's notes (see `io.node_data` for how):
- requests per node: its rows times `n`; a `where:` that reads an upstream output is
  assumed to take an equal share with its sibling `where:` nodes (a note says so);
- prompt tokens per row: the sample's, upstream outputs at their profile's mean length
  (capped by max_tokens);
- output tokens per request: each node's `OutputLengths` (`costmodel.output_lengths`: the
  seam a per-request length model plugs into, `length_sources.LengthModels.planned`; by
  default the profile's CDF).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchllm.core.errors import UserError
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.lora_cost import (
    LORA_DECODE_SEQ_FACTOR_PRIOR,
    LORA_PREFILL_FACTOR_PRIOR,
    LORA_REVISION,
    LORA_SETTING,
    LORA_STEP_OVERHEAD_PRIOR,
    with_adapters,
)
from batchllm.costmodel.output_lengths import UNLEARNT, OutputLengths
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.model import DagSpec
from batchllm.dag.node_task import engine_max_model_len
from batchllm.io.node_data import NodeFacts, NodeSummary, Sources, summarize_dag
from batchllm.planner.cluster import Cluster, candidate_plans, cluster_profile, run_settings
from batchllm.planner.engine_groups import engine_groups, grouped
from batchllm.planner.problem import NodeWorkload, too_big


@dataclass(frozen=True)
class DagWorkloads:
    nodes: list[NodeWorkload]
    notes: tuple[str, ...]
    summaries: dict[str, NodeSummary] = field(default_factory=dict)  # each node's data, in topological order
    groups: tuple[tuple[str, ...], ...] = ()  # engine groups (`planner.engine_groups`): nodes planned as one

    def planning_nodes(self) -> list[NodeWorkload]:
        """What the planner plans: the nodes, each engine group's merged into one."""
        return grouped(self.nodes, self.groups)


def profile_names(model: str) -> list[str]:
    """Profile folder names a DAG's model may be filed under: `owner/name` -> owner_name, name."""
    base = model.rstrip("/").split("/")[-1]
    return list(dict.fromkeys([model.replace("/", "_"), base, base.lower()]))


def _profile_for(model: str, cluster: Cluster, profiles_root: Path, where: str,
                 settings: dict[str, object], store: ProfileStore | None = None) -> tuple[Profile, tuple[str, ...]]:
    """The profile a model is planned with: what the local store learnt on this machine
    (with these settings) when it has it, else the shipped one, with its notes. An engine that
    serves adapters (`LORA_SETTING` in the settings) with no such profile learnt yet takes the
    base's, its steps as long as adapters make them (`costmodel.lora_cost`)."""
    adapters = bool(settings.get(LORA_SETTING))
    adapter_note = (f"{model} serves LoRA adapters: its steps are taken as the base's plus the LoRA ops' own time ({LORA_STEP_OVERHEAD_PRIOR:.2f}x "
                    f"the base's one-sequence step a step, prefill {LORA_PREFILL_FACTOR_PRIOR:.2f}x, each decoding sequence "
                    f"{LORA_DECODE_SEQ_FACTOR_PRIOR:.2f}x) until a run with adapters measures them here",)
    for name in profile_names(model):
        try:
            shipped, notes = cluster_profile(cluster, name, profiles_root, settings)
        except UserError:
            shipped, notes = None, ()
        if store is not None and cluster.local and cluster.identity is not None:
            filed = shipped.model if shipped else name  # filed as the profile names it
            learnt = store.load(cluster.identity, filed, settings)
            if learnt is not None:
                return learnt.profile, (f"prior for {model}: {learnt.describe()}",)
            base = store.load(cluster.identity, filed, {k: v for k, v in settings.items() if k != LORA_SETTING}) if adapters else None
            if base is not None:
                return with_adapters(base.profile), (f"prior for {model}: {base.describe()}", *adapter_note)
        if shipped is not None:
            return (with_adapters(shipped), (*notes, *adapter_note)) if adapters else (shipped, notes)
    available = sorted({p.parent.name for p in profiles_root.glob(f"**/{cluster.hardware}/*/profile.json")})
    raise UserError(f"no profile for model {model!r} on {cluster.hardware}", where=where,
                    hint=f"profiled models there: {', '.join(available) or 'none'}; run `batchllm profile --model {model}` on that hardware")


def dag_workloads(dag: DagSpec, sources: Sources, cluster: Cluster, profiles_root: Path,
                  store: ProfileStore | None = None, home: Path | None = None, *,
                  lengths: Mapping[str, OutputLengths] | None = None, outside: Mapping[str, NodeFacts] | None = None) -> DagWorkloads:
    """`store`: the local profile store, consulted first when the cluster is this machine;
    `home`: $BATCHLLM_HOME, where prepared models' tokenizers count prompts exactly;
    `lengths`: by node, its predicted output lengths (none: each its profile's CDF, which the
    estimates then sample as they always did; given, the workloads carry them, a node not in
    it at its profile's CDF);
    `outside`: facts of upstream nodes not in `dag` (on servers: `server_node_facts`), whose
    answers its nodes' prompts read."""
    profiles: dict[str, Profile] = {}
    profile_notes: dict[str, tuple[str, ...]] = {}
    settings = run_settings(dag.engine, cluster)
    with_lora = {**settings, LORA_SETTING: LORA_REVISION}
    adapter_models = {node.model for node in dag.nodes.values() if node.adapter is not None}
    for name in dag.topological_order():
        node = dag.nodes[name]
        where = dag.where(node.line, f"nodes.{name}")
        profile, profile_notes[name] = _profile_for(node.model, cluster, profiles_root, f"{where}.model",
                                                    with_lora if node.model in adapter_models else settings, store)
        if not candidate_plans(profile, cluster):
            raise too_big(node.model, profile, cluster, f"{where}.model")
        profiles[name] = profile
    facts = {name: NodeFacts(min(p.lengths.mean(), dag.nodes[name].sampling.max_tokens), int(p.engine.get("block_size_tokens", 16)),
                             engine_max_model_len(dag.engine, dag.nodes[name].task) or p.facts.max_model_len)
             for name, p in profiles.items()}
    summaries = summarize_dag(dag, sources, {**(outside or {}), **facts}, home=home)
    notes: list[str] = []
    nodes: list[NodeWorkload] = []
    for name, summary in summaries.items():
        node, profile = dag.nodes[name], profiles[name]
        notes += [note for note in profile_notes[name] if note not in notes]  # hardware or settings the profile differs in
        notes += summary.notes
        n = node.sampling.n
        predicted = (lengths or {}).get(name, UNLEARNT).sample_lengths(summary, profile)
        if len(predicted) != len(summary.prompt_tokens):
            raise ValueError(f"node {name!r}: {len(predicted)} output lengths for {len(summary.prompt_tokens)} sample rows")
        workload = Workload.of(np.repeat(summary.prompt_tokens, n), node.sampling.max_tokens,
                               cached_tokens=np.repeat(summary.cached_tokens, n),
                               output_lengths=predicted.repeat(n) if lengths is not None else None)
        nodes.append(NodeWorkload(name, profile, workload, summary.rounds, tuple(u for u in node.upstream if u != name), n,
                                  output_lengths=predicted, summary=summary))
    return DagWorkloads(nodes, tuple(notes), summaries, engine_groups(dag))


def measured_paces(dag: DagSpec, store: ServerPaceStore) -> dict[str, ServerPace | None]:
    """Per model on servers, the last pace a run measured on its servers (None: none yet), read once."""
    return {model: store.load(model, spec.urls) for model, spec in dag.endpoints.items()}


def server_node_facts(dag: DagSpec, paces: Mapping[str, ServerPace | None]) -> dict[str, NodeFacts]:
    """Per node on servers, its expected answer length for the prompts of nodes that read it:
    the mean answer a run measured on its servers (`measured_paces`), else its max_tokens (no
    profile here describes a model on servers), capped by its max_tokens either way."""
    facts = {}
    for name, node in dag.nodes.items():
        if node.model in dag.endpoints:
            pace = paces.get(node.model)
            measured = pace.output_tokens / pace.answers if pace is not None else float(node.sampling.max_tokens)
            facts[name] = NodeFacts(min(measured, float(node.sampling.max_tokens)))
    return facts
