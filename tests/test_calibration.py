"""Calibration while running: the step-latency refit, the prior's fading weight, output
lengths with censoring, start costs, and a model's calibrated profile. No engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from batchllm.costmodel.calibration.latency import LatencyCalibration, prior_design, scaled
from batchllm.costmodel.calibration.lengths import LengthCalibration
from batchllm.costmodel.calibration.loads import PRIOR_LOADS, LoadCalibration
from batchllm.costmodel.calibration.model import SHAPES_MEASURED_HERE, ModelCalibration
from batchllm.costmodel.latency import StepFeatures, StepLatencyModel
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.nnls import nnls_normal
from batchllm.costmodel.profile import Profile

REPO = Path(__file__).resolve().parent.parent
TRUTH = StepLatencyModel(base_s=0.05, per_prefill_token_s=0.002, per_attention_unit_s=5e-7, per_decode_seq_s=0.004,
                         per_context_token_s=4e-6)
# another machine's numbers: slower, and not by one factor
FOREIGN = StepLatencyModel(base_s=0.08, per_prefill_token_s=0.0042, per_attention_unit_s=5.2e-7, per_decode_seq_s=0.0054,
                           per_context_token_s=4.3e-6)


def synthetic_steps(count: int, seed: int, model: StepLatencyModel = TRUTH, noise: float = 0.03,
                    kinds: tuple[str, ...] = ("prefill", "decode", "mixed")) -> tuple[np.ndarray, np.ndarray]:
    """Steps as an engine reports them (prefills, decodes of many batch sizes, mixed), timed by `model` with noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        kind = kinds[rng.integers(len(kinds))]
        prefill = int(rng.integers(16, 2048)) if kind != "decode" else 0
        requests = int(rng.integers(1, 8))
        seqs = int(rng.integers(1, 129)) if kind != "prefill" else 0
        rows.append((prefill, prefill * prefill / requests, seqs, seqs * int(rng.integers(50, 1500))))
    features = np.array(rows, float)
    seconds = np.array([model.step_s(StepFeatures(*row)) for row in features]) * np.exp(rng.normal(0.0, noise, count))
    return features, seconds


def relative(model: StepLatencyModel, truth: StepLatencyModel) -> dict[str, float]:
    return {key: value / getattr(truth, key) for key, value in model.to_dict().items()}


def prediction_error(model: StepLatencyModel, seed: int = 99) -> float:
    """Median relative error of `model` against TRUTH on fresh noiseless steps."""
    features, seconds = synthetic_steps(400, seed, noise=0.0)
    predicted = np.array([model.step_s(StepFeatures(*row)) for row in features])
    return float(np.median(np.abs(predicted / seconds - 1.0)))


# -- step latency ------------------------------------------------------------------------
def test_nnls_from_normal_equations_matches_the_known_solution_and_keeps_coefficients_non_negative():
    rng = np.random.default_rng(1)
    a = rng.random((200, 4)) * np.array([1.0, 1e3, 1e6, 10.0])  # columns of very different scales
    x_true = np.array([0.5, 2e-3, 0.0, 0.3])
    b = a @ x_true
    x = nnls_normal(a.T @ a, a.T @ b)
    assert np.allclose(x, x_true, rtol=1e-6, atol=1e-12)
    b_negative = a @ np.array([0.5, -2e-3, 1e-7, 0.3])  # the best fit wants a negative coefficient
    assert (nnls_normal(a.T @ a, a.T @ b_negative) >= 0).all()


def test_the_refit_converges_to_known_coefficients_from_synthetic_steps():
    calibration = LatencyCalibration.for_engine(FOREIGN, max_num_seqs=128, max_num_batched_tokens=2048)
    features, seconds = synthetic_steps(5000, seed=0)
    calibration.observe_many(features, seconds)
    for key, ratio in relative(calibration.model(), TRUTH).items():
        assert ratio == pytest.approx(1.0, abs=0.03), key
    assert prediction_error(calibration.model()) < 0.01
    assert calibration.steps == 5000


def test_on_a_busy_machine_the_steps_total_is_kept_though_stalls_are_rare_ratios():
    """One step in ten stalls (another process had the core) and takes 3x: relative error
    fits the typical step, the total correction makes the sum right."""
    features, seconds = synthetic_steps(2000, seed=11)
    stalled = np.random.default_rng(12).random(seconds.size) < 0.1
    seconds = np.where(stalled, seconds * 3.0, seconds)
    calibration = LatencyCalibration.for_engine(FOREIGN, 128, 2048)
    calibration.observe_many(features, seconds)
    model = calibration.model()
    predicted = sum(model.step_s(StepFeatures(*row)) for row in features)
    assert predicted == pytest.approx(seconds.sum(), rel=0.01)
    typical = sum(TRUTH.step_s(StepFeatures(*row)) for row in features)
    assert seconds.sum() > 1.15 * typical  # what a fit of the typical step alone would miss


def test_with_no_steps_the_posterior_is_the_prior():
    calibration = LatencyCalibration.for_engine(FOREIGN, 128, 2048)
    assert calibration.prior_share == 1.0 and calibration.speed_factor() == 1.0
    for key, ratio in relative(calibration.model(), FOREIGN).items():
        assert ratio == pytest.approx(1.0, rel=1e-6), key


def test_the_priors_weight_fades_as_steps_arrive():
    calibration = LatencyCalibration.for_engine(FOREIGN, 128, 2048)
    features, seconds = synthetic_steps(2000, seed=2)
    shares, errors, seen = [calibration.prior_share], [prediction_error(calibration.model())], 0
    for count in (4, 40, 400, 2000):
        calibration.observe_many(features[seen:count], seconds[seen:count])
        seen = count
        shares.append(calibration.prior_share)
        errors.append(prediction_error(calibration.model()))
    assert shares == sorted(shares, reverse=True) and shares[-1] < 0.02
    assert errors == sorted(errors, reverse=True)  # every batch of steps brings it closer to the truth
    assert errors[0] > 0.3 and errors[1] > 0.05 and errors[-1] < 0.01  # a few steps move it a little, many a lot


def test_a_stronger_prior_moves_less_on_the_same_steps():
    features, seconds = synthetic_steps(20, seed=3)
    weak = LatencyCalibration.for_engine(FOREIGN, 128, 2048, prior_steps=8)
    strong = LatencyCalibration.for_engine(FOREIGN, 128, 2048, prior_steps=512)
    for calibration in (weak, strong):
        calibration.observe_many(features, seconds)
    assert prediction_error(weak.model()) < prediction_error(strong.model())


def test_a_direction_no_step_informs_keeps_the_prior_rescaled_by_the_measured_speed():
    truth = scaled(FOREIGN, 2.0)  # this machine: twice as slow as the prior, in everything
    calibration = LatencyCalibration.for_engine(FOREIGN, 128, 2048)
    features, seconds = synthetic_steps(300, seed=4, model=truth, kinds=("decode",))  # no prefill seen yet
    calibration.observe_many(features, seconds)
    assert calibration.speed_factor() == pytest.approx(2.0, rel=0.03)
    model = calibration.model()
    assert model.per_prefill_token_s == pytest.approx(truth.per_prefill_token_s, rel=0.05)
    assert model.per_attention_unit_s == pytest.approx(truth.per_attention_unit_s, rel=0.05)


def narrow_decodes(count: int, seed: int, model: StepLatencyModel, seqs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Decode steps of a pilot's few batch sizes only, timed by `model` with 10 % noise."""
    rng = np.random.default_rng(seed)
    widths = rng.integers(*seqs, count)
    features = np.array([(0, 0, n, n * int(rng.integers(100, 400))) for n in widths], float)
    return features, np.array([model.step_s(StepFeatures(*row)) for row in features]) * np.exp(rng.normal(0.0, 0.1, count))


def test_a_pilots_narrow_batches_set_the_level_and_the_profiles_shape_carries_it_to_wide_ones():
    """The host's learnt profile has the right shape at half the level (another load, a slower
    day); a pilot's decode steps of 8-16 sequences (of 128 the engine runs) set the level only,
    and the estimate of a wide step is the truth's. Refitting the shape on them (what a design
    of 16 sequences at most allows) spreads the noise over the base and per-sequence terms and
    misses wide steps by more."""
    prior = scaled(TRUTH, 0.5)
    features, seconds = narrow_decodes(300, seed=21, model=TRUTH, seqs=(8, 17))
    held = LatencyCalibration.for_engine(prior, max_num_seqs=128, max_num_batched_tokens=2048)
    refit = LatencyCalibration.for_engine(prior, max_num_seqs=16, max_num_batched_tokens=2048)
    for calibration in (held, refit):
        calibration.observe_many(features, seconds)
    assert not held.shape_covered and refit.shape_covered
    assert set(np.round(list(relative(held.model(), prior).values()), 9)) == {round(held.speed_factor(), 9)}  # the shape kept
    wide = StepFeatures(0, 0, 128, 128 * 1000)
    held_error = abs(held.model().step_s(wide) / TRUTH.step_s(wide) - 1)
    assert held_error < 0.02
    assert abs(refit.model().step_s(wide) / TRUTH.step_s(wide) - 1) > held_error  # here 2.8 % against 1.6 %


def test_once_a_decode_step_is_half_as_wide_as_the_engine_runs_the_shape_is_refit():
    truth = dataclasses.replace(TRUTH, per_decode_seq_s=2 * TRUTH.per_decode_seq_s)  # not the prior's shape
    calibration = LatencyCalibration.for_engine(TRUTH, max_num_seqs=128, max_num_batched_tokens=2048)
    features, seconds = narrow_decodes(200, seed=22, model=truth, seqs=(8, 17))
    calibration.observe_many(features, seconds)
    kept = relative(calibration.model(), TRUTH)
    assert max(kept.values()) == pytest.approx(min(kept.values()))  # one factor: the shape is the prior's
    wide, wide_seconds = narrow_decodes(200, seed=23, model=truth, seqs=(64, 129))
    calibration.observe_many(wide, wide_seconds)
    assert calibration.shape_covered
    refit = relative(calibration.model(), TRUTH)
    assert refit["per_decode_seq_s"] > 1.5 * refit["base_s"]  # the per-sequence term learnt apart


def test_steps_without_a_time_are_skipped_and_memory_does_not_grow():
    calibration = LatencyCalibration.for_engine(FOREIGN, 128, 2048)
    calibration.observe((0.0, 0.0, 8.0, 800.0), 0.0)
    assert (calibration.steps, calibration.skipped) == (0, 1)
    features, seconds = synthetic_steps(1000, seed=5)
    calibration.observe_many(features, seconds)
    state = {k: v for k, v in vars(calibration).items() if isinstance(v, np.ndarray)}
    assert {k: v.shape for k, v in state.items()} == {"design": prior_design(128, 2048).shape, "_gram": (5, 5), "_h": (5,),
                                                      "_sum_x": (5,)}


def test_bad_arguments_quote_the_value():
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        LatencyCalibration(FOREIGN, np.zeros(3))
    with pytest.raises(ValueError, match="got -1"):
        LatencyCalibration.for_engine(FOREIGN, 128, 2048, prior_steps=-1)
    with pytest.raises(ValueError, match="got 0"):
        LengthCalibration(LengthDistribution.fit([3], [True]), prior_outputs=0)


# -- output lengths ------------------------------------------------------------------------
def exponential_lengths(count: int, mean: float, seed: int) -> np.ndarray:
    return np.maximum(np.ceil(np.random.default_rng(seed).exponential(mean, count)), 1).astype(int)


def flat_prior(cap: int = 512) -> LengthDistribution:
    support = np.arange(1, cap + 1)
    return LengthDistribution(support, support / cap, censored_at=cap)


def cdf_at(distribution: LengthDistribution, length: int) -> float:
    index = np.searchsorted(distribution.lengths, length, side="right") - 1
    return float(distribution.cdf[index]) if index >= 0 else 0.0


def test_outputs_cut_at_max_tokens_are_censored_not_taken_as_their_length():
    lengths = exponential_lengths(5000, 100.0, seed=6)
    cap = 64
    calibration = LengthCalibration(flat_prior())
    calibration.observe_many(np.minimum(lengths, cap), lengths < cap)
    posterior = calibration.posterior()
    for length in (16, 32, 60):
        assert cdf_at(posterior, length) == pytest.approx(1 - np.exp(-length / 100.0), abs=0.02)
    assert cdf_at(posterior, cap) < 0.5  # about half run past the cap: not a spike of outputs ending at 64
    assert posterior.censored_at == round(512 * calibration.scale())  # the stretched prior's cap is the longest censoring


def test_outputs_still_running_are_censored_at_their_age():
    """All requests start together; at age 40 the short ones have finished. Taken alone,
    they would say every output is short."""
    lengths = exponential_lengths(400, 100.0, seed=7)
    age = 40
    finished = lengths[lengths <= age]
    naive = LengthCalibration(flat_prior())
    naive.observe_many(finished, [True] * finished.size)
    aware = LengthCalibration(flat_prior())
    aware.observe_many(finished, [True] * finished.size)
    posterior = aware.posterior(running=[(age, float((lengths > age).sum()))])
    true_share = finished.size / lengths.size
    assert cdf_at(posterior, age) == pytest.approx(true_share, abs=0.03)
    assert cdf_at(naive.posterior(), age) > 0.8  # only the prior (32 pseudo-outputs) keeps it below 1
    assert posterior.mean() > 2.5 * naive.posterior().mean()


def test_the_length_priors_weight_fades_with_outputs():
    prior = flat_prior()
    calibration = LengthCalibration(prior)
    assert np.allclose([cdf_at(calibration.posterior(), l) for l in (10, 100, 400)], [cdf_at(prior, l) for l in (10, 100, 400)])
    shares, at_20 = [calibration.prior_share], [cdf_at(prior, 20)]
    for count in (10, 100, 1000):
        calibration.observe_many([20] * count, [True] * count)
        shares.append(calibration.prior_share)
        at_20.append(cdf_at(calibration.posterior(), 20))
        # at least the outputs' share ends by 20; the prior's pseudo-outputs, stretched towards them, may too
        assert at_20[-1] >= count / (count + calibration.prior_outputs) - 0.01
    assert shares == sorted(shares, reverse=True)
    assert at_20 == sorted(at_20) and at_20[-1] > 0.99


def long_prior(cap: int = 256, seed: int = 11) -> LengthDistribution:
    """A profile's lengths: long answers, a fifth of them cut at its cap."""
    lengths = np.maximum(np.random.default_rng(seed).gamma(4.0, 40.0, 400).astype(int), 1)
    return LengthDistribution.fit(np.minimum(lengths, cap), lengths < cap)


def test_the_stretch_fit_recovers_a_run_whose_lengths_are_the_priors_times_a_factor():
    prior = long_prior()
    for factor in (0.25, 0.5, 2.0):
        calibration = LengthCalibration(prior)
        lengths = np.maximum(np.round(prior.sample(2000, seed=3) * factor), 1).astype(int)
        cap = int(prior.censored_at * factor)
        calibration.observe_many(np.minimum(lengths, cap), lengths < cap)
        assert calibration.scale() == pytest.approx(factor, rel=0.1)


def test_the_stretch_stays_near_one_on_little_or_agreeing_evidence():
    prior = long_prior()
    assert LengthCalibration(prior).scale() == 1.0
    few = LengthCalibration(prior)
    few.observe_many([3, 5], [True, True])  # two very short answers do not make every answer short
    assert 0.7 < few.scale() < 1.3
    agreeing = LengthCalibration(prior)
    lengths = prior.sample(400, seed=5)
    agreeing.observe_many(lengths[lengths <= 60], [True] * int((lengths <= 60).sum()))
    assert agreeing.scale(running=[(60, float((lengths > 60).sum()))]) == pytest.approx(1.0, abs=0.15)


def test_a_posterior_is_fitted_again_only_when_something_new_was_observed():
    calibration = LengthCalibration(long_prior())
    calibration.observe_many([10, 12], [True, True])
    first = calibration.posterior([(20, 5.0)])
    assert calibration.posterior([(20, 5.0)]) is first
    assert calibration.posterior([(30, 5.0)]) is not first
    calibration.observe(14, True)
    again = calibration.posterior([(20, 5.0)])
    assert again is not first and cdf_at(again, 14) > cdf_at(first, 14)


def test_outputs_still_running_take_the_stretched_priors_tail():
    """All requests start together, their lengths a third of the prior's; at the age where
    about half have ended, the rest are expected to run on as a third of the prior says,
    not as long as the prior's own tail."""
    prior = long_prior()
    lengths = np.maximum(np.round(prior.sample(300, seed=9) / 3), 1).astype(int)
    age = int(np.median(lengths))
    ended = lengths[lengths <= age]
    calibration = LengthCalibration(prior)
    calibration.observe_many(ended, [True] * ended.size)
    running = [(age, float((lengths > age).sum()))]

    def mean_beyond(distribution: LengthDistribution) -> float:
        masses = np.diff(np.concatenate([[0.0], distribution.cdf]))
        beyond = distribution.lengths > age
        return float((masses[beyond] * distribution.lengths[beyond]).sum() / masses[beyond].sum())

    true = lengths[lengths > age].mean()
    assert calibration.scale(running) == pytest.approx(1 / 3, rel=0.15)
    assert mean_beyond(calibration.posterior(running)) == pytest.approx(true, rel=0.15)
    assert mean_beyond(prior) > 2 * true  # what the unstretched prior's tail would have said


# -- start costs and a model's profile ---------------------------------------------------------
def test_load_posterior_is_the_mean_with_the_prior_as_a_fraction_of_a_start():
    load = LoadCalibration(prior_s=10.0, prior_loads=1.0)
    assert load.posterior_s() == 10.0
    load.observe(30.0)
    assert load.posterior_s() == 20.0
    for _ in range(8):
        load.observe(30.0)
    assert load.posterior_s() == 28.0 and load.factor() == pytest.approx(2.8)
    one = LoadCalibration(prior_s=10.0)  # by default one start moves it most of the way
    one.observe(30.0)
    assert one.posterior_s() == pytest.approx((PRIOR_LOADS * 10.0 + 30.0) / (PRIOR_LOADS + 1)) and one.posterior_s() > 25.0


def committed_profile(hardware: str = "cpu-intel-xeon") -> Profile:
    return Profile.load(REPO / "profiles" / hardware / "smollm2-135m")


def test_a_shape_no_engine_ran_is_rescaled_by_what_the_measured_shape_showed():
    prior = committed_profile()
    calibration = ModelCalibration(prior)
    truth = scaled(prior.shapes["w1-tp1"].latency, 0.5)  # this machine is twice as fast
    features, seconds = synthetic_steps(600, seed=8, model=truth)
    for row, wall_s in zip(features, seconds):
        calibration.observe_step("w1-tp1", StepFeatures(*row), float(wall_s))
    calibration.observe_load("w1-tp1", prior.shapes["w1-tp1"].load_time_s / 2)
    profile = calibration.profile()
    assert calibration.factors().step == pytest.approx(0.5, rel=0.03)
    for key, ratio in relative(profile.shapes["w2-tp1"].latency, prior.shapes["w2-tp1"].latency).items():
        assert ratio == pytest.approx(0.5, rel=0.03), key  # never measured: rescaled
    load_factor = (PRIOR_LOADS + 0.5) / (PRIOR_LOADS + 1)  # one start at half the prior's
    assert profile.shapes["w2-tp1"].load_time_s == pytest.approx(prior.shapes["w2-tp1"].load_time_s * load_factor)
    assert profile.shapes["w1-tp1"].load_time_s == pytest.approx(prior.shapes["w1-tp1"].load_time_s * load_factor)
    assert calibration.evidence().shapes_measured == ("w1-tp1",)


def test_what_the_store_keeps_of_a_shape_no_engine_ran_is_a_learnt_priors_own_numbers_once_a_run_here_measured_it():
    """Rescaled while the run plans, but filed as the learnt prior had it when an earlier run here
    measured it: else a shape measured once drifts by every later run's factor of the other shapes.
    A shape no run here measured (a shipped prior's, or a learnt one's never run) is filed rescaled,
    as the run planned it: the next command then plans what this one did."""
    shipped = committed_profile()
    learnt_w2 = dataclasses.replace(shipped, kind="learnt", notes={SHAPES_MEASURED_HERE: ["w1-tp1", "w2-tp1"]})
    learnt_w1 = dataclasses.replace(shipped, kind="learnt", notes={SHAPES_MEASURED_HERE: ["w1-tp1"]})
    older = dataclasses.replace(shipped, kind="learnt", notes={"shapes_measured": ["w2-tp1"]})  # filed before the whole list
    for prior, kept in ((learnt_w2, True), (older, True), (learnt_w1, False), (shipped, False)):
        calibration = ModelCalibration(prior)
        truth = scaled(prior.shapes["w1-tp1"].latency, 0.5)
        features, seconds = synthetic_steps(600, seed=8, model=truth)
        for row, wall_s in zip(features, seconds):
            calibration.observe_step("w1-tp1", StepFeatures(*row), float(wall_s))
        calibration.observe_load("w1-tp1", prior.shapes["w1-tp1"].load_time_s / 2)
        filed, planned = calibration.profile_to_keep(), calibration.profile()
        assert filed.shapes["w1-tp1"] == planned.shapes["w1-tp1"]  # measured: the run's
        assert planned.shapes["w2-tp1"].latency == scaled(prior.shapes["w2-tp1"].latency, calibration.factors().step)
        if kept:
            assert filed.shapes["w2-tp1"].latency == prior.shapes["w2-tp1"].latency
            assert filed.shapes["w2-tp1"].load_time_s == prior.shapes["w2-tp1"].load_time_s
            assert calibration.shapes_measured_here() == ("w1-tp1", "w2-tp1")
        else:
            assert filed.shapes["w2-tp1"] == planned.shapes["w2-tp1"]
            assert calibration.shapes_measured_here() == ("w1-tp1",)


def test_a_model_with_no_evidence_takes_the_machines_factors_and_its_engine_facts():
    from batchllm.costmodel.calibration.model import SpeedFactors

    prior = committed_profile()
    calibration = ModelCalibration(prior)
    calibration.observe_engine("w1-tp1", {"max_num_seqs": 256}, kv_capacity_tokens=10_752)
    profile = calibration.profile(fallback=SpeedFactors(step=2.0, load=3.0, steps=100, loads=1))
    assert profile.engine["max_num_seqs"] == 256 and profile.shapes["w1-tp1"].kv_capacity_tokens == 10_752
    assert profile.shapes["w2-tp1"].latency == scaled(prior.shapes["w2-tp1"].latency, 2.0)
    assert profile.shapes["w2-tp1"].load_time_s == pytest.approx(prior.shapes["w2-tp1"].load_time_s * 3.0)


# -- GPUs: the analytic profiles are priors like any other -------------------------------------
def test_a_gpu_machine_plans_on_its_analytic_profile_and_its_steps_correct_it():
    from batchllm.engines.hardware import parse_nvidia_smi
    from batchllm.planner.cluster import Cluster, catalog_gpu, cluster_profile

    root = REPO / "profiles"
    here = parse_nvidia_smi("NVIDIA A100-SXM4-80GB, 81920\n" * 8)
    assert catalog_gpu(here, root) == "A100-80G"
    assert catalog_gpu(parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559\n"), root) == "H100-80G"
    assert catalog_gpu(parse_nvidia_smi("NVIDIA A100-SXM4-40GB, 40960\n"), root) is None  # not the catalog's memory
    local = Cluster("gpu", here.folder_name, 8, 2, here, local=True)
    prior, notes = cluster_profile(local, "llama-2-7b", root, {"dtype": "bfloat16"})
    assert prior.kind == "analytic" and prior.hardware == "A100-80G"
    assert notes == ("prior for llama-2-7b: analytic profile A100-80G/llama-2-7b (roofline, not measured), "
                     "calibrated by the run's own steps",)
    # the real GPU: decode 1.6x and prefill 1.2x the roofline, plus a larger fixed overhead per step
    analytic = prior.shapes["w1-tp1"].latency
    truth = StepLatencyModel(analytic.base_s * 1.6 + 0.003, analytic.per_prefill_token_s * 1.2, analytic.per_attention_unit_s,
                             analytic.per_decode_seq_s * 1.6, analytic.per_context_token_s * 1.6)
    calibration = ModelCalibration(prior)
    features, seconds = synthetic_steps(1500, seed=9, model=truth)
    for row, wall_s in zip(features, seconds):
        calibration.observe_step("w1-tp1", StepFeatures(*row), float(wall_s))
    fitted = calibration.profile().shapes["w1-tp1"].latency
    check, exact = synthetic_steps(300, seed=10, model=truth, noise=0.0)
    errors = [abs(fitted.step_s(StepFeatures(*row)) / t - 1) for row, t in zip(check, exact)]
    before = [abs(analytic.step_s(StepFeatures(*row)) / t - 1) for row, t in zip(check, exact)]
    assert np.median(before) > 0.25 and np.median(errors) < 0.02


def test_a_start_shorter_than_a_second_is_not_a_load_measurement():
    from batchllm.costmodel.calibration.loads import MIN_LOAD_S

    load = LoadCalibration(prior_s=12.0)
    load.observe(MIN_LOAD_S / 10)  # a stand-in engine, or one already running
    assert load.loads == 0 and load.posterior_s() == pytest.approx(12.0)


def test_the_time_running_outputs_still_need_follows_their_ages_and_lengths():
    from batchllm.costmodel.calibration.batch_tail import batch_left_s

    ten = LengthDistribution(np.array([10]), np.array([1.0]), censored_at=11)  # every output is 10 tokens long
    expected = sum(TRUTH.base_s + TRUTH.per_decode_seq_s * 5 + TRUTH.per_context_token_s * 5 * (30 + 4 + k) for k in range(6))
    assert batch_left_s(TRUTH, ten, running=5, age=4, prompt_tokens=30, max_tokens=64) == pytest.approx(expected)
    assert batch_left_s(TRUTH, ten, running=5, age=4, prompt_tokens=30, max_tokens=64, local_factor=2.0) == pytest.approx(2 * expected)
    assert batch_left_s(TRUTH, ten, running=5, age=4, prompt_tokens=30, max_tokens=7) < expected  # cut at max_tokens
    assert batch_left_s(TRUTH, ten, running=0, age=4, prompt_tokens=30, max_tokens=64) == 0.0
    long = flat_prior(512)  # lengths spread: more outputs running means a longer tail
    assert batch_left_s(TRUTH, long, 50, 20, 30, 256) > batch_left_s(TRUTH, long, 2, 20, 30, 256)


def test_outputs_older_than_every_ended_length_still_have_tokens_to_go():
    """Short outputs on a prior of long ones: late in the run a few still run, older than
    anything the stretched prior or the ended outputs reach. They go on about as the ends
    per token so far say (geometric lengths here, mean 15: 15 tokens to go at any age), not
    end now. Twelve runs at each of three ages; each within 30 %, their mean within 10 %."""
    def tokens_to_go(seed: int, age: int) -> float:
        lengths = 1 + np.random.default_rng(seed).geometric(1 / 15, 400)
        ended = lengths[lengths <= age]
        calibration = LengthCalibration(long_prior())
        calibration.observe_many(ended, [True] * ended.size)
        running = [(age, float((lengths > age).sum()))]
        assert running[0][1] >= 1 and calibration.scale(running) < 0.3
        posterior = calibration.posterior(running)
        beyond = posterior.lengths > age
        masses = np.diff(np.concatenate([[0.0], posterior.cdf]))
        return float((masses[beyond] * posterior.lengths[beyond]).sum() / masses[beyond].sum()) - age

    for age in (30, 45, 60):
        to_go = [tokens_to_go(seed, age) for seed in range(12)]
        assert to_go == [pytest.approx(15.0, rel=0.3)] * 12
        assert np.mean(to_go) == pytest.approx(15.0, rel=0.1)


def test_a_cut_below_the_oldest_output_running_does_not_end_it():
    """Outputs cut at 30 (requests of a smaller max_tokens) say nothing of when outputs of
    age 60 stop; nor does a prior's cap stretched below them."""
    from batchllm.costmodel.calibration.batch_tail import survival

    calibration = LengthCalibration(long_prior())
    calibration.observe_many(np.arange(1, 26).repeat(8), [True] * 200)
    calibration.observe_many([30] * 20, [False] * 20)
    assert survival(calibration.posterior([(60, 4.0)]), np.array([60]))[0] > 0
    short = LengthCalibration(flat_prior(512))
    short.observe_many(np.arange(1, 11).repeat(50), [True] * 500)
    assert survival(short.posterior([(300, 1.0)]), np.array([300]))[0] > 0
