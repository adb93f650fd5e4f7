"""Deprecated: the old path of :mod:`artifex.demos.addition`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.demos.addition``. It declares no ``__all__``, so the API reference documents the
objects once, at their new path.
"""

import warnings

from artifex.demos.addition import (  # noqa: F401  (re-exported for old imports)
    DemoConfig,
    addition_dataset,
    demo_model,
    demo_tokenizer,
    digit_reward,
    plot_rewards,
    run_demo,
    supervised_warmup,
)

warnings.warn(
    "artifex.demo is deprecated; import from artifex.demos.addition instead",
    DeprecationWarning,
    stacklevel=2,
)
