"""Deprecated: the old path of :mod:`artifex.generative_models.flow.dit`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.generative_models.flow.dit``. It declares no ``__all__``, so the API reference
documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.dit import (  # noqa: F401  (re-exported for old imports)
    FlowDiT,
    FlowDiTConfig,
    patchify,
    sincos_position_embeddings,
    unpatchify,
)

warnings.warn(
    "artifex.generative_models.models.flow.dit is deprecated; "
    "import from artifex.generative_models.flow.dit instead",
    DeprecationWarning,
    stacklevel=2,
)
