"""Tasks models are trained and evaluated on; integer addition (PAPER.md section 4) for now.

The package's names are `addition`'s public ones (its `__all__`, listed there once)."""

from normlab.tasks.addition import *  # noqa: F403
from normlab.tasks.addition import __all__  # noqa: F401
