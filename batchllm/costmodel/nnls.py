"""Non-negative least squares from normal equations (Gram matrix G = A'A, h = A'b): the
profile fit (`latency.py`) and the running calibration (sufficient statistics, never the
rows) share it."""

from __future__ import annotations

import numpy as np


def nnls_normal(gram: np.ndarray, h: np.ndarray, *, max_rounds: int = 50) -> np.ndarray:
    """argmin x'Gx - 2h'x over x >= 0 (Lawson-Hanson active set on the normal equations).

    Columns are scaled to unit diagonal first: coefficients here differ by orders of
    magnitude (seconds per step vs per attention unit)."""
    gram = np.asarray(gram, float)
    h = np.asarray(h, float)
    n = h.size
    if gram.shape != (n, n):
        raise ValueError(f"Gram matrix of shape {gram.shape} does not match a vector of {n}")
    diagonal = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    scale = np.where(diagonal > 0, diagonal, 1.0)
    g = gram / np.outer(scale, scale)
    b = h / scale
    passive = np.zeros(n, bool)
    x = np.zeros(n)
    for _ in range(max_rounds * n):
        gradient = b - g @ x
        if passive.all() or gradient[~passive].max(initial=0.0) <= 1e-12 * max(1.0, np.abs(b).max(initial=0.0)):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(n)
            index = np.flatnonzero(passive)
            z[index] = np.linalg.lstsq(g[np.ix_(index, index)], b[index], rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            negative = passive & (z <= 0)
            step = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + step * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale
