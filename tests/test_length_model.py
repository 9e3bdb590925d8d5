"""The per-request length model (batchllm.costmodel.length_model): features, the censored
fit, the model's shifts and base, the gate against the per-model CDF, the observation store.
Synthetic data only; no engine."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from sklearn.linear_model import Ridge

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest
from batchllm.costmodel.length_model import observations
from batchllm.costmodel.length_model.censored_fit import CachedRidge, fit_censored
from batchllm.costmodel.length_model.features import DENSE, dense_row, features, width
from batchllm.costmodel.length_model.gate import gate
from batchllm.costmodel.length_model.model import HISTORY_MARGIN, LengthModel
from batchllm.costmodel.length_model.new_sets import best_transfer, residual_base
from batchllm.costmodel.length_model.observations import ObservationStore
from batchllm.costmodel.length_model.scores import log_error
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.request_lengths import RequestLengths

CAP = 256
KINDS = {  # prompt -> median length
    "What is the capital of {x}? Answer in one word.": 6,
    "In one sentence, what is {x}?": 30,
    "Write a short poem about {x}.": 90,
    "Write a 500-word essay about {x}, in detail.": 400,
}
TOPICS = ["cats", "rivers", "Rome", "tea", "chess", "clouds", "bread", "trains", "salt", "owls", "glass", "maps"]


def workload(count: int, seed: int, scale: float = 1.0) -> tuple[list[LengthPrompt], np.ndarray, np.ndarray]:
    """Prompts of four kinds, log-normal lengths about each kind's median, cut at CAP."""
    rng = np.random.default_rng(seed)
    kinds = list(KINDS.items())
    prompts, lengths = [], []
    for _ in range(count):
        text, centre = kinds[rng.integers(len(kinds))]
        prompts.append(LengthPrompt(text.format(x=rng.choice(TOPICS)), template="t", prompt_tokens=int(rng.integers(10, 30)),
                                    max_tokens=CAP))
        lengths.append(max(1.0, centre * scale * np.exp(rng.normal(0, 0.3))))
    lengths = np.rint(lengths)
    return prompts, np.minimum(lengths, CAP).astype(np.int64), lengths < CAP


def test_features_are_stateless_and_read_the_cues():
    one = LengthPrompt("Write a 300-word essay. List ten facts, step by step.", system="Be brief.", template="node")
    alone, together = features([one]), features([LengthPrompt("other"), one])
    assert alone.shape == (1, width()) and (alone != together[1]).nnz == 0
    cues = dict(zip(DENSE, dense_row(one)))
    assert cues["words_n"] == pytest.approx(np.log1p(300)) and cues["items_n"] == pytest.approx(np.log1p(10))
    assert cues["essay"] == cues["explain"] == cues["list"] == 1.0 and cues["code"] == 0.0
    assert dict(zip(DENSE, dense_row(LengthPrompt("Answer in one word"))))["one_word"] == 1.0


def test_a_request_on_an_adapter_reads_as_its_own_template_apart_from_its_bases():
    from batchllm.core.requests import EngineRequest

    request = EngineRequest("r1", "Write a haiku.")
    base, tuned = LengthPrompt.of(request, "route"), LengthPrompt.of(request._replace(adapter="/dags/adapters/sql"), "route")
    assert (base.template, tuned.template) == ("route", "route+sql")
    assert LengthPrompt.of(request._replace(adapter="sql"), "route").template == "route+sql"  # its name on a server
    assert (features([base]) != features([tuned])).nnz > 0


@pytest.mark.parametrize("shape", [(60, 400), (300, 6)], ids=["more-columns-than-rows", "more-rows-than-columns"])
@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_the_cached_ridge_is_sklearns_ridge_on_any_rows_in_either_space(shape, kind):
    """The dual (hashed features: more columns than rows) and the normal equations give the ridge
    minimiser with an unpenalised intercept: the coefficients, intercept and predictions of
    sklearn's exact solver, on a subset of the rows, and again from the kept factor with new targets."""
    rng = np.random.default_rng(7)
    rows, columns = shape
    dense = rng.normal(0, 1, shape) * (rng.random(shape) < 0.1) + (np.arange(columns) == 0) * 3.0  # a column with a mean
    matrix = sp.csr_matrix(dense) if kind == "sparse" else dense
    ridge, train, others = CachedRidge(matrix), np.arange(0, rows, 3), np.arange(1, rows, 3)
    for targets in (rng.normal(2, 1, rows), rng.normal(-1, 3, rows)):
        expected = Ridge(alpha=3.0, solver="svd").fit(dense[train], targets[train])
        coef, intercept = ridge.fit(train, targets[train], 3.0)
        assert np.allclose(coef, expected.coef_, atol=1e-8) and intercept == pytest.approx(expected.intercept_, abs=1e-8)
        assert np.allclose(ridge.predict_out(train, targets[train], 3.0, others), expected.predict(dense[others]), atol=1e-8)


def test_censored_fit_recovers_the_coefficients_and_beats_exact_and_dropped():
    rng = np.random.default_rng(3)
    count = 3000
    x = np.column_stack([rng.integers(0, 2, count), rng.normal(0, 1, count)]).astype(float)
    truth = np.array([1.0, -0.5])
    log_length = 4.0 + x @ truth + rng.normal(0, 0.5, count)
    cap = np.quantile(log_length, 0.7)  # ~30 % cut
    censored = log_length >= cap
    observed = np.minimum(log_length, cap)
    fit = fit_censored(x, observed, censored, alpha=0.1)
    assert 0.25 <= censored.mean() <= 0.35
    assert np.abs(fit.coef - truth).max() < 0.08 and abs(fit.intercept - 4.0) < 0.08 and abs(fit.sigma - 0.5) < 0.05
    exact = Ridge(alpha=0.1).fit(x, observed)
    dropped = Ridge(alpha=0.1).fit(x[~censored], observed[~censored])
    error = np.abs(fit.coef - truth).sum()
    assert error < np.abs(exact.coef_ - truth).sum() / 2 and error < np.abs(dropped.coef_ - truth).sum() / 2
    means = np.array([4.0 + truth[0] * k for k in (0, 1)])  # mean log length of each binary group at x2 = 0
    fitted = np.array([fit.intercept + fit.coef[0] * k for k in (0, 1)])
    assert np.abs(fitted - means).max() < 0.08


def test_model_shifts_centre_on_zero_and_rank_the_kinds(tmp_path):
    prompts, lengths, finished = workload(600, seed=1)
    assert 0.05 < (~finished).mean() < 0.4  # the essays are cut
    model = LengthModel.fit(prompts, lengths, finished)
    assert abs(model.log_shift(prompts).mean()) < 1e-6
    test, actual, _ = workload(400, seed=2)
    shifts = model.log_shift(test)
    by_kind = {text: shifts[[i for i, p in enumerate(test) if p.last_user.startswith(text[:12])]].mean() for text in KINDS}
    assert list(by_kind.values()) == sorted(by_kind.values())  # shortest kind lowest, longest highest
    predicted = model.request_lengths(test).expected(cap=CAP)
    assert isinstance(model.request_lengths(test), RequestLengths)
    assert abs(predicted.mean() - actual.mean()) / actual.mean() < 0.1
    for text in KINDS:  # each kind's capped mean, not only the whole set's
        rows = [i for i, p in enumerate(test) if p.last_user.startswith(text[:12])]
        assert abs(predicted[rows].mean() - actual[rows].mean()) / actual[rows].mean() < 0.2
    model.save(tmp_path / "m")
    again = LengthModel.load(tmp_path / "m")
    assert np.allclose(again.log_shift(test), shifts, atol=1e-5) and again.base.censored_at == model.base.censored_at
    assert np.array_equal(again.base.lengths, model.base.lengths) and np.array_equal(again.base.cdf, model.base.cdf)


def test_a_pilot_sets_the_level_of_a_new_set():
    prompts, lengths, finished = workload(600, seed=1)
    model = LengthModel.fit(prompts, lengths, finished)
    new, actual, _ = workload(400, seed=4, scale=0.5)  # the same kinds, half as long
    pilot = model.scaled_to(new[:64], actual[:64])
    assert pilot.intercept - model.intercept == pytest.approx(np.log(0.5), abs=0.15)
    mean = pilot.request_lengths(new).expected(cap=CAP).mean()
    assert abs(mean - actual.mean()) / actual.mean() < 0.1


def test_a_prompt_after_a_longer_conversation_than_any_learnt_gets_the_cdfs_level(tmp_path):
    """A short last turn after a long chat is not the short task it reads as: past the training
    prompts' history (x a margin) its length is the base's at the shift where the base has the
    per-model CDF's capped mean, before and after a pilot moves the level, for a known set and
    a new one; what its features say still orders it (log_shift)."""
    prompts, lengths, finished = workload(600, seed=1)
    model = LengthModel.fit(prompts, lengths, finished)
    assert model.history_limit_chars == 0  # no training prompt had earlier turns: any conversation is outside
    short = "What is the capital of Rome? Answer in one word."
    alone = LengthPrompt(short, template="t", prompt_tokens=20, max_tokens=CAP)
    after_a_chat = replace(alone, history_chars=4000)
    shifts = model.request_lengths([alone, replace(alone, history_chars=1), after_a_chat]).log_shift
    assert shifts[0] < -1.0 and shifts[1] == shifts[2] == pytest.approx(model.outside_shift)
    assert model.log_shift([after_a_chat])[0] == pytest.approx(shifts[0], abs=0.05)  # the order reads the last turn
    cdf_mean = RequestLengths.shared(LengthDistribution.fit(lengths, finished), 1, "prior").expected(CAP)[0]
    assert model.request_lengths([after_a_chat]).expected(CAP)[0] == pytest.approx(cdf_mean, rel=0.01)
    assert cdf_mean == pytest.approx(lengths.mean(), rel=0.02)
    halved = model.scaled_to(prompts[:64], lengths[:64] // 2)
    assert halved.request_lengths([after_a_chat]).log_shift[0] - shifts[2] == pytest.approx(halved.intercept - model.intercept)
    sets = LengthModel.fit(prompts, lengths, finished, groups=[f"set-{i % 3}" for i in range(len(prompts))])
    new = sets.for_new_set()
    assert new.outside_shift == sets.new_set.outside_shift != sets.outside_shift
    assert new.request_lengths([after_a_chat]).expected(CAP)[0] == pytest.approx(cdf_mean, rel=0.01)
    for fitted in (model, sets):
        fitted.save(tmp_path / "m")
        again = LengthModel.load(tmp_path / "m")
        assert again.history_limit_chars == fitted.history_limit_chars
        for before, after in ((fitted, again), (fitted.for_new_set(), again.for_new_set())):
            assert after.request_lengths([alone, after_a_chat]).log_shift.tolist() == pytest.approx(
                before.request_lengths([alone, after_a_chat]).log_shift.tolist(), abs=1e-5)
    chats = [replace(p, history_chars=1000 + 10 * i) for i, p in enumerate(prompts)]  # trained on conversations
    chatty = LengthModel.fit(chats, lengths, finished)
    assert chatty.history_limit_chars == pytest.approx(HISTORY_MARGIN * np.percentile([p.history_chars for p in chats], 99))
    inside = replace(alone, history_chars=2000)
    assert chatty.request_lengths([inside]).log_shift[0] == pytest.approx(chatty.log_shift([inside])[0])
    assert chatty.request_lengths([replace(alone, history_chars=10_000)]).log_shift[0] == chatty.outside_shift
    unknown = [replace(p, history_chars=None) for p in prompts]  # outputs filed before history was recorded
    assert LengthModel.fit(unknown, lengths, finished).history_limit_chars == math.inf


def test_length_prompt_counts_the_turns_before_the_last_user_turn():
    chat = EngineRequest("r", "", messages=(("system", "Be kind."), ("user", "Tell me a story."),
                                            ("assistant", "Once upon a time."), ("user", "Go on.")))
    prompt = LengthPrompt.of(chat, "node", prompt_tokens=40)
    assert (prompt.last_user, prompt.system, prompt.history_chars) == ("Go on.", "Be kind.", 16 + 17)
    assert LengthPrompt.of(EngineRequest("r", "Hello", system="Be kind."), "node").history_chars == 0


def test_gate_refuses_a_model_of_noise_and_takes_a_real_one():
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]

    def noise(count):
        prompts = [LengthPrompt(" ".join(rng.choice(words, 6))) for _ in range(count)]
        lengths = np.minimum(np.rint(np.exp(rng.normal(4, 0.8, count))), CAP).astype(np.int64)
        return prompts, lengths, lengths < CAP

    prompts, lengths, finished = noise(500)
    model = LengthModel.fit(prompts, lengths, finished)
    cdf = LengthDistribution.fit(lengths, finished)
    verdict = gate(model, cdf, *noise(300))
    assert not verdict.use and "does not beat" in verdict.reason
    prompts, lengths, finished = workload(500, seed=1)
    verdict = gate(LengthModel.fit(prompts, lengths, finished), LengthDistribution.fit(lengths, finished), *workload(300, seed=6))
    assert verdict.use and verdict.model_score < 0.5 * verdict.cdf_score
    assert not gate(model, cdf, *noise(10)).use  # too few outputs to tell


def test_observation_store_keeps_the_newest_rows_and_gates_its_model(tmp_path, monkeypatch):
    store = ObservationStore.at_home(tmp_path, "org/model")
    assert store.path == tmp_path / "lengths" / "org_model" / "observations.parquet"
    assert len(store.load()) == 0 and store.prompt_sets() == set()
    model, verdict = store.fitted_model()
    assert model is None and "fewer than" in verdict.reason
    for k in range(4):
        prompts, lengths, finished = workload(150, seed=10 + k)
        store.add(prompts, lengths, finished, prompt_set=f"set-{k}")
    assert store.prompt_sets() == {f"set-{k}" for k in range(4)}
    seen = store.load()
    assert len(seen) == 600 and seen.prompts[0] == workload(150, seed=10)[0][0]
    assert [p.name for p in store.path.parent.iterdir()] == ["observations.parquet"]  # no temporary left
    model, verdict = store.fitted_model(min_outputs=200)
    assert verdict.use and model is not None and model.trained_on == 600
    long = LengthPrompt("x" * 5000, history_chars=7000)
    store.add([long], [3], [True], prompt_set="long")
    assert len(store.load().prompts[-1].last_user) == observations.TEXT_CHARS
    assert store.load().prompts[-1].history_chars == 7000
    monkeypatch.setattr(observations, "MAX_ROWS", 100)
    store.add(*workload(30, seed=20), prompt_set="newest")
    seen = store.load()
    assert len(seen) == 100 and seen.prompt_sets[-30:] == ["newest"] * 30


def test_for_a_new_set_the_model_keeps_only_what_carried_over_to_held_out_sets(tmp_path):
    # The same kinds of prompts mean the same lengths in every set: the shifts carry over.
    parts = [workload(150, seed=30 + k) for k in range(4)]
    prompts = [p for part in parts for p in part[0]]
    lengths, finished = np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
    groups = [f"set-{k}" for k in range(4) for _ in range(150)]
    model = LengthModel.fit(prompts, lengths, finished, groups=groups)
    assert model.new_set is not None and model.new_set.transfer >= 0.8 and model.new_set.sets == 4
    new, actual, _ = workload(300, seed=40)
    assert np.corrcoef(model.for_new_set().log_shift(new), np.log(actual))[0, 1] > 0.8
    model.save(tmp_path / "m")
    again = LengthModel.load(tmp_path / "m")
    assert again.new_set.transfer == model.new_set.transfer
    assert np.array_equal(again.for_new_set().base.cdf, model.for_new_set().base.cdf)
    # What a word means differs from set to set (the topics long in two sets are short in the
    # other two): nothing carries over, a new set gets the CDF.
    rng = np.random.default_rng(7)
    prompts, lengths, groups = [], [], []
    for k in range(4):
        ranks = range(len(TOPICS)) if k % 2 else reversed(range(len(TOPICS)))
        medians = {topic: float(np.exp(2 + 3 * rank / len(TOPICS))) for topic, rank in zip(TOPICS, ranks)}
        for _ in range(150):
            topic = str(rng.choice(TOPICS))
            prompts.append(LengthPrompt(f"Tell me about {topic}.", template="t"))
            lengths.append(min(CAP, max(1, round(medians[topic] * np.exp(rng.normal(0, 0.2))))))
            groups.append(f"set-{k}")
    lengths = np.array(lengths)
    model = LengthModel.fit(prompts, lengths, lengths < CAP, groups=groups)
    assert model.new_set.transfer <= 0.2
    cdf = LengthDistribution.fit(lengths, lengths < CAP)
    assert np.allclose(model.for_new_set().log_shift(prompts), 0.0, atol=0.2 * 1.5)
    assert abs(np.log(model.for_new_set().base.mean() / cdf.mean())) < 0.2
    assert LengthModel.fit(prompts[:300], lengths[:300], lengths[:300] < CAP, groups=groups[:300]).new_set is None  # 2 sets


def test_a_model_that_misses_new_sets_levels_may_still_order_requests_inside_them(tmp_path):
    """Sets whose lengths are the same kinds at different levels (x0.3 to x3): on a held-out
    set the model's lengths are off by the set's level, but it orders the set's requests."""
    from batchllm.costmodel.length_model.gate import RANK_MIN, within_sets_concordance

    store = ObservationStore.at_home(tmp_path, "m")
    for k, scale in enumerate((0.3, 3.0, 1.0, 0.5, 2.0)):
        store.add(*workload(120, seed=30 + k, scale=scale), prompt_set=f"set-{k}")
    model, verdict = store.fitted_model(min_outputs=200)
    assert verdict.concordance >= 0.8 and verdict.ranks and model is not None
    assert "orders answers at C" in verdict.reason
    noise_prompts = [LengthPrompt(f"plain question {i}") for i in range(200)]
    lengths = np.random.default_rng(3).integers(5, 200, 200)
    assert within_sets_concordance(model, noise_prompts, lengths, np.ones(200, bool), ["x"] * 200) < RANK_MIN


def test_a_fit_is_kept_until_the_observations_grow_by_a_quarter(tmp_path, monkeypatch):
    store = ObservationStore.at_home(tmp_path, "m")
    for k in range(4):
        store.add(*workload(100, seed=40 + k), prompt_set=f"set-{k}")
    model, verdict = store.fitted_model(min_outputs=200)
    assert model is not None and verdict.use

    def no_fit(*args, **kwargs):
        raise AssertionError("fit again although nothing changed")

    monkeypatch.setattr(LengthModel, "fit", no_fit)
    kept, kept_verdict = store.fitted_model(min_outputs=200)
    assert kept_verdict == verdict and np.array_equal(kept.log_shift(workload(20, seed=9)[0]), model.log_shift(workload(20, seed=9)[0]))
    store.add(*workload(30, seed=50), prompt_set="set-new")  # 30 more of the 400 it read: still kept
    assert store.fitted_model(min_outputs=200)[1] == verdict
    store.add(*workload(80, seed=51), prompt_set="set-newer")  # 110 of 400: fit again
    with pytest.raises(AssertionError, match="fit again"):
        store.fitted_model(min_outputs=200)


def test_a_verdict_without_a_model_is_kept_too(tmp_path, monkeypatch):
    store = ObservationStore.at_home(tmp_path, "m")
    store.add(*workload(50, seed=60), prompt_set="few")
    model, verdict = store.fitted_model(min_outputs=200)
    assert model is None and "fewer than 200" in verdict.reason

    def no_fit(*args, **kwargs):
        raise AssertionError("fit again although nothing changed")

    monkeypatch.setattr(ObservationStore, "_fit", no_fit)
    kept, kept_verdict = store.fitted_model(min_outputs=200)
    assert kept is None and (kept_verdict.use, kept_verdict.reason) == (False, verdict.reason)


def test_a_store_written_before_history_chars_reads_it_as_not_recorded(tmp_path):
    store = ObservationStore.at_home(tmp_path, "m")
    store.add(*workload(20, seed=3), prompt_set="old")
    table = pq.read_table(store.path)
    pq.write_table(table.drop_columns(["history_chars"]), store.path)  # as an older version wrote it
    assert [p.history_chars for p in store.load().prompts] == [None] * 20
    store.add([LengthPrompt("Go on.", history_chars=900)], [40], [True], prompt_set="new")
    assert [p.history_chars for p in store.load().prompts][-2:] == [None, 900]


def test_the_share_that_carries_over_weighs_every_held_out_set_alike():
    """One held-out set far from the others' level, whose shifts help it, must not outweigh three
    whose shifts only add noise: each set's error counts relative to the CDF's on it."""
    rng = np.random.default_rng(7)
    labels = np.repeat(np.array(["far", "b", "c", "d"], object), 200)
    shifts = rng.normal(0, 1, labels.size) + np.where(labels == "far", 3.0, 0.0)  # they place the far set's level
    log_length = np.where(labels == "far", 3.0 + shifts, 3.0 + rng.normal(0, 0.2, labels.size))
    lengths = np.rint(np.exp(log_length))
    finished = np.ones(labels.size, bool)

    def mean_error(k: float, sets) -> float:
        base = residual_base(lengths, finished, k * shifts)
        return np.mean([log_error(base, k * shifts[labels == key], lengths[labels == key], finished[labels == key]) for key in sets])

    summed = [float(log_error(residual_base(lengths, finished, k * shifts), k * shifts, lengths, finished)) for k in (0.0, 1.0)]
    assert summed[1] < summed[0]  # over all outputs at once, the far set's gain would win
    assert mean_error(1.0, ["b", "c", "d"]) > 2 * mean_error(0.0, ["b", "c", "d"])
    assert best_transfer(shifts, lengths, finished, labels) == 0.0
    helped = np.rint(np.exp(3.0 + shifts + rng.normal(0, 0.2, labels.size)))  # the shifts carry over to every set
    assert best_transfer(shifts, helped, finished, labels) == 1.0


def test_prompt_sets_are_held_out_one_by_one_up_to_the_fold_count_then_in_stable_groups():
    from batchllm.costmodel.length_model.new_sets import SET_FOLDS, set_folds

    few = [f"set{k}" for k in range(SET_FOLDS)]
    assert set_folds(few) == [[key] for key in sorted(few)]
    many = [f"set{k}" for k in range(47)]
    folds = set_folds(many)
    assert len(folds) <= SET_FOLDS and sorted(key for fold in folds for key in fold) == sorted(many)  # each set in one fold
    grown = set_folds([*many, "one more"])
    assert all(any(set(fold) <= set(other) for other in grown) for fold in folds)  # the new set moved no other
    assert set_folds(many, seed=1) != folds  # another seed, other groups
