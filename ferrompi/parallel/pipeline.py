"""Pipeline parallelism: stages on ranks, micro-batches through send/recv.

Rank ``s`` of the pipeline's group runs stage ``s`` (a
:class:`ferrompi.models.Sequential`). :meth:`Pipeline.step` splits the batch
into micro-batches (torch's chunk rule), sends each micro-batch's activation
from stage ``s`` to ``s + 1`` and its gradient back, computes the loss on the
last stage, and accumulates every stage's parameter gradients so that they
equal those of the whole batch run through the stages in sequence.

Schedules, for ``S`` stages and ``m`` micro-batches:

* ``"gpipe"``: all ``m`` forwards, then all ``m`` backwards. Each stage
  holds the activations of all ``m`` micro-batches at the peak.
* ``"1f1b"`` (PipeDream-flush): stage ``s`` runs ``S - s - 1`` forwards to
  fill the pipe, then alternates one forward and one backward, then drains.
  At most ``S - s`` micro-batches' activations are in flight.

Both leave the same bubble: ``(S - 1) / (m + S - 1)`` of each stage's time is
idle (for equal stage costs), so more micro-batches shrink it; 1F1B trades
no time for lower activation memory.

Messages travel on the pipeline's own communicator (``backend.split``), so
they never match the caller's point-to-point messages. Each activation or
gradient is preceded by a 9-integer header (dtype and shape), so the later
stages need not know the batch size. Sends are non-blocking and receives
follow the data dependencies, so neither schedule can deadlock.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> from ferrompi.models import Linear, ReLU, Sequential, mse
>>> from ferrompi.parallel import Pipeline
>>> def run(b):
...     stage = Sequential([Linear(3, 4), ReLU()] if b.rank == 0 else [Linear(4, 1)], seed=b.rank)
...     pipe = Pipeline(stage, b, num_microbatches=2, loss_fn=mse)
...     x = np.ones((4, 3)) if b.rank == 0 else None
...     y = np.zeros((4, 1)) if b.rank == 1 else None
...     loss = pipe.step(x, y)
...     return loss is None, sorted(pipe.grads)
>>> fm.SimulatedBackend.run(2, run)
[(True, ['0.bias', '0.weight']), (False, ['0.bias', '0.weight'])]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import p2p
from .._dtypes import dtype_code, dtype_of_code
from ..backend import Backend
from ..errors import DistributedError, InvalidArgument
from ..groups import destroy_process_group
from ..models.mlp import Sequential
from ..placements import chunk_range

__all__ = ["Pipeline", "build_schedule"]

_ACT, _GRAD = 1, 2
_HEADER = 9  # dtype char, ndim, then up to 7 dims


def build_schedule(kind: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The order of ``("F", i)`` / ``("B", i)`` steps of ``stage``.

    Examples
    --------
    >>> from ferrompi.parallel import build_schedule
    >>> build_schedule("1f1b", 0, 3, 4)
    [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
    >>> build_schedule("gpipe", 2, 3, 2)
    [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    if kind == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if kind == "1f1b":
        warmup = min(stages - stage - 1, micro)
        order = [("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < micro:
            if forward < micro:
                order.append(("F", forward))
                forward += 1
            order.append(("B", backward))
            backward += 1
        return order
    raise InvalidArgument(f"unknown schedule {kind!r}: use 'gpipe' or '1f1b'")


class Pipeline:
    """One stage of a pipeline over ``backend`` (see the module documentation).

    Parameters
    ----------
    stage : ferrompi.models.Sequential
        This rank's stage.
    backend : Backend
        The pipeline group: rank ``s`` is stage ``s``.
    num_microbatches : int
        Micro-batches per step.
    schedule : {"1f1b", "gpipe"}
        The schedule.
    loss_fn : callable, optional
        On the last stage: ``loss_fn(output, target) -> (mean loss, d_output)``
        for one micro-batch (e.g. :func:`ferrompi.models.mse`); the pipeline
        weighs each micro-batch by its share of the batch.

    Attributes
    ----------
    grads : dict of str to numpy.ndarray
        This stage's gradients, accumulated by :meth:`step` (zero them with
        :meth:`zero_grad`).
    peak_in_flight : int
        Most micro-batches whose activations this stage held at once.
    """

    def __init__(
        self,
        stage: Sequential,
        backend: Backend,
        *,
        num_microbatches: int,
        schedule: str = "1f1b",
        loss_fn: Callable | None = None,
    ) -> None:
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or (num_microbatches < 1)
        ):
            raise InvalidArgument(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
        build_schedule(schedule, 0, 1, 1)  # validates the name
        self.stage = stage
        self.kind = schedule
        self.micro = num_microbatches
        self.loss_fn = loss_fn
        if backend.rank == backend.world_size - 1 and loss_fn is None:
            raise InvalidArgument("the last stage needs a loss_fn")
        self.group = backend.split(0, key=backend.rank)  # the pipeline's own communicator
        self.index = self.group.rank
        self.stages = self.group.world_size
        self.is_first = self.index == 0
        self.is_last = self.index == self.stages - 1
        self.grads = {k: np.zeros_like(v) for k, v in stage.params.items()}
        self.peak_in_flight = 0

    def close(self) -> None:
        """Free the pipeline's own communicator; collective over ``backend``.

        Every stage must call it, once its last :meth:`step` or
        :meth:`predict` has returned (:func:`~ferrompi.destroy_process_group`
        on :attr:`group`), so that a program that builds many pipelines does
        not run out of communicators. Afterwards :meth:`step` and
        :meth:`predict` raise :class:`~ferrompi.DistributedError`; a second
        call does nothing.
        """
        destroy_process_group(self.group)

    def _require_open(self, name: str) -> None:
        # a one-stage pipeline sends nothing, so the group would not tell
        broken = self.group._state.broken
        if broken is not None:
            raise DistributedError(f"Pipeline.{name}: {broken}")

    def zero_grad(self) -> None:
        for g in self.grads.values():
            g[...] = 0

    def _send(self, array: np.ndarray, dst: int, tag: int, pending: list) -> None:
        header = np.zeros(_HEADER, np.int64)
        header[0], header[1] = dtype_code(array.dtype), array.ndim
        header[2 : 2 + array.ndim] = array.shape
        pending.append(p2p.isend(header, dst, self.group, tag))
        pending.append(p2p.isend(np.ascontiguousarray(array), dst, self.group, tag))

    def _recv(self, src: int, tag: int) -> np.ndarray:
        header = p2p.recv((_HEADER,), src, self.group, np.int64, tag)
        dtype = dtype_of_code(int(header[0]))
        return p2p.recv(
            tuple(int(d) for d in header[2 : 2 + header[1]]), src, self.group, dtype, tag
        )

    def predict(self, inputs: np.ndarray | None = None) -> np.ndarray | None:
        """Forward only (evaluation mode), micro-batch by micro-batch.

        Returns the outputs on the last stage (``None`` elsewhere); ``inputs``
        is needed on the first stage only.
        """
        self._require_open("predict")
        if self.is_first and inputs is None:
            raise InvalidArgument("the first stage needs inputs")
        pending: list = []
        outputs = []
        for i in range(self.micro):
            if self.is_first:
                a, b = chunk_range(len(inputs), self.micro, i)
                x = inputs[a:b]
            else:
                x = self._recv(self.index - 1, _ACT)
            out, _ = self.stage.forward(x, training=False)
            if self.is_last:
                outputs.append(out)
            else:
                self._send(out, self.index + 1, _ACT, pending)
        for work in pending:
            work.wait()
        return np.concatenate(outputs) if self.is_last else None

    def step(self, inputs: np.ndarray | None = None, targets: np.ndarray | None = None):
        """Run one forward and backward over the batch; collective over the pipeline.

        Parameters
        ----------
        inputs : numpy.ndarray, optional
            The batch, on the first stage (ignored elsewhere).
        targets : numpy.ndarray, optional
            Its targets, on the last stage (ignored elsewhere).

        Returns
        -------
        float or None
            The batch's loss on the last stage, ``None`` on the others.

        Raises
        ------
        InvalidArgument
            Missing inputs/targets, or fewer rows than micro-batches.
        DistributedError
            After :meth:`close`.
        """
        self._require_open("step")
        if self.is_first and inputs is None:
            raise InvalidArgument("the first stage needs inputs")
        if self.is_last and targets is None:
            raise InvalidArgument("the last stage needs targets")
        rows = None
        if self.is_first:
            rows = len(inputs)
        elif self.is_last:
            rows = len(targets)
        if rows is not None and rows < self.micro:
            raise InvalidArgument(f"a batch of {rows} rows cannot make {self.micro} micro-batches")
        pending: list = []
        caches: dict[int, list] = {}
        loss = 0.0
        for op, i in build_schedule(self.kind, self.index, self.stages, self.micro):
            if op == "F":
                if self.is_first:
                    a, b = chunk_range(len(inputs), self.micro, i)
                    x = inputs[a:b]
                else:
                    x = self._recv(self.index - 1, _ACT)
                out, cache = self.stage.forward(x)
                caches[i] = [cache, out]
                self.peak_in_flight = max(self.peak_in_flight, len(caches))
                if not self.is_last:
                    self._send(out, self.index + 1, _ACT, pending)
            else:
                cache, out = caches.pop(i)
                if self.is_last:
                    a, b = chunk_range(len(targets), self.micro, i)
                    mb_loss, dout = self.loss_fn(out, targets[a:b])
                    weight = (b - a) / len(targets)
                    loss += mb_loss * weight
                    dout = dout * weight
                else:
                    dout = self._recv(self.index + 1, _GRAD)
                dx, grads = self.stage.backward(dout, cache)
                for name, g in grads.items():
                    self.grads[name] += g
                if not self.is_first:
                    self._send(dx, self.index - 1, _GRAD, pending)
        for work in pending:
            work.wait()
        return loss if self.is_last else None
