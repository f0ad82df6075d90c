"""A numpy MLP: layers with explicit forward and backward over parameter dicts.

Parameters live in one dict ``name -> array`` (``"0.weight"``, ``"0.bias"``,
...), as a torch ``state_dict``. ``forward`` returns the output and what
``backward`` needs; ``backward`` returns the input gradient and a gradient
dict with the same names, calling ``on_grad(name, grad)`` as each gradient
becomes ready (last layer first, as autograd hooks fire) so that a
data-parallel wrapper can start reducing it while the rest of the backward
pass runs.

Examples
--------
>>> import numpy as np
>>> from ferrompi.models import MLP, mse
>>> model = MLP([3, 8, 1], seed=0)
>>> sorted(model.params)
['0.bias', '0.weight', '2.bias', '2.weight']
>>> x, y = np.ones((4, 3)), np.zeros((4, 1))
>>> out, caches = model.forward(x)
>>> loss, dout = mse(out, y)
>>> _, grads = model.backward(dout, caches)
>>> {k: v.shape for k, v in grads.items()} == {k: v.shape for k, v in model.params.items()}
True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["BatchNorm", "Linear", "MLP", "ReLU", "Sequential", "cross_entropy", "mse"]

GradHook = Callable[[str, np.ndarray], None]


class Linear:
    """``y = x @ weight + bias``; ``weight`` has shape ``(in_features, out_features)``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.param_names = ("weight", "bias") if bias else ("weight",)

    def init_params(self, rng: np.random.Generator, dtype=np.float64) -> dict[str, np.ndarray]:
        """He-uniform weights (for ReLU nets), zero bias."""
        bound = np.sqrt(6.0 / self.in_features)
        params = {
            "weight": rng.uniform(-bound, bound, (self.in_features, self.out_features)).astype(
                dtype
            )
        }
        if self.bias:
            params["bias"] = np.zeros(self.out_features, dtype)
        return params

    def forward(self, p: dict, x: np.ndarray, training: bool = True):
        y = x @ p["weight"]
        if self.bias:
            y = y + p["bias"]
        return y, x

    def backward(self, p: dict, x: np.ndarray, dy: np.ndarray):
        grads = {"weight": x.T @ dy}
        if self.bias:
            grads["bias"] = dy.sum(axis=0)
        return dy @ p["weight"].T, grads


class ReLU:
    """``max(x, 0)``."""

    param_names: tuple[str, ...] = ()

    def init_params(self, rng, dtype=np.float64) -> dict:
        return {}

    def forward(self, p: dict, x: np.ndarray, training: bool = True):
        mask = x > 0
        return x * mask, mask

    def backward(self, p: dict, mask: np.ndarray, dy: np.ndarray):
        return dy * mask, {}


class BatchNorm:
    """Batch normalisation over axis 1 (channels) of ``(N, C)``, ``(N, C, L)`` or ``(N, C, H, W)``.

    Training mode normalises with the batch statistics (biased variance) and
    updates ``running_mean`` / ``running_var`` as torch does (momentum 0.1,
    unbiased variance for ``running_var``); evaluation mode uses the running
    statistics. :meth:`reduce_stats` and :meth:`reduce_grad_stats` are the
    points where :class:`ferrompi.parallel.SyncBatchNorm` sums across ranks.
    """

    param_names = ("weight", "bias")

    def __init__(self, num_features: int, *, eps: float = 1e-5, momentum: float = 0.1) -> None:
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.running_mean = np.zeros(num_features)
        self.running_var = np.ones(num_features)

    def init_params(self, rng, dtype=np.float64) -> dict[str, np.ndarray]:
        return {
            "weight": np.ones(self.num_features, dtype),
            "bias": np.zeros(self.num_features, dtype),
        }

    def _axes(self, x: np.ndarray) -> tuple[int, ...]:
        if x.ndim not in (2, 3, 4) or x.shape[1] != self.num_features:
            raise ValueError(
                f"BatchNorm({self.num_features}) takes (N, C), (N, C, L) or (N, C, H, W) with "
                f"C = {self.num_features}, got shape {x.shape}"
            )
        return (0, *range(2, x.ndim))

    def _shape(self, x: np.ndarray) -> tuple[int, ...]:
        return (1, self.num_features) + (1,) * (x.ndim - 2)

    def reduce_stats(self, stats: np.ndarray) -> np.ndarray:
        """Per-channel ``[sum, sum of squares, count]`` (shape ``(3, C)``); identity here."""
        return stats

    def reduce_grad_stats(self, stats: np.ndarray) -> np.ndarray:
        """Per-channel ``[sum dy, sum dy * xhat]`` (shape ``(2, C)``); identity here."""
        return stats

    def forward(self, p: dict, x: np.ndarray, training: bool = True):
        axes, shape = self._axes(x), self._shape(x)
        n = 0.0
        if not training:
            mean, var = self.running_mean, self.running_var
        else:
            count = x.size // self.num_features
            stats = np.stack(
                [
                    x.sum(axis=axes, dtype=np.float64),
                    np.square(x, dtype=np.float64).sum(axis=axes),
                    np.full(self.num_features, float(count)),
                ]
            )
            total, squares, n = self.reduce_stats(stats)
            n = n[0]
            if n < 1:
                raise ValueError("BatchNorm in training mode needs at least one value per channel")
            mean = total / n
            var = np.maximum(squares / n - mean**2, 0.0)
            m = self.momentum
            self.running_mean = (1 - m) * self.running_mean + m * mean
            unbiased = var * n / (n - 1) if n > 1 else var
            self.running_var = (1 - m) * self.running_var + m * unbiased
        inv_std = 1.0 / np.sqrt(var + self.eps)
        xhat = (x - mean.reshape(shape)) * inv_std.reshape(shape)
        y = xhat * p["weight"].reshape(shape) + p["bias"].reshape(shape)
        return y.astype(x.dtype, copy=False), (xhat, inv_std, training, n)

    def backward(self, p: dict, cache, dy: np.ndarray):
        xhat, inv_std, training, n = cache
        axes, shape = self._axes(dy), self._shape(dy)
        sum_dy = dy.sum(axis=axes, dtype=np.float64)
        sum_dy_xhat = (dy * xhat).sum(axis=axes, dtype=np.float64)
        grads = {"weight": sum_dy_xhat.astype(dy.dtype), "bias": sum_dy.astype(dy.dtype)}
        w = p["weight"].reshape(shape)
        if not training:
            return dy * w * inv_std.reshape(shape), grads
        g_dy, g_dy_xhat = self.reduce_grad_stats(np.stack([sum_dy, sum_dy_xhat]))
        dx = (w * inv_std.reshape(shape)) * (
            dy - (g_dy / n).reshape(shape) - xhat * (g_dy_xhat / n).reshape(shape)
        )
        return dx.astype(dy.dtype, copy=False), grads


class Sequential:
    """Layers applied in order; parameters named ``"<index>.<name>"``.

    Parameters
    ----------
    layers : sequence
        Objects with ``param_names``, ``init_params(rng)``, ``forward(p, x,
        training) -> (y, cache)`` and ``backward(p, cache, dy) -> (dx, grads)``.
    seed : int
        Seed of the parameter initialisation.
    dtype : dtype
        Parameter dtype.
    """

    def __init__(self, layers: Sequence, *, seed: int = 0, dtype=np.float64) -> None:
        self.layers = list(layers)
        rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}
        for i, layer in enumerate(self.layers):
            for name, value in layer.init_params(rng, dtype).items():
                self.params[f"{i}.{name}"] = value

    def layer_params(self, i: int, params: dict | None = None) -> dict[str, np.ndarray]:
        """The parameters of layer ``i``, by their short names."""
        params = self.params if params is None else params
        return {n: params[f"{i}.{n}"] for n in self.layers[i].param_names}

    def forward(self, x: np.ndarray, params: dict | None = None, training: bool = True):
        """Return ``(output, caches)``."""
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer.forward(self.layer_params(i, params), x, training)
            caches.append(cache)
        return x, caches

    def backward(
        self,
        dy: np.ndarray,
        caches: list,
        params: dict | None = None,
        on_grad: GradHook | None = None,
    ):
        """Return ``(d_input, grads)``; ``on_grad(name, grad)`` fires as each is ready."""
        grads: dict[str, np.ndarray] = {}
        for i in reversed(range(len(self.layers))):
            layer = self.layers[i]
            dy, layer_grads = layer.backward(self.layer_params(i, params), caches[i], dy)
            for n in reversed(layer.param_names):
                name = f"{i}.{n}"
                grads[name] = layer_grads[n]
                if on_grad is not None:
                    on_grad(name, layer_grads[n])
        return dy, grads


class MLP(Sequential):
    """Linear layers with ReLU between them (and optionally BatchNorm before each ReLU).

    Parameters
    ----------
    sizes : sequence of int
        ``[in, hidden..., out]``.
    batchnorm : bool
        Insert a :class:`BatchNorm` after each hidden Linear.
    seed : int
        Initialisation seed.
    """

    def __init__(
        self, sizes: Sequence[int], *, batchnorm: bool = False, seed: int = 0, dtype=np.float64
    ) -> None:
        layers: list = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(Linear(a, b))
            if i < len(sizes) - 2:
                if batchnorm:
                    layers.append(BatchNorm(b))
                layers.append(ReLU())
        super().__init__(layers, seed=seed, dtype=dtype)


def mse(pred: np.ndarray, target: np.ndarray, scale: float | None = None):
    """Mean squared error and its gradient; ``scale`` overrides the ``1 / pred.size`` factor."""
    diff = pred - target
    factor = 1.0 / diff.size if scale is None else scale
    return float(np.sum(diff * diff) * factor), 2.0 * factor * diff


def cross_entropy(logits: np.ndarray, labels: np.ndarray, scale: float | None = None):
    """Softmax cross-entropy (mean over rows) and its gradient; ``scale`` overrides ``1 / rows``."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    factor = 1.0 / max(len(labels), 1) if scale is None else scale
    loss = -float(logp[rows, labels].sum()) * factor
    grad = np.exp(logp)
    grad[rows, labels] -= 1.0
    return loss, grad * factor
