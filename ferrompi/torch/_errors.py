"""ferrompi's errors as torch's: what the process group raises is both.

torch's backends raise :class:`torch.distributed.DistBackendError` (a
``RuntimeError``) and their tests and users match torch's wording ("Timed out
waiting 1000ms ..."); ferrompi's users catch :class:`ferrompi.CollectiveTimeout`
and read its ``missing`` ranks. An error leaving the ``"ferrompi"`` process
group is therefore an instance of a class derived from both its ferrompi class
and ``DistBackendError``, with ferrompi's attributes, and a timeout's message
starts with torch's words before ferrompi's explanation of who is missing.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import CollectiveTimeout, DistributedError

__all__ = ["as_torch_error"]

# ferrompi class -> its class that is also torch's DistBackendError
_BOTH: dict[type, type] = {}


def _both(cls: type) -> type:
    both = _BOTH.get(cls)
    if both is None:
        doc = f"{cls.__name__} raised through torch: also torch's ``DistBackendError``."
        both = _BOTH[cls] = type(
            cls.__name__, (cls, dist.DistBackendError), {"__module__": __name__, "__doc__": doc}
        )
    return both


def as_torch_error(exc: BaseException) -> BaseException:
    """``exc`` as the process group raises it: a ferrompi :class:`DistributedError`
    becomes an instance of its class and of ``torch.distributed.DistBackendError``
    (same attributes, same traceback); anything else is returned as it is.

    A :class:`CollectiveTimeout`'s message is torch's ("Timed out waiting 1000ms
    for barrier to complete", as gloo words it) followed by ferrompi's own.
    """
    if not isinstance(exc, DistributedError) or isinstance(exc, dist.DistBackendError):
        return exc
    both = _both(type(exc))
    error = both.__new__(both)
    error.__dict__.update(exc.__dict__)
    text = str(exc)
    if isinstance(exc, CollectiveTimeout):
        text = (
            f"[ferrompi] Timed out waiting {round(exc.seconds * 1000)}ms for {exc.op} "
            f"to complete: {text}"
        )
    error.args = (text,)
    return error.with_traceback(exc.__traceback__)
