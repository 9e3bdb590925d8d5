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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.stats import norm
from sklearn.linear_model import Ridge
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

    def predict(self, features) -> np.ndarray:
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


def _ridge(features, targets: np.ndarray, alpha: float) -> Ridge:
    solver = "sparse_cg" if sp.issparse(features) else "auto"
    return Ridge(alpha=alpha, solver=solver, fit_intercept=True, tol=1e-5).fit(features, targets)


def _out_of_fold(features, targets: np.ndarray, alpha: float, folds: int, seed: int) -> np.ndarray:
    predicted = np.empty(targets.size)
    for train, test in KFold(folds, shuffle=True, random_state=seed).split(targets):
        predicted[test] = _ridge(features[train], targets[train], alpha).predict(features[test])
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


def fit_censored(features, targets: np.ndarray, censored: np.ndarray, *, alpha: float | None = None,
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
    if alpha is None:
        scores = {}
        for a in ALPHAS:
            predicted = _out_of_fold(features, targets, a, folds, seed)
            scores[a] = (-round(concordance(predicted, targets, censored, seed), 3), censored_error(predicted, targets, censored))
        alpha = min(scores, key=lambda a: scores[a])
    current = targets
    mu = _out_of_fold(features, current, alpha, folds, seed)
    sigma = float(np.sqrt(np.mean((targets - mu)[~censored] ** 2))) if (~censored).any() else 1.0
    done = 0
    for done in range(1, iterations + 1 if censored.any() else 1):
        current, variance = _expected(targets, censored, mu, max(sigma, 1e-3))
        mu = _out_of_fold(features, current, alpha, folds, seed)
        sigma, before = float(np.sqrt(np.mean(variance + (current - mu) ** 2))), sigma
        if abs(sigma - before) < 0.01 * before:  # converged
            break
    final = _ridge(features, current, alpha)
    coef = np.zeros(columns)
    coef[used] = np.asarray(final.coef_, float).ravel()
    return CensoredFit(coef, float(final.intercept_), sigma, float(alpha), done, mu)
