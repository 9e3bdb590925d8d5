"""Input formats (Parquet file / folder / glob, JSONL, CSV, Hugging Face `save_to_disk`) read
as the same rows, ids and fingerprints; JSONL outputs; bad files refused with exit 2 and
nothing written, neither in the run folder nor in the conversion cache."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

import batchllm.io.input_formats as input_formats
from batchllm.cli import app
from batchllm.core.errors import UserError
from batchllm.dag.loader import load_dag
from batchllm.dag.model import InputSpec
from batchllm.engines.devices import DeviceSet
from batchllm.io.input_source import open_input, open_inputs
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.launch import run_dag_file
from tests.conftest import ENSEMBLE_DAG, QUESTIONS
from tests.fakes import FakeEngineFactory

runner = CliRunner()
# Text that CSV and JSON must quote or escape: delimiters, quotes, line breaks, non-ASCII.
ROWS = [
    {"id": "r1", "question": 'What is "x", really?', "tags": ["a", "b"]},
    {"id": "r2", "question": "two\nlines, and a comma", "tags": []},
    {"id": "r3", "question": "naïve café ✓", "tags": ["c"]},
    {"id": "r4", "question": "plain", "tags": ["d", "e", "f"]},
]
TABLE = pa.Table.from_pylist(ROWS, pa.schema([("id", pa.string()), ("question", pa.string()), ("tags", pa.list_(pa.string()))]))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def write_csv(path: Path, rows: list[dict], columns=("id", "question"), delimiter=",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(columns)
        writer.writerows([[row[c] for c in columns] for row in rows])
    return path


def write_hf(folder: Path, table: pa.Table, shards: int = 2) -> Path:
    """What `Dataset.save_to_disk` writes: Arrow IPC streams (features in the schema's
    metadata), state.json listing them in order, dataset_info.json."""
    folder.mkdir()
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    size = -(-table.num_rows // shards)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table.slice(k * size, size).replace_schema_metadata(schema.metadata), max_chunksize=1)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return folder


def make_source(kind: str, root: Path) -> tuple[Path, str | None]:
    """(path as a DAG names it, format key) of ROWS in one format; CSV has no list column."""
    if kind == "parquet":
        pq.write_table(TABLE, root / "rows.parquet")
        return root / "rows.parquet", None
    if kind in ("parquet-folder", "parquet-glob"):
        (root / "parts").mkdir()
        pq.write_table(TABLE.slice(0, 3), root / "parts" / "part-0.parquet")
        pq.write_table(TABLE.slice(3), root / "parts" / "part-1.parquet")
        (root / "parts" / "_SUCCESS").write_text("")  # what Spark leaves beside its files: ignored
        return (root / "parts", None) if kind == "parquet-folder" else (root / "parts" / "*.parquet", None)
    if kind == "jsonl":
        return write_jsonl(root / "rows.jsonl", ROWS), None
    if kind == "jsonl-gz":
        with gzip.open(root / "rows.jsonl.gz", "wt", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in ROWS))
        return root / "rows.jsonl.gz", None
    if kind == "jsonl-by-key":
        return write_jsonl(root / "rows.txt", ROWS), "jsonl"
    if kind == "csv":
        return write_csv(root / "rows.csv", ROWS), None
    if kind == "tsv":
        return write_csv(root / "rows.tsv", ROWS, delimiter="\t"), None
    if kind == "hf":
        return write_hf(root / "hf_rows", TABLE), None
    raise AssertionError(kind)


def cache_files(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in home.rglob("*")} if home.exists() else set()


KINDS = ["parquet", "parquet-folder", "parquet-glob", "jsonl", "jsonl-gz", "jsonl-by-key", "csv", "tsv", "hf"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_reads_the_same_rows_ids_and_a_stable_fingerprint(kind, tmp_path, isolated_home):
    path, file_format = make_source(kind, tmp_path)
    spec = InputSpec("rows", path, "id", 2, file_format)
    source = open_input(spec)
    columns = ["id", "question"] if kind in ("csv", "tsv") else ["id", "question", "tags"]
    assert source.schema.names == columns
    assert source.num_rows == 4
    assert source.head(10).to_pylist() == [{c: row[c] for c in columns} for row in ROWS]
    assert source.read(1, 3, ["question"]).column(0).to_pylist() == ["two\nlines, and a comma", "naïve café ✓"]
    assert source.row_ids(0, 10).to_pylist() == ["r1", "r2", "r3", "r4"]
    assert source.spec.path == path  # messages name the user's path
    if kind == "parquet":
        assert source.path == path and cache_files(isolated_home) == set()  # read in place
    else:
        assert source.path.parent == isolated_home / "inputs" and source.path.suffix == ".parquet"
        assert cache_files(isolated_home) == {"inputs", f"inputs/{source.path.name}"}
    converted = cache_files(isolated_home)
    again = open_input(spec)
    assert again.path == source.path and again.fingerprint() == source.fingerprint()
    assert cache_files(isolated_home) == converted  # the second open converts nothing
    assert open_input(InputSpec("rows", path, None, 2, file_format)).fingerprint() == source.fingerprint()[:-2]


def test_a_converted_input_is_named_by_its_source_digest(tmp_path):
    """Not by the converted file's bytes: a conversion made again (a cleared cache, another
    DuckDB) keeps earlier runs resumable."""
    spec = InputSpec("rows", write_jsonl(tmp_path / "rows.jsonl", ROWS), "id", 1)
    source = open_input(spec)
    file_sha = hashlib.sha256((tmp_path / "rows.jsonl").read_bytes()).hexdigest()
    expected = hashlib.sha256(f"batchllm-input 1 jsonl\n{file_sha}\n".encode()).hexdigest()
    assert source.fingerprint() == expected + "id" == input_formats.input_digest(spec) + "id"
    assert source.path.name == f"{expected}.parquet"


def test_changed_content_changes_the_fingerprint_and_converts_again(tmp_path, isolated_home):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    before = open_input(InputSpec("rows", path, "id", 1))
    write_jsonl(path, [*ROWS[:3], {**ROWS[3], "question": "changed"}])
    after = open_input(InputSpec("rows", path, "id", 1))
    assert after.fingerprint() != before.fingerprint() and after.path != before.path
    assert after.read(3, 4, ["question"]).column(0).to_pylist() == ["changed"]
    assert len(list((isolated_home / "inputs").iterdir())) == 2


def test_fingerprints_without_opened_sources_match_for_converted_inputs(workspace):
    write_jsonl(workspace.root / "questions.jsonl", [{"id": q, "question": t} for q, t in QUESTIONS])
    dag = load_dag(workspace.dag(ENSEMBLE_DAG.replace("questions.parquet", "questions.jsonl")))
    assert node_fingerprints(dag) == node_fingerprints(dag, open_inputs(dag.inputs))


def test_parquet_parts_with_narrower_types_are_widened(tmp_path):
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.table({"id": ["a"], "n": pa.array([1], pa.int32())}), tmp_path / "parts" / "a.parquet")
    pq.write_table(pa.table({"n": pa.array([2], pa.int64()), "id": ["b"]}), tmp_path / "parts" / "b.parquet")
    source = open_input(InputSpec("rows", tmp_path / "parts", "id", 1))
    assert source.schema == pa.schema([("id", pa.string()), ("n", pa.int64())])
    assert source.head(5).to_pylist() == [{"id": "a", "n": 1}, {"id": "b", "n": 2}]


def test_jsonl_keeps_json_types_and_csv_reads_text(tmp_path):
    write_jsonl(tmp_path / "typed.jsonl", [{"id": 1, "score": 0.5, "meta": {"k": "v"}}, {"id": 2, "score": None, "extra": True}])
    source = open_input(InputSpec("rows", tmp_path / "typed.jsonl", "id", 1))
    assert source.schema.names == ["id", "score", "meta", "extra"]
    assert [str(t) for t in source.schema.types] == ["int64", "double", "struct<k: string>", "bool"]
    assert source.row_ids(0, 2).to_pylist() == ["1", "2"]
    (tmp_path / "codes.csv").write_text("id,n\n007,1.50\n008,\n")
    codes = open_input(InputSpec("rows", tmp_path / "codes.csv", "id", 1))
    assert codes.head(2).to_pylist() == [{"id": "007", "n": "1.50"}, {"id": "008", "n": None}]


def test_a_crash_mid_conversion_leaves_nothing(tmp_path, isolated_home, monkeypatch):
    real = input_formats.convert

    def crashing(source, target):
        real(source, target)
        assert target.is_file()  # written whole, not yet in place
        raise KeyboardInterrupt

    monkeypatch.setattr(input_formats, "convert", crashing)
    with pytest.raises(KeyboardInterrupt):
        open_input(InputSpec("rows", write_jsonl(tmp_path / "rows.jsonl", ROWS), "id", 1))
    assert cache_files(isolated_home) == set()
    monkeypatch.setattr(input_formats, "convert", real)
    assert open_input(InputSpec("rows", tmp_path / "rows.jsonl", "id", 1)).num_rows == 4


# -- a run over each format ---------------------------------------------------------------
CPU2 = DeviceSet("cpu", (0, 1))


def run(workspace, dag_text: str, out: str):
    return run_dag_file(workspace.dag(dag_text, f"{out}.yaml"), workspace.root / out, CPU2, console=Console(quiet=True),
                        engine_factory=FakeEngineFactory(), prefix_order=False, schedule="sequential")


def test_a_run_over_jsonl_and_csv_inputs_writes_what_the_parquet_input_does(workspace):
    write_jsonl(workspace.root / "questions.jsonl", [{"id": q, "question": t} for q, t in QUESTIONS])
    write_csv(workspace.root / "questions.csv", [{"id": q, "question": t} for q, t in QUESTIONS])
    results = {}
    for name in ("questions.parquet", "questions.jsonl", "questions.csv"):
        out = name.replace(".", "_")
        run(workspace, ENSEMBLE_DAG.replace("questions.parquet", name), out)
        results[name] = {file: pq.read_table(workspace.root / out / file).to_pylist()
                         for file in ("judged.parquet", "nodes/a.parquet", "nodes/judge.parquet")}
    assert results["questions.jsonl"] == results["questions.parquet"] == results["questions.csv"]
    assert results["questions.csv"]["judged.parquet"][2] == {
        "row_id": "q3", "question": "Why is the sky blue?", "verdict": "<J <A Why is the sky blue?> | <B Why is the sky blue?>>",
        "a_tokens": len("<A Why is the sky blue?>")}


ROUTED_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      a:
        model: ./tiny-model
        prompt: "A {{ question }}"
      sky:
        model: ./tiny-model
        where: "question LIKE '%%sky%%'"
        prompt: "S {{ question }}"
    outputs:
      routed:
        %s
        columns: {question: question, a: a, sky: sky, sky_tokens: sky.num_output_tokens, reason: sky.finish_reason}
"""


def test_jsonl_output_parses_back_to_the_parquet_output(workspace):
    run(workspace, ROUTED_DAG % "format: parquet", "as_parquet")
    result, _ = run(workspace, ROUTED_DAG % "format: jsonl", "as_jsonl")
    out = workspace.root / "as_jsonl"
    assert result.outputs == {"routed": out / "routed.jsonl"}
    assert not (out / "routed.parquet").exists() and (out / "nodes" / "a.parquet").is_file()
    lines = (out / "routed.jsonl").read_text(encoding="utf-8").splitlines()
    parsed = [json.loads(line) for line in lines]
    assert parsed == pq.read_table(workspace.root / "as_parquet" / "routed.parquet").to_pylist()
    assert parsed[0] == {"row_id": "q1", "question": "What is a prime number?", "a": "<A What is a prime number?>",
                         "sky": None, "sky_tokens": None, "reason": None}
    assert parsed[2]["sky"] == "<S Why is the sky blue?>" and parsed[2]["sky_tokens"] == len("<S Why is the sky blue?>")
    assert [list(p) for p in parsed] == [["row_id", "question", "a", "sky", "sky_tokens", "reason"]] * 4
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".batchllm"] == []  # no temporary left


# -- bad files: exit 2, the message, nothing written -------------------------------------------------
DAG = """
    inputs:
      questions: {path: %s, id_column: id%s}
    nodes:
      answer:
        model: ./tiny-model
        prompt: "{{ question }}"
"""


def refuse(workspace, home: Path, path: str, message: str, extra: str = "") -> str:
    cached = cache_files(home)
    dag = workspace.dag(DAG % (path, extra))
    result = runner.invoke(app, ["run", str(dag), "--out", str(workspace.out), "--devices", "cpu:1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert message in text, text
    assert not workspace.out.exists(), "nothing may be written for a bad input"
    assert cache_files(home) == cached, "nothing may be cached for a bad input"
    return text


BAD_FILES = [
    ("bad.jsonl", '{"id": "q1", "question": "a"}\n\n{"id": "q2", question: "b"}\n',
     "bad.jsonl', line 3: is not valid JSON (Expecting property name enclosed in double quotes at column 14)"),
    ("bad.jsonl", '{"id": "q1", "question": "a"}\n["q2", "b"]\n', "bad.jsonl', line 2: is a JSON list, not an object"),
    ("bad.jsonl", '{"id": "q1", "question": "a"}\n{"id": "q2", "question": "b"', "bad.jsonl', line 2: is not valid JSON"),
    ("bad.jsonl", "\n\n", "input file '{root}/bad.jsonl' has no rows"),
    ("bad.jsonl", '{"id": "q1", "question": "a"}\n{"id": "q1", "question": "b"}\n', "id_column 'id' has duplicate values ('q1' appears 2 times)"),
    ("bad.jsonl", '{"id": "q1", "question": "a"}\n{"question": "b"}\n', "id_column 'id' has 1 null values"),
    ("bad.jsonl", '{"ID": "q1", "question": "a"}\n', "id_column 'id' is not a column of '{root}/bad.jsonl'"),
    ("bad.csv", "id,question\nq1,a\nq2,b,extra\n", "bad.csv', line 3: has 3 fields, the header has 2"),
    ("bad.csv", 'id,question\nq1,"two\nlines"\nq2,"open\nq3,c\n', "bad.csv', line 4: is not valid CSV (unexpected end of data)"),
    ("bad.csv", "id,question\n", "input file '{root}/bad.csv' has no rows"),
    ("bad.csv", b"id,question\nq1,a\nq2,\xff\xfe\n", "bad.csv', line 3: is not UTF-8 text. Fix: save the file as UTF-8"),
    ("bad.parquet", b"PAR1 not really", "bad.parquet' is not a readable Parquet file"),
    ("bad.xml", "<rows/>", "cannot tell the format of '{root}/bad.xml' from its extension. Fix: add `format:`"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES)
def test_bad_files_exit_2_and_write_nothing(workspace, isolated_home, name, content, message):
    target = workspace.root / name
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content, encoding="utf-8")
    text = refuse(workspace, isolated_home, name, message.format(root=workspace.root))
    assert text.startswith("error: inputs.questions: "), text


def test_a_bad_file_leaves_earlier_conversions_alone(workspace, isolated_home):
    write_jsonl(workspace.root / "good.jsonl", [{"id": "q1", "question": "a"}])
    open_input(InputSpec("q", workspace.root / "good.jsonl", "id", 1))
    (workspace.root / "bad.jsonl").write_text('{"id": "q1"}\n{oops}\n')
    refuse(workspace, isolated_home, "bad.jsonl", "bad.jsonl', line 2: is not valid JSON")
    assert len(cache_files(isolated_home)) == 2


def test_bad_parts_and_folders(workspace, isolated_home):
    parts = workspace.root / "parts"
    parts.mkdir()
    pq.write_table(pa.table({"id": ["a"], "question": ["x"]}), parts / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "prompt": ["y"]}), parts / "b.parquet")
    refuse(workspace, isolated_home, "parts", f"'{parts}/b.parquet' has columns id, prompt, but '{parts}/a.parquet' has id, question")
    (parts / "b.parquet").unlink()
    pq.write_table(pa.table({"id": ["b"], "question": [3]}), parts / "b.parquet")
    refuse(workspace, isolated_home, "parts", f"the column types of '{parts}/b.parquet' do not match those of '{parts}/a.parquet'")
    write_jsonl(parts / "c.jsonl", [{"id": "c", "question": "z"}])
    refuse(workspace, isolated_home, "parts", "the input mixes formats")
    refuse(workspace, isolated_home, "'nothing/*.jsonl'", f"input pattern '{workspace.root}/nothing/*.jsonl' matches no file")
    (workspace.root / "empty").mkdir()
    refuse(workspace, isolated_home, "empty", f"input folder '{workspace.root}/empty' has no .parquet, .jsonl or .csv files")
    refuse(workspace, isolated_home, "absent.jsonl", f"input file '{workspace.root}/absent.jsonl' does not exist")


def test_bad_hugging_face_folders(workspace, isolated_home):
    splits = workspace.root / "splits"
    splits.mkdir()
    write_hf(splits / "train", TABLE)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    refuse(workspace, isolated_home, "splits", "holds a Hugging Face DatasetDict (splits: train), not one data set. "
                                               f"Fix: point `path:` at one split's folder, e.g. '{splits}/train'")
    (splits / "train" / "data-00001-of-00002.arrow").unlink()
    refuse(workspace, isolated_home, "splits/train", f"'{splits}/train/data-00001-of-00002.arrow', listed in state.json, does not exist")
    (splits / "train" / "data-00001-of-00002.arrow").write_bytes(b"not arrow at all")
    refuse(workspace, isolated_home, "splits/train", f"'{splits}/train/data-00001-of-00002.arrow' is not a readable Arrow (Hugging Face datasets) file")
    (splits / "train" / "state.json").write_text("{}")
    refuse(workspace, isolated_home, "splits/train", "state.json' does not list the data set's files")
    refuse(workspace, isolated_home, "questions.parquet", "format hf reads a folder written by `save_to_disk`", ", format: hf")


def test_unknown_formats_name_the_line(workspace):
    result = runner.invoke(app, ["run", str(workspace.dag(DAG % ("questions.parquet", ", format: xml"))), "--out", str(workspace.out)])
    assert result.exit_code == 2 and not workspace.out.exists()
    assert "dag.yaml, line 2: inputs.questions.format must be one of parquet, jsonl, csv, hf, got 'xml'" in " ".join(result.output.split())
    body = (DAG % ("questions.parquet", "")) + "    outputs:\n      answers:\n        format: csv\n        columns: {a: answer}\n"
    result = runner.invoke(app, ["run", str(workspace.dag(body)), "--out", str(workspace.out)])
    assert result.exit_code == 2 and not workspace.out.exists()
    assert "dag.yaml, line 9: outputs.answers.format must be one of parquet, jsonl, got 'csv'" in " ".join(result.output.split())


def test_locate_refuses_an_unknown_format_given_directly(tmp_path):
    with pytest.raises(UserError, match="unknown input format 'xml'"):
        open_input(InputSpec("rows", write_jsonl(tmp_path / "rows.jsonl", ROWS), None, 1, "xml"))
