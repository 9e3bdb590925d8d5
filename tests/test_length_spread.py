"""How much of a length model's spread between requests a pilot keeps (costmodel.length_spread),
and what the run does with it: the runtime's split and the plan's simulation both take it."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineResult, FinishReason
from batchllm.costmodel.length_spread import fitted_spread
from batchllm.costmodel.lengths import LengthDistribution


def rng(seed: int = 7) -> np.random.Generator:
    """Each test its own draws, whatever runs before it."""
    return np.random.default_rng(seed)


def level_of(lengths, cap: int) -> LengthDistribution:
    lengths = np.minimum(np.asarray(lengths), cap)
    return LengthDistribution.fit(lengths, lengths < cap)


def test_a_spread_that_holds_on_the_pilot_is_kept_whole():
    draw = rng()
    shifts = draw.normal(0.0, 0.8, 200)
    lengths = np.minimum(np.rint(60 * np.exp(shifts + draw.normal(0, 0.1, 200))), 1000)  # the model is right, up to noise
    assert fitted_spread(level_of(lengths, 1000), shifts, lengths, np.full(200, 1000)) == 1.0


def test_a_spread_that_says_nothing_of_the_set_is_dropped():
    draw = rng()
    shifts = draw.normal(0.0, 0.8, 200)
    lengths = np.rint(60 * np.exp(draw.normal(0.0, 0.5, 200)))  # lengths unrelated to what the model says
    assert fitted_spread(level_of(lengths, 1000), shifts, lengths, np.full(200, 1000)) == 0.0


def test_answers_all_cut_at_max_tokens_keep_no_spread():
    """A conversation set where every answer runs to max_tokens: a model learnt on first turns
    reads the short follow-ups as short answers, and every one of them is as long as the rest."""
    draw = rng()
    shifts = draw.normal(0.0, 1.0, 64)
    lengths = np.full(64, 96)
    assert fitted_spread(level_of(draw.integers(100, 400, 64), 96), shifts, lengths, np.full(64, 96)) == 0.0


def test_half_a_spread_is_kept_when_half_of_it_holds():
    draw = rng()
    shifts = draw.normal(0.0, 1.0, 400)
    lengths = np.rint(60 * np.exp(0.5 * shifts))
    assert fitted_spread(level_of(lengths, 10_000), shifts, lengths, np.full(400, 10_000)) == 0.5


def test_bad_arguments_quote_the_counts_and_one_answer_keeps_the_model():
    level = level_of([10, 20, 30], 100)
    with pytest.raises(ValueError, match="3 shifts, 2 lengths and 3 caps"):
        fitted_spread(level, [0.0, 1.0, 2.0], [10, 20], [100, 100, 100])
    assert fitted_spread(level, [0.3], [10], [100]) == 1.0


# -- in a run ---------------------------------------------------------------------------------
def calibration_of(workspace, log_shift):
    from batchllm.costmodel.output_lengths import UnlearntLengths
    from batchllm.costmodel.request_lengths import RequestLengths
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.models.registry import batchllm_home
    from batchllm.planner.cluster import parse_cluster
    from batchllm.planner.from_dag import dag_workloads
    from batchllm.planner.problem import build_problem
    from batchllm.runtime.run_calibration import RunCalibration
    from tests.test_planner import PROFILES

    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          gen:
            model: smollm2-135m
            prompt: "{{ question }}"
            sampling: {max_tokens: 96}
        outputs:
          answers: {columns: {answer: gen}}
    """))
    cluster = parse_cluster("1xA100-80G", PROFILES)
    class Predicted(UnlearntLengths):
        def sample_lengths(self, summary, profile):
            return RequestLengths(profile.lengths, log_shift(list(summary.samples)), "length model")

    predicted = None if log_shift is None else {"gen": Predicted()}
    workloads = dag_workloads(dag, check_dag(dag, batchllm_home(), resolve_models=False), cluster, PROFILES,
                              lengths=predicted).nodes
    return RunCalibration(build_problem(cluster, workloads), workloads, log_shifts={"gen": log_shift} if log_shift else None)


def commit(calibration, lengths: list[int], cap: int) -> None:
    from batchllm.runtime.step_result import NodeCommit, StepResult

    results = [EngineResult(i, ("x",), 10, length, FinishReason.LENGTH if length >= cap else FinishReason.STOP)
               for i, length in enumerate(lengths)]
    calibration.observe(StepResult(len(results), (NodeCommit.of("gen", results),), (), (), ()))


def test_a_pilot_whose_answers_the_length_model_misreads_makes_every_request_alike_in_split_and_plan(workspace):
    draw = rng()
    from batchllm.core.requests import EngineRequest
    from batchllm.core.sampling import SamplingSpec

    said = {f"q{i}": shift for i, shift in enumerate(draw.normal(0.0, 1.0, 64))}  # what the model reads of each prompt
    calibration = calibration_of(workspace, lambda prompts: np.array([said.get(p.last_user, len(p.last_user) % 5 / 2)
                                                                      for p in prompts]))
    assert calibration.calibrated_workload("gen").workload.output_lengths.log_shift.any()  # the plan's spread, before
    requests = [EngineRequest(i, f"q{i}", sampling=SamplingSpec(max_tokens=96)) for i in range(64)]
    commit(calibration, [96] * 64, 96)  # the pilot: every answer ran to max_tokens
    before = calibration.lengths["gen"].forecast()(requests)
    assert before.max() - before.min() > 10  # the model's spread, as it was

    learnt = calibration.lengths["gen"].pilot_ended([(LengthPrompt.of(r, "gen"), 96) for r in requests])
    assert (learnt.spread, learnt.max_tokens, round(learnt.mean_output_tokens)) == (0.0, 96, 96)
    after = calibration.lengths["gen"].forecast()(requests)
    assert after.max() - after.min() < 1e-9 and after[0] == pytest.approx(96, abs=1)
    planned = calibration.calibrated_workload("gen").workload.output_lengths
    assert planned is not None and not planned.log_shift.any()


def test_a_pilot_the_length_model_reads_well_keeps_its_spread(workspace):
    draw = rng()
    from batchllm.core.requests import EngineRequest
    from batchllm.core.sampling import SamplingSpec

    shifts = draw.normal(0.0, 0.7, 64)
    said = {f"q{i}": shift for i, shift in enumerate(shifts)}
    calibration = calibration_of(workspace, lambda prompts: np.array([said.get(p.last_user, 0.0) for p in prompts]))
    lengths = np.minimum(np.rint(30 * np.exp(shifts)), 96).astype(int).tolist()
    commit(calibration, lengths, 96)
    requests = [EngineRequest(i, f"q{i}", sampling=SamplingSpec(max_tokens=96)) for i in range(64)]
    learnt = calibration.lengths["gen"].pilot_ended([(LengthPrompt.of(r, "gen"), n) for r, n in zip(requests, lengths)])
    assert learnt.spread == 1.0
    forecast = calibration.lengths["gen"].forecast()(requests)
    assert np.corrcoef(forecast, lengths)[0, 1] > 0.8


def test_without_a_length_model_a_pilot_scales_nothing(workspace):
    calibration = calibration_of(workspace, None)
    commit(calibration, [40] * 64, 96)
    learnt = calibration.lengths["gen"].pilot_ended([])
    assert learnt.spread is None and round(learnt.mean_output_tokens) == 40


def test_after_a_pilot_nothing_of_it_counts_as_still_running(workspace):
    """The engines' last steps counted the pilot's last outputs as decoding (they ended in
    that step); taken as still running, at their age, they made the rest's answers longer."""
    from batchllm.engines.devices import Replica
    from batchllm.engines.protocol import EngineConfig, StepRecord
    from batchllm.runtime.step_result import EngineStep, StepResult

    calibration = calibration_of(workspace, None)
    commit(calibration, [30] * 64, 96)
    prompt = calibration.calibrated_workload("gen").workload.prompt_tokens.mean()
    last_step = StepRecord(0.05, 0, 0, 2, int(2 * (prompt + 90)), 0, 0)  # two outputs at age 90 in the last step
    calibration.observe(StepResult(0, (), (EngineStep("gen", EngineConfig("m", Replica("cpu", (0,))), last_step),), (), ()))
    stale = calibration.lengths["gen"].forecast().level.mean()
    assert stale > 31  # taken as two outputs of at least 90 still running
    calibration.lengths["gen"].pilot_ended()
    level = calibration.calibrated_workload("gen").profile.lengths
    assert level.mean() == pytest.approx(30, abs=0.5) and calibration.lengths["gen"].forecast().level.mean() == pytest.approx(30, abs=0.5)
