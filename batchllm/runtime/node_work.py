"""What one node still has to do: pure bookkeeping, no engine code.

A unit of work is (row_id, step). A row takes part when every upstream node it reads
produced an output for it and its `where:` predicate holds; upstream outputs may arrive
while this node runs (`add_upstream`, model-level pipelining), rows join as they do.
Plain nodes have one step per row; iterating nodes have one step per list element, and
step k becomes ready only when step k-1 is committed (its output is step k's `previous`).

Invariant: a unit is handed out at most once per NodeWork, and never when the journal
already holds it; together with the journal this gives exactly-once results.
"""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.compute as pc

from batchllm.engines.protocol import EngineRequest
from batchllm.io.inputs import ROW_ID, InputTable
from batchllm.io.journal import ResultRecord
from batchllm.io.sql import where_row_ids
from batchllm.dag.model import NodeSpec
from batchllm.dag.templates import PromptTemplate, compile_template, render_checked


@functools.lru_cache(maxsize=256)
def _template(source: str) -> PromptTemplate:
    return compile_template(source, where="template", first_line=None)


class NodeWork:
    def __init__(self, node: NodeSpec, data: InputTable, upstream: dict[str, dict[str, str]],
                 done: dict[tuple[str, int], ResultRecord]):
        """`upstream` maps each upstream node to its final text per row_id: all of it, or
        what is final so far when the producers still run (then `add_upstream` the rest)."""
        self.node = node
        self._done = done
        self._data = data
        self._upstream = {u: dict(upstream.get(u, {})) for u in node.upstream}
        self._input_rows = {row[ROW_ID]: row for row in data.table.to_pylist()}
        self._rows: dict[str, dict] = {}
        self._steps: dict[str, int] = {}
        self._admitted: set[str] = set()  # rows whose inputs were all there when looked at
        self._in_flight: dict[str, tuple[str, int]] = {}
        self._handed_out: set[tuple[str, int]] = set()
        self._admit(list(self._input_rows))

    def add_upstream(self, producer: str, texts: dict[str, str]) -> None:
        """More final outputs of an upstream node (model-level pipelining)."""
        self._upstream[producer].update(texts)
        self._admit(list(texts))

    def _admit(self, candidates: list[str]) -> None:
        """Rows whose every upstream output is there take part if their `where:` holds."""
        node = self.node
        complete = [r for r in candidates if r in self._input_rows and r not in self._admitted
                    and all(r in self._upstream[u] for u in node.upstream)]
        if not complete:
            return
        self._admitted.update(complete)
        if node.where:
            table = self._data.table
            kept = table.filter(pc.is_in(table.column(ROW_ID), value_set=pa.array(complete, table.schema.field(ROW_ID).type)))
            columns = {u: pa.array([self._upstream[u][r] for r in kept.column(ROW_ID).to_pylist()], pa.string()) for u in node.upstream}
            complete = list(where_row_ids(kept, columns, node.where, where=f"nodes.{node.name}.where"))
        for row_id in complete:
            row = self._input_rows[row_id]
            self._rows[row_id] = row
            self._steps[row_id] = len(row[node.iterate.over] or []) if node.iterate else 1

    @property
    def total_units(self) -> int:
        return sum(self._steps.values())

    @property
    def done_units(self) -> int:
        return sum(1 for key in self._done if key[0] in self._steps and key[1] < self._steps[key[0]])

    def is_finished(self) -> bool:
        return self.done_units == self.total_units

    def _next_step(self, row_id: str) -> int:
        step = 0
        while (row_id, step) in self._done:
            step += 1
        return step

    def ready_requests(self) -> list[EngineRequest]:
        """Units whose inputs are all committed and that are not done or in flight."""
        requests = []
        for row_id, steps in self._steps.items():
            step = self._next_step(row_id)
            if step < steps and (row_id, step) not in self._handed_out:
                requests.append(self._request(row_id, step))
        return requests

    def _request(self, row_id: str, step: int) -> EngineRequest:
        node, row = self.node, self._rows[row_id]
        context = dict(row)
        context.update({u: self._upstream[u][row_id] for u in node.upstream})
        if node.iterate:
            previous = self._done.get((row_id, step - 1))
            context.update({node.iterate.item_name: row[node.iterate.over][step], "step": step,
                            "previous": previous.text if previous else None})
        where = f"nodes.{node.name} (row {row_id!r}, step {step})"
        render = lambda source: render_checked(_template(source), context, where=where)  # noqa: E731
        request_id = f"{node.name}:{row_id}:{step}"
        self._in_flight[request_id] = (row_id, step)
        self._handed_out.add((row_id, step))
        s = node.sampling
        return EngineRequest(
            request_id=request_id, prompt=render(node.prompt), system=render(node.system) if node.system else None,
            chat=node.chat, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed, n=s.n,
        )

    def record_for(self, request_id: str, texts, num_prompt_tokens, num_output_tokens, finish_reason) -> ResultRecord:
        """The journal record for a finished request of this node."""
        row_id, step = self._in_flight.pop(request_id)
        return ResultRecord(row_id, step, tuple(texts), num_prompt_tokens, num_output_tokens, finish_reason)

    def is_last_step(self, record: ResultRecord) -> bool:
        """The record is its row's final output (what downstream nodes read)."""
        return record.step == self._steps.get(record.row_id, 0) - 1

    def requeue_in_flight(self) -> None:
        """After an engine is lost, its unfinished units may be handed out again."""
        self.requeue(list(self._in_flight))

    def requeue(self, request_ids: list[str]) -> None:
        """These requests were lost with their engine: their units may be handed out again."""
        for request_id in request_ids:
            key = self._in_flight.pop(request_id, None)
            if key is not None:
                self._handed_out.discard(key)

    def final_records(self) -> dict[str, ResultRecord]:
        """Row -> record of its last step, for rows whose every step is committed."""
        final = {}
        for row_id, steps in self._steps.items():
            record = self._done.get((row_id, steps - 1)) if steps else None
            if record is not None:
                final[row_id] = record
        return final
