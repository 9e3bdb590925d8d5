"""A run's files at its end: each node's file and the DAG's output data sets, from the journals."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from batchllm.dag.model import DagSpec
from batchllm.io.input_source import InputSource
from batchllm.io.node_journal import ResultJournal
from batchllm.io.output_files import FinalSource, InputFile, write_node_file, write_output_set
from batchllm.io.remote_files import copy_out
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_report import RunReport


def write_outputs(dag: DagSpec, sources: Mapping[str, InputSource], journals: Mapping[str, ResultJournal], run_dir: RunDir,
                  report: RunReport) -> dict[str, Path]:
    """The node files and the output data sets. A run with a failed node (`report.failed`) writes
    only what has results (a file of nulls would pass for an answer), marks those files incomplete
    in the report, and copies none to `copy_to`; the run that completes replaces them."""
    complete = not report.failed
    has_results = {n: journal.stats().committed > 0 for n, journal in journals.items()}
    files = {name: InputFile(source.path, source.id_column) for name, source in sources.items()}
    for name, journal in journals.items():
        if complete or has_results[name]:
            write_node_file(journal, files[dag.nodes[name].input_name], run_dir.node_path(name))
    finals = {n: FinalSource(journal, iterate.over if (iterate := dag.nodes[n].iterate) else None) for n, journal in journals.items()}
    written = {}
    for name, spec in dag.outputs.items():
        feeding = {member for ref in spec.columns.values() if ref.node for member in dag.merges.get(ref.node, (ref.node,))}
        if not complete and not any(has_results[n] for n in feeding):
            continue
        written[name] = run_dir.output_path(name, spec.format)
        write_output_set(spec, files[spec.input_name], finals, dag.merges, written[name])
        report.outputs[name] = {"path": str(written[name]), "complete": complete}
        if spec.copy_to is not None and complete:
            copy_out(written[name], spec.copy_to, where=f"outputs.{name}.copy_to")
    return written
