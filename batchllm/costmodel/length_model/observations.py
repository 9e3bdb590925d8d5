"""The outputs a model has written on this machine, kept to fit its length model:

    $BATCHLLM_HOME/lengths/<model folder>/observations.parquet

one row per output: the request's LengthPrompt fields (texts cut to TEXT_CHARS), the key of
the prompt set it came from, its output tokens and whether it finished (False: cut at
max_tokens). The newest MAX_ROWS rows are kept; every write replaces the file whole (written
beside it, then renamed), so a reader sees the old rows or the new ones.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.core.files import replacing
from batchllm.core.length_prompt import LengthPrompt
from batchllm.costmodel.length_model.features import FEATURES_VERSION
from batchllm.costmodel.length_model.gate import GateVerdict, gate, within_sets_concordance
from batchllm.costmodel.length_model.model import LengthModel
from batchllm.costmodel.lengths import LengthDistribution

FOLDER, FILE = "lengths", "observations.parquet"
TEXT_CHARS = 2000
MAX_ROWS = 50_000
HELD_OUT = 0.25  # share of the outputs (or of the prompt sets) the gate scores on
MIN_OUTPUTS = 200
FIT_ROWS = 2_000  # the newest outputs a fit reads
REFIT_SHARE = 0.25  # a kept fit is used until the outputs filed since are this share of those it read
FITTED, VERDICT_FILE = "fitted", "verdict.json"  # the last fit, kept beside the observations
SCHEMA = pa.schema([("last_user", pa.string()), ("system", pa.string()), ("template", pa.string()),
                    ("prompt_tokens", pa.int64()), ("max_tokens", pa.int64()), ("temperature", pa.float64()),
                    ("prompt_set", pa.string()), ("output_tokens", pa.int64()), ("finished", pa.bool_()),
                    ("history_chars", pa.int64())])  # a column added later: null (None, not recorded) in older stores


@dataclass(frozen=True)
class Observations:
    prompts: list[LengthPrompt]
    lengths: np.ndarray
    finished: np.ndarray
    prompt_sets: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def newest(self, count: int) -> Observations:
        if len(self) <= count:
            return self
        return Observations(self.prompts[-count:], self.lengths[-count:], self.finished[-count:], self.prompt_sets[-count:])


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS // 2] + text[-(TEXT_CHARS // 2):]  # both ends: features.py reads them


@dataclass(frozen=True)
class ObservationStore:
    path: Path

    @classmethod
    def at_home(cls, home: Path, model: str) -> ObservationStore:
        return cls(Path(home) / FOLDER / model.replace("/", "_") / FILE)

    def _table(self) -> pa.Table:
        return pq.read_table(self.path, schema=SCHEMA) if self.path.is_file() else SCHEMA.empty_table()

    def add(self, prompts: Sequence[LengthPrompt], lengths: npt.ArrayLike, finished: npt.ArrayLike, prompt_set: str) -> None:
        lengths, finished = np.asarray(lengths, np.int64), np.asarray(finished, bool)
        if not len(prompts) == lengths.size == finished.size:
            raise ValueError(f"{len(prompts)} prompts, {lengths.size} lengths, {finished.size} finished flags")
        new = pa.table({"last_user": [_cut(p.last_user) for p in prompts], "system": [_cut(p.system) for p in prompts],
                        "template": [p.template for p in prompts], "prompt_tokens": [int(p.prompt_tokens) for p in prompts],
                        "max_tokens": [int(p.max_tokens) for p in prompts],
                        "temperature": [float(p.temperature) for p in prompts], "prompt_set": [prompt_set] * len(prompts),
                        "output_tokens": lengths, "finished": finished,
                        "history_chars": [p.history_chars for p in prompts]}, schema=SCHEMA)
        table = pa.concat_tables([self._table(), new])
        if table.num_rows > MAX_ROWS:
            table = table.slice(table.num_rows - MAX_ROWS)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(self.path) as target:
            pq.write_table(table, target.path)

    def load(self) -> Observations:
        table = self._table()
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        names = [f.name for f in fields(LengthPrompt)]
        prompts = [LengthPrompt(*values) for values in zip(*(columns[n] for n in names))] if table.num_rows else []
        return Observations(prompts, np.asarray(columns["output_tokens"], np.int64), np.asarray(columns["finished"], bool),
                            columns["prompt_set"])

    def prompt_sets(self) -> set[str]:
        table = self._table()
        return set(table.column("prompt_set").unique().to_pylist()) if table.num_rows else set()

    def fitted_model(self, min_outputs: int = MIN_OUTPUTS, seed: int = 0) -> tuple[LengthModel | None, GateVerdict]:
        """The length model fit on the stored outputs, when it beats the per-model CDF on
        held-out ones (whole prompt sets when there are three or more, scored as for a new
        set: a model is used on sets it has not seen), refit on all of them; else None, and the
        verdict says why: `use` for its lengths, `ranks` for ordering requests inside a prompt set
        (whose level the run learns). Use `.for_new_set()` of it for a prompt set not in prompt_sets().

        A fit reads the newest FIT_ROWS outputs (its cost grows faster than the rows: 4 s for
        1,750 real outputs, 2 s for 832 of 45 prompt sets, on 2 AVX-512 cores; 14 s for 851 on
        the same cores with two engines loading beside it) and is kept beside the observations,
        reused until they change by REFIT_SHARE of what it read: every computing run files its
        outputs, so refitting on every change made nearly every command's start pay for a fit
        that a few more outputs hardly move."""
        stamp = self._stamp(min_outputs, seed)
        kept = self._kept(stamp, min_outputs)
        if kept is not None:
            return kept
        model, verdict = self._fit(min_outputs, seed)
        if stamp is not None:
            self._keep(stamp, model, verdict)
        return model, verdict

    def _stamp(self, min_outputs: int, seed: int) -> dict | None:
        """What a kept fit was made from: the observations file as it was (and its rows), and the arguments."""
        if not self.path.is_file():
            return None
        stat = self.path.stat()
        return {"file": f"{stat.st_size}-{stat.st_mtime_ns}", "rows": pq.ParquetFile(self.path).metadata.num_rows,
                "arguments": f"{min_outputs}-{seed}-{FIT_ROWS}-{FEATURES_VERSION}"}

    def _kept(self, stamp: dict | None, min_outputs: int) -> tuple[LengthModel | None, GateVerdict] | None:
        """The kept fit, if it was made from these observations, or from all but a few new ones
        (fewer than REFIT_SHARE of the rows it read, once it read at least `min_outputs`)."""
        folder = self.path.parent / FITTED
        try:
            record = json.loads((folder / VERDICT_FILE).read_text())
            made_from = record.pop("stamp")
            if stamp is None or not isinstance(made_from, dict) or made_from["arguments"] != stamp["arguments"]:
                return None
            fit_rows = int(made_from["rows"])
            grown = stamp["rows"] - fit_rows
            few_new = fit_rows >= min_outputs and 0 < grown < REFIT_SHARE * min(fit_rows, FIT_ROWS)
            if made_from["file"] != stamp["file"] and not few_new:
                return None
            return (LengthModel.load(folder) if record.pop("model") else None), GateVerdict(**record)
        except (OSError, ValueError, KeyError, TypeError):  # none kept, or from another version: fit again
            return None

    def _keep(self, stamp: dict, model: LengthModel | None, verdict: GateVerdict) -> None:
        folder = self.path.parent / FITTED
        folder.mkdir(parents=True, exist_ok=True)
        if model is not None:
            model.save(folder)
        with replacing(folder / VERDICT_FILE) as new:  # last: a fit half kept is not found
            new.path.write_text(json.dumps({"stamp": stamp, "model": model is not None, **asdict(verdict)}))

    def _fit(self, min_outputs: int, seed: int) -> tuple[LengthModel | None, GateVerdict]:
        seen = self.load().newest(FIT_ROWS)
        if len(seen) < min_outputs:
            return None, GateVerdict(False, float("nan"), float("nan"),
                                     f"{len(seen)} outputs stored, fewer than {min_outputs}: the per-model CDF is kept")
        held = _held_out(seen.prompt_sets, seed)
        by_sets = bool(held.any())
        if held.all() or not by_sets:
            held = np.random.default_rng(seed).random(len(seen)) < HELD_OUT
        train, test = np.flatnonzero(~held), np.flatnonzero(held)
        model = LengthModel.fit([seen.prompts[i] for i in train], seen.lengths[train], seen.finished[train],
                                groups=[seen.prompt_sets[i] for i in train], seed=seed)
        cdf = LengthDistribution.fit(np.maximum(seen.lengths[train], 1), seen.finished[train])
        scored = model.for_new_set() if by_sets else model  # held-out sets are new to it
        held_prompts = [seen.prompts[i] for i in test]
        verdict = gate(scored, cdf, held_prompts, seen.lengths[test], seen.finished[test])
        ranking = within_sets_concordance(model, held_prompts, seen.lengths[test], seen.finished[test],
                                          [seen.prompt_sets[i] for i in test])
        verdict = replace(verdict, concordance=ranking,
                          reason=f"{verdict.reason}; within a held-out prompt set it orders answers at C {ranking:.2f}")
        if not (verdict.use or verdict.ranks):
            return None, verdict
        return LengthModel.fit(seen.prompts, seen.lengths, seen.finished, groups=seen.prompt_sets, seed=seed), verdict


def _held_out(prompt_sets: list[str], seed: int) -> np.ndarray:
    """Rows of about HELD_OUT of the prompt sets (picked by a stable hash), when there are >= 3."""
    keys = sorted(set(prompt_sets))
    if len(keys) < 3:
        return np.zeros(len(prompt_sets), bool)
    ranked = sorted(keys, key=lambda key: zlib.crc32(f"{seed}:{key}".encode()))
    chosen = set(ranked[:max(1, round(HELD_OUT * len(keys)))])
    return np.array([key in chosen for key in prompt_sets], bool)
