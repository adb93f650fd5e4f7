"""Deprecated: an old path of :mod:`artifex.generative_models.flow.objective`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.objective``. It declares no ``__all__``, so the
API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.objective import (  # noqa: F401  (re-exported for old imports)
    flow_grpo_objective,
)

warnings.warn(
    "artifex.generative_models.training.rl.flow_objective is deprecated; "
    "import from artifex.generative_models.flow.objective instead",
    DeprecationWarning,
    stacklevel=2,
)
