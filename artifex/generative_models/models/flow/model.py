"""Deprecated: an old path of :mod:`artifex.generative_models.flow.model`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.model``. It declares no ``__all__``, so the API
reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.model import (  # noqa: F401  (re-exported for old imports)
    FlowModel,
    FlowModelConfig,
    check_class_labels,
    timestep_features,
)

warnings.warn(
    "artifex.generative_models.models.flow.model is deprecated; "
    "import from artifex.generative_models.flow.model instead",
    DeprecationWarning,
    stacklevel=2,
)
