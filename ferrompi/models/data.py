"""A small synthetic classification task for the examples: concentric rings.

Points in the plane (plus noise features), labelled by which ring their
radius falls in: a boundary no linear model draws, which a small MLP learns
to well over 90 % accuracy in a few epochs.

Examples
--------
>>> from ferrompi.models import rings
>>> x, y = rings(6, classes=3, seed=0)
>>> x.shape, y.tolist()
((6, 4), [0, 1, 2, 0, 1, 2])
"""

from __future__ import annotations

import numpy as np

__all__ = ["rings"]


def rings(n: int, *, classes: int = 3, noise_features: int = 2, seed: int = 0):
    """``n`` points, ``classes`` rings (labels ``i % classes``), standardised features.

    Returns
    -------
    x : numpy.ndarray
        Shape ``(n, 2 + noise_features)``, float64.
    y : numpy.ndarray
        Shape ``(n,)``, int64 labels.
    """
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    radius = y + rng.uniform(0.15, 0.85, n)
    angle = rng.uniform(0, 2 * np.pi, n)
    x = np.column_stack(
        [radius * np.cos(angle), radius * np.sin(angle), rng.standard_normal((n, noise_features))]
    )
    x[:, :2] /= classes / 2
    return x, y.astype(np.int64)
