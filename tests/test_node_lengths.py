"""One node's answer lengths as a run learns them (costmodel.calibration.node_lengths): its
outputs, its measured prompts, its outputs still running, its pilot's end and its forecast. No engine."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest, EngineResult, FinishReason
from batchllm.core.sampling import SamplingSpec
from batchllm.costmodel.calibration.node_lengths import (
    PILOT_PRIOR_OUTPUTS,
    PROMPT_PRIOR_UNITS,
    RUNNING_MAX_AGE_S,
    NodeLengths,
    output_length,
)
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.output_lengths import OutputLengths, PilotLearnt

LONG_PRIOR = LengthDistribution.fit(np.arange(100, 401), np.ones(301, bool))  # another set's answers: 100 to 400 tokens, all ended
PLANNED_PROMPT = 50.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def node_lengths(*, max_tokens: int = 512, requests_per_unit: int = 1, planned: float = PLANNED_PROMPT, log_shift=None,
                 clock: Clock | None = None) -> NodeLengths:
    return NodeLengths("gen", LONG_PRIOR, max_tokens=max_tokens, requests_per_unit=requests_per_unit,
                       planned_prompt_tokens=planned, log_shift=log_shift, clock=clock or Clock())


def ended(lengths, prompt_tokens: int = 10, cap: int | None = None) -> list[EngineResult]:
    """Results of `lengths` tokens each, cut (FinishReason.LENGTH) where they reach `cap`."""
    return [EngineResult(i, ("x",), prompt_tokens, int(length),
                         FinishReason.LENGTH if cap is not None and length >= cap else FinishReason.STOP)
            for i, length in enumerate(lengths)]


def mass_above(distribution: LengthDistribution, length: int) -> float:
    """P(X > length)."""
    index = int(np.searchsorted(distribution.lengths, length, side="right")) - 1
    return 1.0 - (float(distribution.cdf[index]) if index >= 0 else 0.0)


# -- output_length ----------------------------------------------------------------------------
def test_an_error_result_gives_no_output_length():
    assert output_length(EngineResult.failed(1, 30, "out of memory"), 1) is None
    assert output_length(EngineResult.failed(1, 30, "out of memory"), 2) is None


def test_an_output_of_two_samples_counts_its_tokens_per_answer_finished_when_stopped_and_cut_at_length():
    assert output_length(EngineResult(1, ("a", "b"), 30, 50, FinishReason.STOP), 2) == (25, True)
    assert output_length(EngineResult(1, ("a", "b"), 30, 50, FinishReason.LENGTH), 2) == (25, False)


# -- observe and the prompts --------------------------------------------------------------------
def test_errors_are_no_evidence_but_still_move_the_version():
    lengths = node_lengths()
    lengths.observe([EngineResult.failed(i, 999, "out of memory") for i in range(5)])
    assert (lengths.units, lengths.prompt_tokens, lengths.calibration.outputs) == (0, 0, 0)
    assert lengths.version == 1
    assert lengths.mean_prompt_tokens() == PLANNED_PROMPT and lengths.prompt_factor() == 1.0
    assert not lengths.has_evidence and lengths.forecast().source == "prior"


def test_an_output_of_n_samples_counts_as_n_answers_and_one_prompt():
    lengths = node_lengths(requests_per_unit=2)
    lengths.observe([EngineResult(1, ("a", "b"), 30, 50, FinishReason.STOP)])
    assert lengths.calibration.outputs == 2.0 and (lengths.units, lengths.prompt_tokens) == (1, 30)


def test_measured_prompts_replace_the_planned_mean_prompt():
    lengths = node_lengths()
    assert lengths.mean_prompt_tokens() == PLANNED_PROMPT
    lengths.observe(ended([20, 20, 20], prompt_tokens=10) + [EngineResult(9, ("x",), 50, 20, FinishReason.STOP)])
    assert lengths.mean_prompt_tokens() == pytest.approx((3 * 10 + 50) / 4)


def test_the_prompt_factor_weighs_the_planned_estimate_as_eight_measured_prompts():
    lengths = node_lengths()
    lengths.observe([EngineResult(i, ("x",), prompt, 20, FinishReason.STOP) for i, prompt in enumerate((10, 20, 30))])
    assert PROMPT_PRIOR_UNITS == 8.0
    assert lengths.prompt_factor() == pytest.approx((8 * 50 + 60) / (8 + 3) / 50)  # 460 / 550
    lengths.observe([EngineResult.failed(9, 10_000, "too long")])  # an error's prompt is not a measure
    assert lengths.prompt_factor() == pytest.approx((8 * 50 + 60) / (8 + 3) / 50)


def test_the_prompt_factor_is_one_without_outputs_or_without_a_planned_estimate():
    assert node_lengths().prompt_factor() == 1.0
    unplanned = node_lengths(planned=0.0)
    unplanned.observe(ended([20, 20], prompt_tokens=500))
    assert unplanned.prompt_factor() == 1.0
    assert unplanned.mean_prompt_tokens() == 500.0


# -- outputs still running --------------------------------------------------------------------
def test_running_ages_are_the_context_per_sequence_less_the_mean_prompt_at_least_one():
    lengths = node_lengths()  # mean prompt: the planned 50
    lengths.observe_running("e0", 4, 4 * (50 + 30))
    lengths.observe_running("e1", 3, 3 * 50 + 100)  # 250 / 3 - 50 = 33.3
    lengths.observe_running("e2", 2, 60)  # 30 per sequence: less than the prompt
    assert lengths.running_engines() == {"e0": (4, 320), "e1": (3, 250), "e2": (2, 60)}
    assert sorted(lengths.running_ages()) == [(1, 2.0), (30, 4.0), (33, 3.0)]
    lengths.observe(ended([20], prompt_tokens=20))  # measured prompts: 20, so every output is 30 tokens older
    assert sorted(lengths.running_ages()) == [(10, 2.0), (60, 4.0), (63, 3.0)]


def test_an_engines_last_step_older_than_the_max_age_says_nothing_of_what_runs_now():
    clock = Clock()
    lengths = node_lengths(clock=clock)
    lengths.observe_running("e0", 4, 4 * (50 + 30))
    clock.now = 5.0
    lengths.observe_running("e1", 2, 2 * (50 + 40))
    clock.now = RUNNING_MAX_AGE_S
    assert set(lengths.running_engines()) == {"e0", "e1"}  # e0's step is exactly the max age old: kept
    clock.now = RUNNING_MAX_AGE_S + 0.5
    assert lengths.running_engines() == {"e1": (2, 180)} and lengths.running_ages() == [(40, 2.0)]
    lengths.observe_running("e0", 1, 50 + 70)  # a new step of e0 replaces its old one
    assert lengths.running_engines() == {"e0": (1, 120), "e1": (2, 180)}


def test_an_engine_whose_last_step_decodes_nothing_has_no_running_outputs():
    lengths = node_lengths()
    lengths.observe_running("e0", 4, 4 * (50 + 30))
    lengths.observe_running("e0", 0, 0)  # its next step decodes nothing (the node's outputs ended, or it runs another node)
    lengths.observe_running("e1", 0, 500)
    assert lengths.running_engines() == {} and lengths.running_ages() == []


def test_a_fresh_node_has_no_evidence_and_one_engine_decoding_gives_it_some():
    clock = Clock()
    lengths = node_lengths(clock=clock)
    assert not lengths.has_evidence
    lengths.observe_running("e0", 0, 0)
    assert not lengths.has_evidence
    lengths.observe_running("e1", 1, 80)
    assert lengths.has_evidence
    clock.now = RUNNING_MAX_AGE_S + 1.0  # that step is too old now
    assert not lengths.has_evidence
    lengths.observe(ended([20]))
    assert lengths.has_evidence


def test_outputs_still_running_past_the_ended_ones_make_the_forecast_longer():
    """A prior of long answers, the run's ended answers short (30 tokens), and two outputs
    still running at age 90: censored there, they say some answers are at least 90 long."""
    without, running = node_lengths(), node_lengths()
    for lengths in (without, running):
        lengths.observe(ended([30] * 64, prompt_tokens=10))
    running.observe_running("e0", 2, 2 * (10 + 90))
    assert running.running_ages() == [(90, 2.0)]
    short, longer = without.forecast().level, running.forecast().level
    assert mass_above(short, 90) == 0.0 and short.lengths[-1] < 90  # nothing past the ended ones' stretched prior
    assert mass_above(longer, 90) > 0.0 and longer.lengths[-1] >= 90  # the running ones' age is reached
    assert longer.mean() > short.mean()
    assert running.forecast().source == without.forecast().source == "pilot"


# -- the pilot's end --------------------------------------------------------------------------
def test_a_pilot_end_forgets_the_outputs_running_before_it():
    """The engines' last steps counted the pilot's last outputs as decoding; they ended in that step."""
    stale, clean = node_lengths(max_tokens=96), node_lengths(max_tokens=96)
    for lengths in (stale, clean):
        lengths.observe(ended([30] * 64, prompt_tokens=10))
    stale.observe_running("e0", 2, 2 * (10 + 90))
    assert stale.forecast().level.mean() > clean.forecast().level.mean()
    assert stale.pilot_ended() == clean.pilot_ended()
    assert stale.running_engines() == {} and stale.running_ages() == []
    after, expected = stale.forecast().level, clean.forecast().level
    assert np.array_equal(after.lengths, expected.lengths) and np.array_equal(after.cdf, expected.cdf)
    assert after.censored_at == expected.censored_at


def test_a_pilot_end_reports_the_capped_means_and_weighs_the_prior_as_half_an_output():
    lengths = node_lengths(max_tokens=96)
    lengths.observe(ended([40] * 64))
    before = lengths.forecast().level.mean()  # the prior counts as 32 outputs: pulled off 40
    learnt = lengths.pilot_ended()
    assert isinstance(learnt, PilotLearnt)
    assert lengths.calibration.prior_outputs == PILOT_PRIOR_OUTPUTS == 0.5
    # every prior answer (100 to 400 tokens) is cut at 96
    assert (learnt.prior_mean_output_tokens, learnt.max_tokens, learnt.spread) == (96.0, 96, None)
    # 64 answers of 40 and half an output of the stretched prior, at least 1 and at most 96 long
    assert (64 * 40 + 0.5 * 1) / 64.5 <= learnt.mean_output_tokens <= (64 * 40 + 0.5 * 96) / 64.5
    assert abs(learnt.mean_output_tokens - 40) < abs(before - 40)
    requests = [EngineRequest(i, f"q{i}", sampling=SamplingSpec(max_tokens=96)) for i in range(3)]
    assert lengths.forecast()(requests) == pytest.approx([learnt.mean_output_tokens] * 3)  # every request alike
    assert "mean answer 40 tokens at max_tokens 96 (the prior's 96)" in learnt.note("gen")


def test_a_pilot_end_without_answers_keeps_the_length_models_whole_spread():
    lengths = node_lengths(max_tokens=96, log_shift=lambda prompts: np.zeros(len(prompts)))
    lengths.observe(ended([40] * 8))
    assert lengths.pilot_ended().spread is None and lengths.spread_now == 1.0


def test_a_length_model_that_reads_the_pilot_well_keeps_its_spread_and_orders_requests_like_the_answers():
    draw = np.random.default_rng(7)
    shifts = draw.normal(0.0, 0.7, 64)
    said = {f"q{i}": shift for i, shift in enumerate(shifts)}
    lengths = node_lengths(max_tokens=96, log_shift=lambda prompts: np.array([said[p.last_user] for p in prompts]))
    requests = [EngineRequest(i, f"q{i}", sampling=SamplingSpec(max_tokens=96)) for i in range(64)]
    assert lengths.forecast().source == "prior"
    answers = np.minimum(np.rint(30 * np.exp(shifts)), 96).astype(int)
    lengths.observe(ended(answers, cap=96))
    assert lengths.forecast().source == "pilot"
    learnt = lengths.pilot_ended([(LengthPrompt.of(r, "gen"), int(n)) for r, n in zip(requests, answers)])
    assert learnt.spread == 1.0 and lengths.spread_now == 1.0
    forecast = lengths.forecast()
    assert forecast.source == "pilot" and forecast.spread == 1.0
    assert np.corrcoef(forecast(requests), answers)[0, 1] > 0.8


def test_the_forecast_comes_from_the_prior_until_an_output_ends():
    lengths = node_lengths()
    assert lengths.forecast().source == "prior"
    lengths.observe_running("e0", 2, 2 * (50 + 30))  # running, not ended
    assert lengths.forecast().source == "prior"
    lengths.observe([EngineResult.failed(0, 10, "out of memory")])
    assert lengths.forecast().source == "prior"
    lengths.observe(ended([20]))
    assert lengths.forecast().source == "pilot"


# -- version ----------------------------------------------------------------------------------
def test_the_version_grows_on_every_observe_running_step_and_pilot_end():
    lengths = node_lengths()
    seen = [lengths.version]
    lengths.observe(ended([20]))
    seen.append(lengths.version)
    lengths.observe([])
    seen.append(lengths.version)
    lengths.observe_running("e0", 2, 160)
    seen.append(lengths.version)
    lengths.observe_running("e0", 0, 0)
    seen.append(lengths.version)
    lengths.pilot_ended()
    seen.append(lengths.version)
    lengths.observe([EngineResult.failed(1, 10, "out of memory")])
    seen.append(lengths.version)
    assert seen == sorted(set(seen)) and seen[0] == 0


# -- the protocol -----------------------------------------------------------------------------
def test_node_lengths_is_what_the_runtime_sees_of_a_nodes_answer_lengths():
    for name in ("sample_lengths", "observe", "forecast", "pilot_ended"):
        protocol = list(inspect.signature(getattr(OutputLengths, name)).parameters)
        assert list(inspect.signature(getattr(NodeLengths, name)).parameters) == protocol, name

    def learn(lengths: OutputLengths) -> PilotLearnt | None:
        lengths.observe(ended([40] * 4))
        assert lengths.forecast().source == "pilot"
        return lengths.pilot_ended()

    seen: OutputLengths = node_lengths(max_tokens=96)
    learnt = learn(seen)
    assert learnt is not None and learnt.max_tokens == 96
