"""Cost model pieces on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.costmodel.latency import StepFeatures, StepLatencyModel
from batchllm.costmodel.lengths import LengthDistribution, output_lengths
from batchllm.costmodel.simulator import SchedulerLimits, simulate_replica

ONE_SECOND_A_STEP = StepLatencyModel(base_s=1.0, per_prefill_token_s=0.0, per_attention_unit_s=0.0, per_decode_seq_s=0.0, per_context_token_s=0.0)
ROOMY = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, kv_capacity_tokens=10_000, block_size_tokens=2)


# -- output lengths -----------------------------------------------------------------
def test_censored_lengths_put_the_remaining_mass_at_the_cap():
    # two outputs were cut at 3 tokens: they only say "at least 3"
    dist = LengthDistribution.fit([1, 2, 2, 3, 3], [True, True, True, False, False])
    assert dist.lengths.tolist() == [1, 2, 3]
    # P(1) = 1/5; P(2) = (2 of the 4 still running) x 4/5 = 0.4; the rest, 0.4, at the cap
    assert dist.cdf == pytest.approx([0.2, 0.6, 1.0])
    assert dist.censored_at == 3
    assert dist.mean() == pytest.approx(0.2 * 1 + 0.4 * 2 + 0.4 * 3)


def test_censoring_correction_differs_from_the_naive_histogram():
    # 10 of 20 outputs hit the cap of 4; of the 10 finished ones, all are length 4 -> naive P(len<4) = 0
    lengths = [2] * 5 + [4] * 15
    finished = [True] * 5 + [True] * 5 + [False] * 10
    dist = LengthDistribution.fit(lengths, finished)
    assert dist.cdf[0] == pytest.approx(5 / 20)  # at length 2: all 20 at risk, 5 ended


def test_sampling_is_reproducible_and_follows_the_cdf():
    dist = LengthDistribution.fit([10, 20, 30, 40], [True] * 4)
    a, b = dist.sample(20_000, seed=7), dist.sample(20_000, seed=7)
    assert (a == b).all()
    assert not (a == dist.sample(20_000, seed=8)).all()
    assert set(np.unique(a)) == {10, 20, 30, 40}
    assert np.mean(a == 10) == pytest.approx(0.25, abs=0.02)


def test_output_lengths_are_clipped_by_max_tokens_and_context():
    dist = LengthDistribution.fit([100], [True])
    lengths = output_lengths(dist, prompt_lengths=np.array([10, 2000, 4090]), max_tokens=64, max_model_len=4096, seed=0)
    assert lengths.tolist() == [64, 64, 6]
    known = output_lengths(dist, np.array([10, 10]), 64, 4096, seed=0, known=np.array([5, 500]))
    assert known.tolist() == [5, 64]


def test_fitting_no_samples_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        LengthDistribution.fit([], [])


# -- step latency -------------------------------------------------------------------
def test_latency_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    features = np.column_stack([rng.integers(0, 2000, 300), rng.integers(0, 10**5, 300), rng.integers(0, 64, 300), rng.integers(0, 20000, 300)])
    truth = StepLatencyModel(0.02, 3e-4, 1e-7, 2e-3, 5e-6)
    seconds = np.array([truth.step_s(StepFeatures(*row)) for row in features])
    fitted = StepLatencyModel.fit(features, seconds)
    for name, value in truth.to_dict().items():
        assert fitted.to_dict()[name] == pytest.approx(value, rel=1e-6)


def test_latency_fit_never_goes_negative():
    features = np.column_stack([np.arange(50), np.zeros(50), np.arange(50)[::-1], np.zeros(50)])
    seconds = 0.5 + 0.01 * np.arange(50) - 0.001 * np.arange(50)[::-1]  # a negative slope in the data
    fitted = StepLatencyModel.fit(features, seconds)
    assert min(fitted.to_dict().values()) >= 0


def test_the_decode_steps_within_a_budget_are_those_stepping_fits():
    model = StepLatencyModel(0.01, 0.0, 0.0, 0.002, 1e-5)
    stepped = sum(model.step_s(StepFeatures(0, 0, 8, 100 + 8 * j)) for j in range(37))
    assert model.decode_steps_within(8, 100, stepped) == 37
    assert model.decode_steps_within(8, 100, stepped - 1e-9) == 36


# -- scheduler simulation ----------------------------------------------------------
def test_one_request_is_one_prefill_step_then_one_step_per_token():
    result = simulate_replica([10], [5], ROOMY, ONE_SECOND_A_STEP)
    assert result.steps == 5 and result.total_s == 5.0 and result.finish_s.tolist() == [5.0]


def test_token_budget_chunks_prefill():
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=16, kv_capacity_tokens=10_000, block_size_tokens=2)
    result = simulate_replica([10, 10, 10], [1, 1, 1], limits, ONE_SECOND_A_STEP)
    # step 1: r0 10 + r1 6 (chunked); step 2: r1's last 4 + r2's 10
    assert [seg.prefill_tokens for seg in result.trace] == [16, 14]
    assert result.finish_s.tolist() == [1.0, 2.0, 2.0]


def test_max_num_seqs_holds_requests_back():
    limits = SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=64, kv_capacity_tokens=10_000, block_size_tokens=2)
    result = simulate_replica([4, 4, 4, 4], [3, 3, 3, 3], limits, ONE_SECOND_A_STEP)
    assert result.finish_s.tolist() == [3.0, 3.0, 6.0, 6.0]
    assert max(seg.running for seg in result.trace) == 2


def test_kv_overflow_preempts_and_recomputes():
    tight = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, kv_capacity_tokens=24, block_size_tokens=2)
    result = simulate_replica([4, 4], [10, 10], tight, ONE_SECOND_A_STEP)
    roomy = simulate_replica([4, 4], [10, 10], ROOMY, ONE_SECOND_A_STEP)
    assert roomy.preemptions == 0 and roomy.total_s == 10.0
    assert result.preemptions >= 1
    assert result.finish_s[0] < result.finish_s[1]  # the later request was the victim
    assert result.total_s > roomy.total_s
    assert not np.isnan(result.finish_s).any()


def test_prefix_cached_tokens_are_not_prefilled():
    result = simulate_replica([100, 100], [1, 1], SchedulerLimits(8, 512, 10_000, 16), ONE_SECOND_A_STEP, cached_tokens=np.array([0, 64]))
    assert result.trace[0].prefill_tokens == 100 + 36
    fully_cached = simulate_replica([100], [1], SchedulerLimits(8, 512, 10_000, 16), ONE_SECOND_A_STEP, cached_tokens=np.array([100]))
    assert fully_cached.trace[0].prefill_tokens == 1  # the last prompt token is always computed


def test_requests_wait_for_their_arrival():
    result = simulate_replica([4, 4], [2, 2], ROOMY, ONE_SECOND_A_STEP, ready_s=np.array([0.0, 10.0]))
    assert result.finish_s.tolist() == [2.0, 12.0]


def test_a_request_larger_than_the_kv_cache_is_an_error():
    with pytest.raises(ValueError, match="needs 100 tokens of KV cache"):
        simulate_replica([100], [1], SchedulerLimits(8, 512, 50, 16), ONE_SECOND_A_STEP)


def test_simulation_is_deterministic_and_conserves_tokens():
    rng = np.random.default_rng(3)
    prompt, output = rng.integers(5, 300, 500), rng.integers(1, 200, 500)
    limits = SchedulerLimits(64, 1024, 30_000, 16)
    model = StepLatencyModel(0.01, 1e-4, 0.0, 1e-3, 1e-6)
    a, b = simulate_replica(prompt, output, limits, model), simulate_replica(prompt, output, limits, model)
    assert a.total_s == b.total_s and (a.finish_s == b.finish_s).all()
    assert sum(seg.prefill_tokens for seg in a.trace) == prompt.sum()  # no preemption here
    assert sum(seg.steps for seg in a.trace) == a.steps
    assert np.all(np.diff([seg.start_s for seg in a.trace]) >= 0)


# -- profiles and the estimator ----------------------------------------------------
from batchllm.core.errors import UserError  # noqa: E402
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate  # noqa: E402
from batchllm.costmodel.profile import ModelFacts, Profile, ReplicaShape, ShapeProfile  # noqa: E402
from batchllm.ordering.balance import balance  # noqa: E402

ENGINE = {"engine_version": "vllm 0.32.0", "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size_tokens": 2,
          "max_model_len": 256, "dtype": "bfloat16", "enforce_eager": True}


def tiny_profile() -> Profile:
    facts = ModelFacts(parameters=1000, layers=2, hidden_size=8, attention_heads=4, kv_heads=4, max_model_len=256)
    shapes = {"w1-tp1": ShapeProfile(load_time_s=5.0, kv_capacity_tokens=10_000, latency=ONE_SECOND_A_STEP, warmup_s=2.0)}
    return Profile("measured", "cpu-test", "tiny", ENGINE, facts, shapes, LengthDistribution.fit([3, 5], [True, True]))


def test_profile_round_trips_through_plain_files(tmp_path):
    profile = tiny_profile()
    profile.save(tmp_path, {"w1-tp1": [{"wall_s": 0.1, "prefill_tokens": 3.0}]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output_lengths.csv", "profile.json", "steps-w1-tp1.csv"]
    loaded = Profile.load(tmp_path)
    assert loaded.shapes == profile.shapes and loaded.engine == profile.engine and loaded.facts == profile.facts
    assert loaded.lengths.lengths.tolist() == [3, 5] and loaded.lengths.cdf.tolist() == [0.5, 1.0]


def test_a_profile_taken_with_other_settings_names_the_difference():
    assert tiny_profile().settings_differences({**ENGINE, "max_num_seqs": 256}) == ["max_num_seqs: profile 8, run 256"]
    assert tiny_profile().settings_differences(dict(ENGINE)) == []


def test_unknown_replica_shape_is_a_clear_error():
    with pytest.raises(UserError, match="no replica shape w2-tp2"):
        tiny_profile().shape(ReplicaShape(2, 2))


def test_split_by_work_balances_and_keeps_every_request_once():
    work = np.array([9, 1, 8, 2, 7, 3, 6, 4])
    parts = balance(work, 2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
    assert [work[p].sum() for p in parts] == [20, 20]


def test_estimate_adds_load_and_warm_up_time_and_uses_known_lengths():
    workload = Workload.of([4, 4], max_tokens=100, known_output_tokens=np.array([3, 3]))
    result = estimate(tiny_profile(), ExecutionPlan(1, ReplicaShape(1)), workload)
    assert result.load_s == 7.0 and result.run_s == 3.0 and result.total_s == 10.0
    assert result.finish_s.tolist() == [10.0, 10.0]
    assert estimate(tiny_profile(), ExecutionPlan(1, ReplicaShape(1)), workload, include_load=False).total_s == 3.0


def test_data_parallel_replicas_share_the_work():
    workload = Workload.of([4] * 32, max_tokens=100, known_output_tokens=np.full(32, 5))
    one = estimate(tiny_profile(), ExecutionPlan(1, ReplicaShape(1)), workload, include_load=False)
    two = estimate(tiny_profile(), ExecutionPlan(2, ReplicaShape(1)), workload, include_load=False)
    assert one.run_s == 20.0 and two.run_s == 10.0  # 8 seqs at a time: 4 waves of 5 steps vs 2


def test_sampled_estimates_are_deterministic_per_seed():
    workload = Workload.of(np.full(50, 4), max_tokens=100)
    plan = ExecutionPlan(1, ReplicaShape(1))
    assert estimate(tiny_profile(), plan, workload, seed=1).total_s == estimate(tiny_profile(), plan, workload, seed=1).total_s
    assert set(estimate(tiny_profile(), plan, workload, seed=1).output_tokens.tolist()) <= {3, 5}


def test_jumping_over_decode_steps_matches_stepping_one_at_a_time():
    rng = np.random.default_rng(11)
    prompt, output = rng.integers(5, 400, 300), rng.integers(1, 300, 300)
    model = StepLatencyModel(0.01, 1e-4, 1e-8, 1e-3, 1e-6)
    for limits in (SchedulerLimits(32, 512, 100_000, 16), SchedulerLimits(64, 2048, 100_000, 128)):
        fast = simulate_replica(prompt, output, limits, model)
        slow = simulate_replica(prompt, output, limits, model, jump=False)
        assert fast.steps == slow.steps
        assert fast.total_s == pytest.approx(slow.total_s, rel=1e-9)
        assert np.allclose(fast.finish_s, slow.finish_s)
        assert len(fast.trace) < len(slow.trace)


def test_an_estimate_samples_unknown_lengths_by_its_seed_and_known_ones_not_at_all():
    workload = Workload.of(np.full(50, 4), max_tokens=100)
    plan = ExecutionPlan(1, ReplicaShape(1))
    sampled = [estimate(tiny_profile(), plan, workload, seed=seed).total_s for seed in range(4)]
    assert len(set(sampled)) > 1 and sampled[2] == estimate(tiny_profile(), plan, workload, seed=2).total_s
    known = Workload.of(np.full(50, 4), 100, known_output_tokens=np.full(50, 4))
    assert len({estimate(tiny_profile(), plan, known, seed=seed).total_s for seed in range(3)}) == 1  # nothing to sample
