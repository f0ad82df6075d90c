"""ferrompi: the torch.distributed programming model over MPI, for numpy and cupy arrays.

Launch with ``mpiexec -n N python script.py``::

    import numpy as np
    import ferrompi as fm

    world = fm.init()
    total = fm.allreduce(np.ones(4), world)      # every rank: [N, N, N, N]

Test without MPI processes on the simulated backend (one thread per rank):

>>> import numpy as np, ferrompi as fm
>>> fm.SimulatedBackend.run(4, lambda b: fm.allreduce(np.ones(2), b))[0]
array([4., 4.])
"""

from __future__ import annotations

import functools
import importlib
import os
import re

from ._pm import defer_mpi_init

__version__ = "0.1.0"

# Where no MPI launcher started this process, MPI_Init waits for ferrompi (torch's
# rendezvous may give the world), even if the program imports mpi4py.MPI next
defer_mpi_init()

# The face is in __init__.pyi (each line a module, whose names are its __all__,
# or names of a module); it is read, not imported, so that `import ferrompi`
# (and the pytest plugin, which pytest loads in every run) neither imports
# h5py nor initialises MPI: a name's module loads on the name's first use (PEP 562).
_HERE = os.path.dirname(__file__)
_FACE_LINE = re.compile(r"^from \.(\w+) import (?:(\*)|(\w+) as \w+)$", re.M)
_ALL = re.compile(r"^__all__ = \[(.*?)\]", re.M | re.S)
_QUOTED = re.compile(r'"(\w+)"')


def _read(*parts: str) -> str:
    with open(os.path.join(_HERE, *parts), encoding="utf-8") as f:
        return f.read()


def _module_all(module: str) -> list[str]:
    """The names of submodule ``module``'s ``__all__``, read from its source (not imported)."""
    try:
        source = _read(module, "__init__.py")
    except FileNotFoundError:
        source = _read(f"{module}.py")
    return _QUOTED.findall(_ALL.search(source).group(1))


@functools.cache
def _face() -> dict[str, str]:
    """Public name -> the submodule that defines it (``__init__.pyi``), in the stub's order."""
    face = {}
    for module, star, name in _FACE_LINE.findall(_read("__init__.pyi")):
        for public in _module_all(module) if star else [name]:
            face[public] = "." + module
    return face


@functools.cache
def _submodules() -> frozenset[str]:
    """The public submodules (no leading underscore), also loaded on first use."""
    return frozenset(
        entry.name.removesuffix(".py")
        for entry in os.scandir(_HERE)
        if not entry.name.startswith("_")
        and (entry.name.endswith(".py") or os.path.isfile(os.path.join(entry.path, "__init__.py")))
    )


def __getattr__(name: str):
    if name == "__all__":
        value = list(_face())
    elif name in _face():
        value = getattr(importlib.import_module(_face()[name], __name__), name)
    elif name in _submodules():
        return importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ferrompi' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_face(), *_submodules()})
