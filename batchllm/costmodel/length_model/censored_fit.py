"""log(length) ~ linear(features), fit with right-censoring: an output cut at max_tokens (or
still running) says only "at least this long". As exact values such outputs pull the fit
down; dropped, they take the long answers out of the data. A Tobit model with a ridge
penalty, fit by EM:

    start   ridge on every target (censored ones as if exact)
    E-step  each censored target y >= c becomes E[y | y >= c] = mu + sigma * lambda(z),
            z = (c - mu) / sigma, lambda the inverse Mills ratio phi(z) / (1 - Phi(z)),
            under the current normal residual model (mu the current prediction)
    M-step  refit the ridge on those targets; sigma^2 = the mean expected squared residual
            (finished: (y - mu)^2; censored: the truncated normal's variance plus the
            squared distance of its mean from mu)

With many hashed features the ridge fits its own training rows closely, so mu and sigma in
the E-step come from out-of-fold predictions (each row predicted by a fit without it): the
residual spread a new prompt would see, not the training rows' shrunken one.

Every ridge here is a Cholesky factor kept per rows for the penalty in use (`CachedRidge`): a fit on
n rows of hashed features (hundreds of thousands of columns, tens of thousands used) is one n x n
factor of the rows' centred inner products, and it serves every EM iteration of the same rows.
An iterative solver over the columns took 38 ms a fit, 12 s of a 832-output store's refit at a
run's start (2-core AVX-512 host, 2026-11-29).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.linalg import cho_factor, cho_solve
from scipy.stats import norm
from sklearn.model_selection import KFold

ALPHAS = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
CONCORDANCE_ROWS = 2000  # rows the penalty is chosen on (pairs: their square)


@dataclass(frozen=True)
class CensoredFit:
    coef: np.ndarray  # one per feature column
    intercept: float
    sigma: float  # residual standard deviation of log length (out of fold)
    alpha: float  # the ridge penalty chosen
    iterations: int
    out_of_fold: np.ndarray  # each training row's prediction by a fit without it

    def predict(self, features: Any) -> np.ndarray:  # features: dense or scipy sparse rows
        return np.asarray(features @ self.coef, float).ravel() + self.intercept


def inverse_mills(z: np.ndarray) -> np.ndarray:
    """phi(z) / (1 - Phi(z)), stable far in the tail."""
    return np.exp(norm.logpdf(z) - norm.logsf(z))


def censored_error(predicted: np.ndarray, targets: np.ndarray, censored: np.ndarray) -> float:
    """Mean |target - prediction|, a censored target counting only a prediction below it."""
    return float(np.mean(np.where(censored, np.maximum(targets - predicted, 0.0), np.abs(targets - predicted))))


def concordance(predicted: np.ndarray, targets: np.ndarray, censored: np.ndarray, seed: int = 0) -> float:
    """Harrell's C: of the pairs whose order is known (the shorter one finished), the share
    the predictions order the same way (ties half); on at most CONCORDANCE_ROWS rows."""
    if targets.size > CONCORDANCE_ROWS:
        rows = np.random.default_rng(seed).choice(targets.size, CONCORDANCE_ROWS, replace=False)
        predicted, targets, censored = predicted[rows], targets[rows], censored[rows]
    known = (targets[:, None] < targets[None, :]) & ~censored[:, None]
    agree = (predicted[:, None] < predicted[None, :]) + 0.5 * (predicted[:, None] == predicted[None, :])
    pairs = int(known.sum())
    return float((agree * known).sum() / pairs) if pairs else 0.5


@dataclass(frozen=True)
class _Factor:
    cholesky: tuple  # scipy's cho_factor of the system
    inner_means: np.ndarray | None  # in the dual, each row's mean inner product with the rows


class CachedRidge:
    """Ridge regression with an unpenalised intercept on subsets of fixed rows, solved in the smaller
    of the rows' and the columns' spaces: with more columns than rows (hashed features), the dual
    (K the training rows' centred inner products, a = (K + alpha I)^-1 (y - mean y), coef = the
    centred rows' features times a), else the normal equations over the columns. Either is the one
    minimiser of the ridge objective. The Cholesky factors of the last penalty are kept per rows (the
    EM refits the same folds on new targets); a new penalty drops them (2,000 rows: 18 MB a fold).
    The rows' features and column means, the same whatever the penalty, are kept per rows."""

    def __init__(self, features: Any) -> None:
        self.features = features
        self.dual = features.shape[0] <= features.shape[1]
        if self.dual:
            product = features @ features.T
            self._inner = np.asarray(product.toarray() if sp.issparse(product) else product, float)
        self._alpha: float | None = None
        self._factors: dict[bytes, _Factor] = {}  # of `_alpha`, per rows
        self._chosen: dict[bytes, tuple[Any, np.ndarray]] = {}  # per rows: their features, their mean per column

    def fit(self, rows: np.ndarray, targets: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
        """The weight per feature column and the intercept of a fit on `rows` with these targets."""
        factor, (chosen, column_means) = self._factor(rows, alpha), self._rows(rows)
        mean = float(np.mean(targets))
        if self.dual:
            weights = cho_solve(factor.cholesky, targets - mean)
            coef = np.asarray(chosen.T @ weights, float).ravel() - column_means * float(weights.sum())
        else:
            coef = cho_solve(factor.cholesky, np.asarray(chosen.T @ (targets - mean), float).ravel())
        return coef, mean - float(column_means @ coef)

    def predict_out(self, rows: np.ndarray, targets: np.ndarray, alpha: float, others: np.ndarray) -> np.ndarray:
        """The predictions for `others` of a fit on `rows` with these targets (in the dual, from the
        inner products alone: no weight per column is formed)."""
        factor = self._factor(rows, alpha)
        if factor.inner_means is None:
            coef, intercept = self.fit(rows, targets, alpha)
            return np.asarray(self.features[others] @ coef, float).ravel() + intercept
        mean = float(np.mean(targets))
        weights = cho_solve(factor.cholesky, targets - mean)
        total, across = float(weights.sum()), self._inner[np.ix_(others, rows)]  # total: 0 up to rounding
        intercept = mean - float(factor.inner_means @ weights) + float(factor.inner_means.mean()) * total
        return across @ weights - across.mean(axis=1) * total + intercept

    def _rows(self, rows: np.ndarray) -> tuple[Any, np.ndarray]:
        key = rows.tobytes()
        if key not in self._chosen:
            chosen = self.features[rows]
            self._chosen[key] = chosen, np.asarray(chosen.mean(axis=0), float).ravel()
        return self._chosen[key]

    def _factor(self, rows: np.ndarray, alpha: float) -> _Factor:
        if alpha != self._alpha:
            self._alpha, self._factors = alpha, {}
        key = rows.tobytes()
        if key in self._factors:
            return self._factors[key]
        inner_means = None
        if self.dual:
            system = self._inner[np.ix_(rows, rows)]
            inner_means = system.mean(axis=1)
            system -= inner_means[:, None] + inner_means[None, :] - inner_means.mean()
        else:
            chosen, column_means = self._rows(rows)
            product = chosen.T @ chosen
            system = np.asarray(product.toarray() if sp.issparse(product) else product, float) - rows.size * np.outer(column_means, column_means)
        system[np.diag_indices_from(system)] += alpha
        self._factors[key] = _Factor(cho_factor(system, overwrite_a=True), inner_means)
        return self._factors[key]


def _out_of_fold(ridge: CachedRidge, splits: list[tuple[np.ndarray, np.ndarray]], targets: np.ndarray, alpha: float) -> np.ndarray:
    predicted = np.empty(targets.size)
    for train, test in splits:
        predicted[test] = ridge.predict_out(train, targets[train], alpha, test)
    return predicted


def _expected(targets: np.ndarray, censored: np.ndarray, mu: np.ndarray, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """E[y] and Var[y] per row under y ~ N(mu, sigma), conditioned on y >= target where censored."""
    expected, variance = targets.astype(float).copy(), np.zeros(targets.size)
    if censored.any():
        z = (targets[censored] - mu[censored]) / sigma
        ratio = inverse_mills(z)
        expected[censored] = mu[censored] + sigma * ratio
        variance[censored] = sigma**2 * np.maximum(1.0 + z * ratio - ratio**2, 0.0)
    return expected, variance


def fit_censored(features: Any, targets: np.ndarray, censored: np.ndarray, *, alpha: float | None = None,
                 iterations: int = 8, folds: int = 4, seed: int = 0) -> CensoredFit:
    """`targets` log lengths; `censored[i]`: row i is only a lower bound. `alpha` None: the
    ridge penalty of ALPHAS whose out-of-fold predictions order the rows best (concordance,
    censoring-aware), the least censored absolute error among equals."""
    targets = np.asarray(targets, float)
    censored = np.asarray(censored, bool)
    columns = features.shape[1]
    used = np.flatnonzero(features.getnnz(axis=0)) if sp.issparse(features) else np.arange(columns)
    if used.size < columns:  # hashed features leave most columns empty: a column no row has gets no weight, fit without it
        features = sp.csr_matrix(features[:, used])
    folds = max(2, min(folds, targets.size // 4))
    ridge = CachedRidge(features)
    splits = list(KFold(folds, shuffle=True, random_state=seed).split(targets))
    if alpha is None:
        scores = {}
        for a in ALPHAS:
            predicted = _out_of_fold(ridge, splits, targets, a)
            scores[a] = (-round(concordance(predicted, targets, censored, seed), 3), censored_error(predicted, targets, censored))
        alpha = min(scores, key=lambda a: scores[a])
    current = targets
    mu = _out_of_fold(ridge, splits, current, alpha)
    sigma = float(np.sqrt(np.mean((targets - mu)[~censored] ** 2))) if (~censored).any() else 1.0
    done = 0
    for done in range(1, iterations + 1 if censored.any() else 1):  # noqa: B007  `done` is read after the loop
        current, variance = _expected(targets, censored, mu, max(sigma, 1e-3))
        mu = _out_of_fold(ridge, splits, current, alpha)
        sigma, before = float(np.sqrt(np.mean(variance + (current - mu) ** 2))), sigma
        if abs(sigma - before) < 0.01 * before:  # converged
            break
    fitted, intercept = ridge.fit(np.arange(targets.size), current, alpha)
    coef = np.zeros(columns)
    coef[used] = fitted
    return CensoredFit(coef, intercept, sigma, float(alpha), done, mu)
