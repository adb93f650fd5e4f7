"""Deprecated: an old path of :mod:`artifex.generative_models.flow.batch`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.batch``. It declares no ``__all__``, so the API
reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.batch import (  # noqa: F401  (re-exported for old imports)
    FlowConditioning,
    FlowLogProbFn,
    flow_kl,
    flow_log_prob_fn,
    to_grpo_batch,
)

warnings.warn(
    "artifex.generative_models.training.rl.flow_batch is deprecated; "
    "import from artifex.generative_models.flow.batch instead",
    DeprecationWarning,
    stacklevel=2,
)
