"""The private names of torch that :mod:`ferrompi.torch` uses, in one place.

torch may rename or move any of these between releases; this module is where
a new torch version is met. Everything else in the package imports them from
here, and uses only torch's public API besides.

Not gathered here: the private *method* names that
:class:`~ferrompi.torch.ProcessGroupFerrompi` and
:class:`~ferrompi.torch.FerrompiWork` define (``_allgather_base``,
``_reduce_scatter_base``, ``_start_coalescing``, ``_end_coalescing``,
``_set_group_name``, ``_set_group_desc``, ``_source_rank``): torch calls them
by those names, so they are torch's protocol, written where they are defined.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import torch
import torch.distributed as dist

#: The base class of a work written in Python (torch's ``Work`` for Python subclasses).
Work = dist._Work

# the module (torch.distributed's attribute of that name is its function)
_rendezvous_module = importlib.import_module("torch.distributed.rendezvous")

#: torch's rendezvous handlers by URL scheme (``"env"``, ``"tcp"``, ``"file"``),
#: which ``init_process_group(init_method=...)`` looks up; the one of ``env://``
#: is replaced by ferrompi's at registration.
RENDEZVOUS_HANDLERS = _rendezvous_module._rendezvous_handlers

# init_process_group's own code, under its logging decorators
_INIT_PROCESS_GROUP = inspect.unwrap(dist.init_process_group).__code__


def backend_asking_for_rendezvous() -> str | None:
    """The ``backend`` of the ``init_process_group`` call that runs the rendezvous
    handler calling this, as ``init_process_group`` normalised it (``"ferrompi"``,
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``); ``None`` when no such call is on the stack
    (``torch.distributed.rendezvous`` called directly, RPC's own rendezvous).

    torch looks handlers up by URL scheme and does not tell them the backend:
    this reads it from the caller's frame, the only place it is.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _INIT_PROCESS_GROUP:
            backend = frame.f_locals.get("backend")
            return None if backend is None else str(backend)
        frame = frame.f_back
    return None


#: torch's registered third-party backends by upper-case name: whether
#: ``"ferrompi"`` is registered already (``register_backend`` refuses a second time).
BACKEND_PLUGINS = dist.Backend._plugins


def cpu_backend(pg: dist.ProcessGroup):
    """The CPU backend of the process group ``pg`` (torch's ``_get_backend``): of a group
    of several backends, the one that runs its CPU tensors; RuntimeError if it has none."""
    return pg._get_backend(torch.device("cpu"))
