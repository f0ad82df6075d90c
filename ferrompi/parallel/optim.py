"""Optimizers over parameter dicts: :class:`SGD` (with momentum) and :class:`Adam`.

The update rules are torch's (``torch.optim.SGD`` with ``dampening=0``,
``torch.optim.Adam`` with bias correction and ``eps`` outside the square
root). ``step(grads)`` updates the arrays of ``params`` in place, so an
optimizer over FSDP's local shards steps only those shards.

Examples
--------
>>> import numpy as np
>>> from ferrompi.parallel import SGD
>>> params = {"w": np.array([1.0, 2.0])}
>>> opt = SGD(params, lr=0.1, momentum=0.9)
>>> opt.step({"w": np.array([1.0, 1.0])}); opt.step({"w": np.array([1.0, 1.0])})
>>> params["w"]   # 1 - 0.1 * (1 + 1.9), 2 - 0.1 * (1 + 1.9)
array([0.71, 1.71])
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

__all__ = ["SGD", "Adam"]


def _check(params: dict, grads: dict, who: str) -> None:
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise InvalidArgument(f"{who}.step: gradients for unknown parameters {unknown}")
    for name, g in grads.items():
        if g.shape != params[name].shape:
            raise InvalidArgument(
                f"{who}.step: gradient of {name!r} has shape {g.shape}, the parameter "
                f"{params[name].shape}"
            )


class SGD:
    """Stochastic gradient descent with optional momentum and weight decay.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Updated in place.
    lr : float
        Learning rate.
    momentum : float
        Momentum factor (0: plain SGD).
    weight_decay : float
        L2 penalty added to the gradient.
    nesterov : bool
        Nesterov momentum.
    """

    def __init__(
        self,
        params: dict,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise InvalidArgument(
                f"SGD: lr must be > 0 and momentum, weight_decay >= 0 (got lr={lr}, "
                f"momentum={momentum}, weight_decay={weight_decay})"
            )
        self.params = params
        self.lr, self.momentum, self.weight_decay, self.nesterov = (
            lr,
            momentum,
            weight_decay,
            nesterov,
        )
        self.state: dict[str, np.ndarray] = {}

    def step(self, grads: dict) -> None:
        """Apply one update with ``grads`` (names of ``params``; missing ones are skipped)."""
        _check(self.params, grads, "SGD")
        for name, g in grads.items():
            p = self.params[name]
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                buf = self.state.get(name)
                if buf is None:
                    buf = self.state[name] = np.array(g, dtype=p.dtype, copy=True)
                else:
                    buf *= self.momentum
                    buf += g
                g = g + self.momentum * buf if self.nesterov else buf
            p -= self.lr * g

    def state_nbytes(self) -> int:
        """Bytes of optimizer state (momentum buffers)."""
        return sum(b.nbytes for b in self.state.values())


class Adam:
    """Adam (Kingma & Ba) with torch's defaults.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Updated in place.
    lr : float
        Learning rate (default 1e-3).
    betas : tuple of float
        Decay rates of the first and second moments.
    eps : float
        Added to the denominator.
    weight_decay : float
        L2 penalty added to the gradient.
    """

    def __init__(
        self,
        params: dict,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps < 0:
            raise InvalidArgument(f"Adam: invalid lr={lr}, betas={betas} or eps={eps}")
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.steps: dict[str, int] = {}

    def step(self, grads: dict) -> None:
        """Apply one update with ``grads``."""
        _check(self.params, grads, "Adam")
        b1, b2 = self.betas
        for name, g in grads.items():
            p = self.params[name]
            if self.weight_decay:
                g = g + self.weight_decay * p
            if name not in self.state:
                self.state[name] = (np.zeros_like(p), np.zeros_like(p))
                self.steps[name] = 0
            m, v = self.state[name]
            self.steps[name] += 1
            t = self.steps[name]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state (two moment buffers per parameter)."""
        return sum(m.nbytes + v.nbytes for m, v in self.state.values())
