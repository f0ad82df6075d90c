"""Small reference models in numpy with explicit forward and backward.

ferrompi has no autograd. These models show the whole training loop with
parameter and gradient dicts (``name -> array``) and give the parallel
wrappers (:mod:`ferrompi.parallel`) and their tests a real model to train.
"""

from .data import rings
from .mlp import MLP, BatchNorm, Linear, ReLU, Sequential, cross_entropy, mse

__all__ = ["MLP", "BatchNorm", "Linear", "ReLU", "Sequential", "cross_entropy", "mse", "rings"]
