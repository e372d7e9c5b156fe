"""Native ops: fused CPU optimizers (`adam`, `adagrad`, `lion`) built just in time by `op_builder`.

Importing this package compiles nothing: an op is built (or found in the cache) the first time
an optimizer that needs it is constructed.
"""

from zerospeed.ops import adagrad, adam, lion, op_builder

__all__ = ["adagrad", "adam", "lion", "op_builder"]
