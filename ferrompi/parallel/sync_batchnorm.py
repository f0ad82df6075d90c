"""SyncBatchNorm: batch statistics over the global batch of every rank.

:class:`SyncBatchNorm` is :class:`ferrompi.models.BatchNorm` whose per-channel
statistics are summed across the ranks of a backend:

* forward: one allreduce of ``[sum, sum of squares, count]`` per channel
  (``3 C`` float64), so mean and variance are those of the concatenated
  batch, with the true global count: ranks may hold different batch sizes,
  even zero (the reference crate assumes equal ones);
* backward: one allreduce of ``[sum dy, sum dy * xhat]`` per channel, so the
  input gradient is that of BatchNorm over the global batch;
* ``running_mean`` / ``running_var`` are updated as torch does (momentum, and
  the unbiased variance ``var * n / (n - 1)`` of the global batch).

The weight and bias gradients it returns are this rank's share (sums over
its rows), as in torch: a data-parallel wrapper (DDP) averages them.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> from ferrompi.parallel import SyncBatchNorm
>>> def f(b):
...     bn = SyncBatchNorm(2, b)
...     x = np.full((b.rank + 1, 2), float(b.rank))   # batch sizes 1 and 2
...     y, _ = bn.forward(bn.init_params(None), x)
...     return y.round(3).tolist()
>>> fm.SimulatedBackend.run(2, f)    # global mean 2/3 over 3 rows
[[[-1.414, -1.414]], [[0.707, 0.707], [0.707, 0.707]]]
"""

from __future__ import annotations

import numpy as np

from .. import collectives
from ..backend import Backend
from ..models.mlp import BatchNorm, Sequential

__all__ = ["SyncBatchNorm", "SyncBatchNorm2d", "convert_sync_batchnorm"]


class SyncBatchNorm(BatchNorm):
    """BatchNorm with statistics reduced over ``backend`` (see the module documentation).

    Parameters
    ----------
    num_features : int
        Channels (axis 1 of the input).
    backend : Backend
        The ranks whose batches form the global batch.
    eps : float
        Added to the variance.
    momentum : float
        Running statistics update factor.
    """

    def __init__(
        self, num_features: int, backend: Backend, *, eps: float = 1e-5, momentum: float = 0.1
    ) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.backend = backend

    def reduce_stats(self, stats: np.ndarray) -> np.ndarray:
        return collectives.allreduce(stats, self.backend)

    def reduce_grad_stats(self, stats: np.ndarray) -> np.ndarray:
        return collectives.allreduce(stats, self.backend)


#: The reference crate's name for the same layer.
SyncBatchNorm2d = SyncBatchNorm


def convert_sync_batchnorm(model: Sequential, backend: Backend) -> Sequential:
    """Replace every :class:`BatchNorm` of ``model`` by a :class:`SyncBatchNorm` (in place).

    The running statistics are kept. Returns ``model``.
    """
    for i, layer in enumerate(model.layers):
        if type(layer) is BatchNorm:
            sync = SyncBatchNorm(
                layer.num_features, backend, eps=layer.eps, momentum=layer.momentum
            )
            sync.running_mean, sync.running_var = layer.running_mean, layer.running_var
            model.layers[i] = sync
    return model
