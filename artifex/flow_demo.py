"""Deprecated: the old path of :mod:`artifex.demos.flow`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.demos.flow``. It declares no ``__all__``, so the API reference documents the
objects once, at their new path.
"""

import warnings

from artifex.demos.flow import (  # noqa: F401  (re-exported for old imports)
    FlowDemoConfig,
    FlowDemoResult,
    build_flow_model,
    plot_flow_rewards,
    plot_image_grid,
    run_flow_demo,
)

warnings.warn(
    "artifex.flow_demo is deprecated; import from artifex.demos.flow instead",
    DeprecationWarning,
    stacklevel=2,
)
