"""Deprecated: the old path of :mod:`artifex.generative_models.flow.io`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.generative_models.flow.io``. It declares no ``__all__``, so the API reference
documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.io import (  # noqa: F401  (re-exported for old imports)
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_flow_model,
    register_flow_model,
    save_flow_model,
)

warnings.warn(
    "artifex.generative_models.models.flow.io is deprecated; "
    "import from artifex.generative_models.flow.io instead",
    DeprecationWarning,
    stacklevel=2,
)
