"""Deprecated: an old path of :mod:`artifex.generative_models.flow.text_dit`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.text_dit``. It declares no ``__all__``, so the
API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.text_dit import (  # noqa: F401  (re-exported for old imports)
    SHAPES_VOCABULARY,
    TextFlowDiT,
    TextFlowDiTConfig,
    check_token_ids,
)

warnings.warn(
    "artifex.generative_models.models.flow.text_dit is deprecated; "
    "import from artifex.generative_models.flow.text_dit instead",
    DeprecationWarning,
    stacklevel=2,
)
