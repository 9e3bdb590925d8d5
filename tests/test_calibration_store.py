"""Learning across runs: the local profile store keyed by hardware identity, model and
engine settings; a run that measured its engine files a learnt profile and the next plan
on the same machine starts from it (and says so); ETAs from the calibrated model. No engine."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from batchllm.core.requests import EngineResult
from batchllm.costmodel.calibration.latency import scaled
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.latency import StepFeatures, StepLatencyModel, step_features
from batchllm.costmodel.profile import Profile
from batchllm.engines.devices import DeviceSet, hardware_name
from batchllm.engines.hardware import HardwareIdentity, this_machine
from batchllm.engines.protocol import StepRecord
from batchllm.models.registry import batchllm_home
from batchllm.planner import cluster as cluster_module
from batchllm.planner.plan_file import plan_dag_file
from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.ledger import UNIT_BITS, UNIT_MASK
from batchllm.runtime.status import read_status
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import FakeEngine, FakeEngineFactory

REPO = Path(__file__).resolve().parent.parent
GENOA = HardwareIdentity("cpu", "AMD EPYC", "bfloat16", ("avx2", "avx512f", "avx512_bf16"))
SETTINGS = {"enforce_eager": True, "dtype": "bfloat16", "engine_version": "vllm 0.32.0"}


def learnt_profile(identity: HardwareIdentity = GENOA) -> Profile:
    prior = Profile.load(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m")
    shapes = {k: dataclasses.replace(s, latency=scaled(s.latency, 0.25)) for k, s in prior.shapes.items()}
    return dataclasses.replace(prior, kind="learnt", hardware=identity.folder_name, identity=identity, shapes=shapes)


def test_store_round_trip_is_keyed_by_hardware_identity_model_and_settings(tmp_path):
    store = ProfileStore(tmp_path / "store")
    assert store.load(GENOA, "smollm2-135m", SETTINGS) is None
    folder = store.save(learnt_profile(), GENOA, SETTINGS, source="a run of w1", evidence={"steps": 812, "outputs": 150})
    entry = store.load(GENOA, "smollm2-135m", SETTINGS)
    assert entry is not None and entry.folder == folder
    assert entry.profile.kind == "learnt" and entry.profile.identity == GENOA
    assert entry.profile.shapes["w1-tp1"].latency == learnt_profile().shapes["w1-tp1"].latency
    assert entry.record["runs"] == 1 and entry.record["evidence"] == {"steps": 812, "outputs": 150}
    assert "learnt on this machine (1 run" in entry.describe() and "812 steps, 150 outputs" in entry.describe()
    # another CPU kind, other kernel flags, another dtype, engine version or model: nothing
    assert store.load(dataclasses.replace(GENOA, name="Intel Xeon"), "smollm2-135m", SETTINGS) is None
    assert store.load(dataclasses.replace(GENOA, cpu_flags=("avx2",)), "smollm2-135m", SETTINGS) is None
    assert store.load(GENOA, "smollm2-135m", {**SETTINGS, "engine_version": "vllm 0.33.0"}) is None
    assert store.load(GENOA, "smollm2-135m", {**SETTINGS, "max_num_seqs": 64}) is None
    assert store.load(GENOA, "gemma3-270m", SETTINGS) is None
    # settings that do not key an entry (known only once an engine runs) do not hide it
    assert store.load(GENOA, "smollm2-135m", {**SETTINGS, "block_size_tokens": 128}) is not None
    # a second save replaces the entry whole and counts the runs
    store.save(learnt_profile(), GENOA, SETTINGS, source="a run of w2", evidence={"steps": 10, "outputs": 5})
    again = store.load(GENOA, "smollm2-135m", SETTINGS)
    assert again.record["runs"] == 2 and again.record["source"] == "a run of w2"
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no leftovers beside it


def test_a_broken_entry_is_an_error_that_names_its_folder(tmp_path):
    store = ProfileStore(tmp_path / "store")
    folder = store.save(learnt_profile(), GENOA, SETTINGS, source="x", evidence={})
    (folder / "profile.json").write_text("{not json")
    from batchllm.core.errors import UserError

    with pytest.raises(UserError, match=str(folder)):
        store.load(GENOA, "smollm2-135m", SETTINGS)


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.setattr(cluster_module, "this_machine", lambda kind: GENOA)
    monkeypatch.setattr(cluster_module, "installed_engine_version", lambda: "vllm 0.32.0")


def test_the_next_plan_on_the_same_machine_starts_from_the_learnt_profile_and_says_so(machine):
    dag = REPO / "dags" / "chain_summary.yaml"
    shipped = plan_dag_file(dag, "cpu:2")
    assert not any(note.startswith("prior for") for note in shipped.problem.notes)
    ProfileStore.at_home(batchllm_home()).save(learnt_profile(), GENOA, SETTINGS, source="a run of w1",
                                               evidence={"steps": 500, "outputs": 100})
    learnt = plan_dag_file(dag, "cpu:2")
    assert [n for n in learnt.problem.notes if "smollm2-135m" in n] == [
        f"prior for smollm2-135m: {ProfileStore.at_home(batchllm_home()).load(GENOA, 'smollm2-135m', SETTINGS).describe()}"]
    assert not any("does not match" in note for note in learnt.problem.notes)  # it was learnt on this very machine
    assert learnt.chosen.total_s < 0.8 * shipped.chosen.total_s  # four times as fast as the Xeon: faster than the AVX2 EPYC
    # another machine never sees it
    cluster_module_this = dataclasses.replace(GENOA, cpu_flags=("avx2",), dtype="float32")
    import batchllm.planner.cluster as c

    c.this_machine = lambda kind: cluster_module_this  # restored by monkeypatch at teardown
    assert not any(n.startswith("prior for") for n in plan_dag_file(dag, "cpu:2").problem.notes)


def test_planning_for_other_hardware_never_reads_the_store(machine):
    ProfileStore.at_home(batchllm_home()).save(learnt_profile(), GENOA, SETTINGS, source="x", evidence={})
    assert plan_dag_file(REPO / "dags" / "chain_summary.yaml", "2xA100-80G").problem.notes == ()


# -- a run through the executor, with an engine that reports its steps ------------------------
class SteppingEngine(FakeEngine):
    """Answers like FakeEngine, and reports steps timed by `latency`, with outputs of a
    length set by the prompt (some cut at max_tokens)."""

    def __init__(self, config, latency):
        super().__init__(config, per_poll=1)
        self.latency, self._steps = latency, []

    def poll(self, timeout_s: float) -> list[EngineResult]:
        running = len(self.queue)
        results = super().poll(timeout_s)
        for k in range(12):  # a few decode steps per poll, a prefill now and then
            prefill = 120 if k == 0 and running else 0
            features = StepFeatures(prefill, prefill * prefill, running, running * (60 + 5 * k))
            self._steps.append(StepRecord(self.latency.step_s(features), prefill, 1 if prefill else 0, running,
                                          running * (60 + 5 * k), 0, 0))
        lengths = [8 + (sum(map(ord, f'{r.request_id >> UNIT_BITS}:{r.request_id & UNIT_MASK}')) % 40) for r in results]
        return [r._replace(num_output_tokens=n, finish_reason="length" if n >= 40 else "stop")
                for r, n in zip(results, lengths)]

    def drain_steps(self) -> list:
        steps, self._steps = self._steps, []
        return steps


def test_a_run_calibrates_files_what_it_measured_and_the_next_plan_starts_from_it(tmp_path, workspace, monkeypatch):
    monkeypatch.setattr(cluster_module, "installed_engine_version", lambda: "fake")  # the engine that runs is the fake one
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", root / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    prior = Profile.load(root / hardware_name("cpu") / "tiny-model")
    truth = scaled(prior.shapes["w1-tp1"].latency, 2.0)  # this machine: twice as slow as the profile says
    factory = FakeEngineFactory()
    factory_call = lambda config: factory.started.append(SteppingEngine(config, truth)) or factory.started[-1]  # noqa: E731
    console = Console(record=True, width=300)
    dag = workspace.dag(ENSEMBLE_DAG)
    _, progress = run_dag_file(dag, workspace.out, DeviceSet("cpu", (0, 1)), console=console, engine_factory=factory_call,
                               prefix_order=False, schedule="plan", profiles_root=root)
    assert progress.estimates and all(rest_s >= 0 for _, rest_s, _, _ in progress.estimates)  # re-estimated while it ran
    text = console.export_text()
    assert "learnt profile of smollm2-135m saved: " in text  # filed as the profile names the model
    identity = this_machine("cpu")
    settings = cluster_module.run_settings(__import__("batchllm.dag.loader", fromlist=["load_dag"]).load_dag(dag).engine,
                                           cluster_module.local_cluster("cpu", 2))
    entry = ProfileStore.at_home(batchllm_home()).load(identity, "smollm2-135m", settings)
    assert entry is not None and entry.record["evidence"]["steps"] >= 30
    learnt = entry.profile.shapes["w1-tp1"].latency
    features = [StepFeatures(0, 0, b, b * 80) for b in (1, 2, 4)]
    ratios = [learnt.step_s(f) / prior.shapes["w1-tp1"].latency.step_s(f) for f in features]
    assert np.allclose(ratios, 2.0, rtol=0.1)  # the decode steps it saw, now twice the prior
    assert entry.profile.engine["engine_version"] == "fake"  # what the engines reported
    assert entry.profile.shapes["w2-tp1"].latency != prior.shapes["w2-tp1"].latency  # rescaled too
    measured = entry.record["evidence"]["shapes_measured"]
    assert entry.profile.notes["shapes_measured_here"] == measured and "w1-tp1" in measured
    assert entry.profile.notes["shapes_rescaled"] == [k for k in prior.shapes if k not in measured]
    # the next plan on this machine starts from it and says so
    again = plan_dag_file(dag, "cpu:2", profiles_root=root)
    assert [n for n in again.problem.notes if n.startswith("prior for")] == [f"prior for ./tiny-model: {entry.describe()}"]
    status = json.loads((workspace.out / ".batchllm" / "status.json").read_text())
    assert status["state"] == "finished" and "rest_s" not in status  # a finished run has nothing left
    assert read_status(workspace.out).state == "finished"


def test_a_run_on_a_stand_in_engine_files_nothing(tmp_path, workspace, monkeypatch):
    monkeypatch.setattr(cluster_module, "installed_engine_version", lambda: "vllm 0.32.0")
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", root / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    latency = Profile.load(root / hardware_name("cpu") / "tiny-model").shapes["w1-tp1"].latency
    console = Console(record=True, width=300)
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, DeviceSet("cpu", (0, 1)), console=console,
                 engine_factory=lambda config: SteppingEngine(config, latency), prefix_order=False, schedule="plan", profiles_root=root)
    assert "learnt profile of smollm2-135m not saved: its engines reported 'fake', not 'vllm 0.32.0'" in console.export_text()
    assert not (batchllm_home() / "profiles").exists()


ADAPTER_DAG = ENSEMBLE_DAG.replace('prompt: "B {{ question }}"', 'adapter: adapters/b\n        prompt: "B {{ question }}"')


def test_an_engine_with_adapters_is_learnt_apart_from_the_base_and_planned_from_it_until_then(tmp_path, workspace, monkeypatch):
    from batchllm.costmodel.calibration.store import LORA_REVISION, LORA_SETTING
    from batchllm.costmodel.lora_cost import with_adapters
    from batchllm.dag.loader import load_dag
    from testkit.lora_adapters import TINY_BASE, make_lora_adapter

    monkeypatch.setattr(cluster_module, "installed_engine_version", lambda: "fake")
    (workspace.root / "tiny-model" / "config.json").write_text(json.dumps(TINY_BASE))
    make_lora_adapter(workspace.root / "adapters" / "b", TINY_BASE, seed=1, rank=4)
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", root / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    prior_profile = Profile.load(root / hardware_name("cpu") / "tiny-model")
    prior = prior_profile.shapes["w1-tp1"].latency
    store, identity = ProfileStore.at_home(batchllm_home()), this_machine("cpu")
    settings = cluster_module.run_settings(load_dag(workspace.dag(ENSEMBLE_DAG)).engine, cluster_module.local_cluster("cpu", 2))

    def run(dag_text: str, truth: StepLatencyModel, out: str) -> None:
        run_dag_file(workspace.dag(dag_text), workspace.root / out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True),
                     engine_factory=lambda config: SteppingEngine(config, truth), prefix_order=False, schedule="plan",
                     profiles_root=root)

    run(ENSEMBLE_DAG, scaled(prior, 2.0), "base-run")
    base = store.load(identity, "smollm2-135m", settings)
    assert base is not None and store.load(identity, "smollm2-135m", {**settings, LORA_SETTING: LORA_REVISION}) is None
    # before any run with adapters: the base's learnt steps, as long as adapters make them
    planned = plan_dag_file(workspace.dag(ADAPTER_DAG), "cpu:2", profiles_root=root)
    [group] = [node for node in planned.problem.nodes.values() if node.members]
    assert [m.name for m in group.members] == ["a", "b"]
    assert any(note.startswith("./tiny-model serves LoRA adapters: its steps are taken") for note in planned.problem.notes)
    # an engine with adapters: its steps as the prior shapes them (the LoRA ops' time added), 1.5x slower still
    truth = scaled(with_adapters(prior_profile).shapes["w1-tp1"].latency, 3.0)
    run(ADAPTER_DAG, truth, "adapter-run")
    with_lora = store.load(identity, "smollm2-135m", {**settings, LORA_SETTING: LORA_REVISION})
    assert with_lora is not None and with_lora.profile.engine[LORA_SETTING] == LORA_REVISION
    assert store.load(identity, "smollm2-135m", {**settings, LORA_SETTING: True}) is None  # learnt on older LoRA ops: not these
    again = store.load(identity, "smollm2-135m", settings)
    assert again is not None and again.record == base.record  # the base's entry untouched by the run with adapters
    [shape] = with_lora.record["evidence"]["shapes_measured"]
    measured = Profile.load(root / hardware_name("cpu") / "tiny-model").shapes[shape].latency
    features = [StepFeatures(0, 0, b, b * 80) for b in (1, 2, 4)]
    learnt = [with_lora.profile.shapes[shape].latency.step_s(f) for f in features]
    assert np.allclose(learnt, [truth.step_s(f) for f in features], rtol=0.15), learnt  # what its own steps took (decode steps)
    assert all(mine > 3.0 * measured.step_s(f) for mine, f in zip(learnt, features))  # slower than 3x the base: the adapters' part


def test_the_prior_of_an_engine_with_adapters_adds_a_time_a_step_and_scales_prefill_and_decoding_sequences_apart():
    from batchllm.costmodel.calibration.store import LORA_REVISION
    from batchllm.costmodel.lora_cost import with_adapters

    base = Profile.load(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m")
    adapted = with_adapters(base, step_overhead=0.5, decode_seq=2.0, prefill=3.0)
    for key, shape in base.shapes.items():
        before, after = shape.latency, adapted.shapes[key].latency
        added = after.base_s - before.base_s
        assert added == pytest.approx(0.5 * before.step_s(StepFeatures(0, 0, 1, 0))) and added > 0
        prefill = StepFeatures(100, 100 * 100, 0, 0)
        assert after.step_s(prefill) - after.base_s == pytest.approx(3.0 * (before.step_s(prefill) - before.base_s))
        for seqs in (1, 8, 48):  # the added time is a step's, not a sequence's: the ratio falls as batches grow
            decode = StepFeatures(0, 0, seqs, seqs * 300)
            assert after.step_s(decode) == pytest.approx(before.step_s(decode) + added + before.per_decode_seq_s * seqs)
    assert adapted.engine["lora_adapters"] == LORA_REVISION and adapted.lengths is base.lengths


def test_step_features_match_the_profile_builders():
    from batchllm.profiling.profiler import feature_rows as builder

    steps = [StepRecord(0.1, 300, 2, 5, 900, 0, 0), StepRecord(0.2, 0, 0, 7, 700, 0, 0)]
    assert np.allclose([step_features(s) for s in steps], builder(steps))


@pytest.mark.starts_no_engine
@pytest.mark.engine  # the embedded model's package, converted once per checkout into .batchllm-home (as the engine tests do)
def test_the_planner_counts_prompt_tokens_with_the_models_tokenizer_when_it_is_here(workspace, tmp_path):
    from batchllm.core.requests import EngineRequest
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.tokens import PromptTokenizer
    from batchllm.planner.cluster import local_cluster
    from batchllm.planner.from_dag import dag_workloads

    prepared = SMOLLM2_135M.prepare(REPO / ".batchllm-home")
    model = workspace.root / "tiny-model"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(prepared / name, model / name)
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", root / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          answer:
            model: ./tiny-model
            system: Answer briefly.
            prompt: "Question: {{ question }}"
        outputs:
          answers: {columns: {answer: answer}}
    """))
    sources = check_dag(dag, batchllm_home())
    cluster = local_cluster("cpu", 2)
    exact = dag_workloads(dag, sources, cluster, root, home=batchllm_home()).nodes[0].workload.prompt_tokens
    estimated = dag_workloads(dag, sources, cluster, root).nodes[0].workload.prompt_tokens
    tokenizer = PromptTokenizer(model)
    questions = [q for _, q in __import__("tests.conftest", fromlist=["QUESTIONS"]).QUESTIONS]
    counted = [len(ids) for ids in tokenizer.token_ids_many([EngineRequest(str(i), f"Question: {q}", "Answer briefly.")
                                                              for i, q in enumerate(questions)])]
    assert exact.tolist() == counted
    assert estimated.tolist() != counted  # 4 characters a token and a guess for the template


def test_a_pooling_engines_capacity_is_at_least_what_one_step_holds():
    from batchllm.core.requests import ModelTask
    from batchllm.costmodel.calibration.model import kv_capacity_tokens
    from batchllm.engines.devices import Replica
    from batchllm.engines.protocol import EngineConfig, WorkerReady

    ready = WorkerReady(20.0, 128, 128, 128, 2048, 256, "vllm")  # an encoder's one block
    embed = EngineConfig("minilm", Replica("cpu", (0,)), task=ModelTask.EMBED)
    assert kv_capacity_tokens(embed, ready) == 128 * 256  # a 65-token text no longer "needs more KV than the replica has"
    assert kv_capacity_tokens(EngineConfig("smollm", Replica("cpu", (0,))), ready) == 128  # a generation engine's own
