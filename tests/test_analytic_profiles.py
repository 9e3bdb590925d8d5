"""Roofline profiles for GPUs: valid shapes, sane magnitudes, measured profiles win."""

from __future__ import annotations

import dataclasses

import pytest

from batchllm.core.errors import UserError
from batchllm.costmodel.analytic import analytic_profile, load_catalog, lognormal_lengths
from batchllm.costmodel.latency import StepFeatures
from batchllm.costmodel.profile import find_profile

GPUS, MODELS = load_catalog()


def test_a_70b_model_needs_at_least_two_a100s():
    profile = analytic_profile(MODELS["llama-2-70b"], GPUS["A100-80G"])
    assert sorted(profile.shapes) == ["w2-tp2", "w4-tp4", "w8-tp8"]
    assert profile.kind == "analytic"


def test_tensor_parallel_degree_must_divide_the_heads():
    nine_heads = dataclasses.replace(MODELS["mistral-7b"], facts=dataclasses.replace(MODELS["mistral-7b"].facts, attention_heads=9))
    assert sorted(analytic_profile(nine_heads, GPUS["A100-80G"]).shapes) == ["w1-tp1"]
    assert sorted(analytic_profile(MODELS["mistral-7b"], GPUS["A100-80G"]).shapes) == ["w1-tp1", "w2-tp2", "w4-tp4", "w8-tp8"]


def test_decode_step_of_a_13b_model_is_near_the_published_a100_figure():
    latency = analytic_profile(MODELS["vicuna-13b"], GPUS["A100-80G"]).shapes["w1-tp1"].latency
    one_sequence_ms = 1000 * latency.step_s(StepFeatures(0, 0, 1, 200))
    assert 15 <= one_sequence_ms <= 25  # SamuLLM's artifact measured 18.5-20.7 ms at B=1


def test_h100_is_faster_than_a100():
    a100 = analytic_profile(MODELS["llama-2-13b"], GPUS["A100-80G"]).shapes["w1-tp1"].latency
    h100 = analytic_profile(MODELS["llama-2-13b"], GPUS["H100-80G"]).shapes["w1-tp1"].latency
    assert h100.step_s(StepFeatures(0, 0, 64, 20000)) < a100.step_s(StepFeatures(0, 0, 64, 20000))
    assert h100.per_prefill_token_s < a100.per_prefill_token_s


def test_tensor_parallelism_over_pcie_costs_more_than_over_nvlink():
    pairs = GPUS["A100-80G"]  # NVLink pairs: a tp4 group all-reduces over PCIe
    quads = dataclasses.replace(pairs, nvlink_group=4)
    over_pcie = analytic_profile(MODELS["llama-2-13b"], pairs).shapes["w4-tp4"].latency
    over_nvlink = analytic_profile(MODELS["llama-2-13b"], quads).shapes["w4-tp4"].latency
    assert over_pcie.base_s > over_nvlink.base_s
    assert over_pcie.per_prefill_token_s > over_nvlink.per_prefill_token_s


def test_lognormal_lengths_have_the_requested_median_and_mean():
    dist = lognormal_lengths(mean=208, median=146, max_len=4096)
    assert dist.lengths[(dist.cdf >= 0.5).argmax()] == pytest.approx(146, abs=2)
    assert dist.mean() == pytest.approx(208, rel=0.03)


def test_measured_profiles_win_over_analytic_ones(tmp_path):
    analytic = analytic_profile(MODELS["mistral-7b"], GPUS["H100-80G"])
    analytic.save(tmp_path / "analytic" / "H100-80G" / "mistral-7b")
    assert find_profile(tmp_path, "H100-80G", "mistral-7b").kind == "analytic"
    measured = dataclasses.replace(analytic, kind="measured")
    measured.save(tmp_path / "H100-80G" / "mistral-7b")
    assert find_profile(tmp_path, "H100-80G", "mistral-7b").kind == "measured"
    with pytest.raises(UserError, match="no profile for model 'nope'"):
        find_profile(tmp_path, "H100-80G", "nope")
