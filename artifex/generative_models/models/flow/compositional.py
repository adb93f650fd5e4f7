"""Deprecated: an old path of :mod:`artifex.generative_models.flow.detection`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.detection``. It declares no ``__all__``, so the
API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.detection import (  # noqa: F401  (re-exported for old imports)
    COLOURS,
    DetectedShape,
    compositional_accuracy,
    compositional_reward,
    detect_shapes,
    scene_checks,
)

warnings.warn(
    "artifex.generative_models.models.flow.compositional is deprecated; "
    "import from artifex.generative_models.flow.detection instead",
    DeprecationWarning,
    stacklevel=2,
)
