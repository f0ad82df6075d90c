# The package face: every public name of ferrompi, for type checkers and IDEs.
# A module imported with * gives its whole __all__; the others give the names
# listed. ferrompi/__init__.py reads this file to load each name's module on
# its first use, so a public name is written once, in its module's __all__.
from ._progress import *
from .backend import *
from .checkpoint import *
from .collectives import *
from .debug import *
from .dtensor import *
from .errors import *
from .excepthook import *
from .flight import *
from .gpu import cuda_aware as cuda_aware
from .groups import *
from .launch import LaunchInfo as LaunchInfo
from .mesh import *
from .monitored import *
from .objects import *
from .ops import *
from .p2p import *
from .placements import *
from .plans import *
from .rooted import *
from .uneven import *

__version__: str
