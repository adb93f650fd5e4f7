"""Deprecated: the old path of :mod:`artifex.demos.tools`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.demos.tools``. It declares no ``__all__``, so the API reference documents the
objects once, at their new path.
"""

import warnings

from artifex.demos.tools import (  # noqa: F401  (re-exported for old imports)
    TOOL_CHAT_TEMPLATE,
    ToolDemoConfig,
    multiplication_dataset,
    multiply,
    run_tool_demo,
    tool_demo_tokenizer,
    tool_warmup,
    tool_warmup_rows,
)

warnings.warn(
    "artifex.demo_tools is deprecated; import from artifex.demos.tools instead",
    DeprecationWarning,
    stacklevel=2,
)
