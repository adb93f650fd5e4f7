"""Deprecated: the old path of the flow samplers; import from :mod:`artifex.generative_models.flow`.

The samplers are in :mod:`artifex.generative_models.flow.sampling` and the SDE they step in
:mod:`artifex.generative_models.flow.sde`. Importing this module warns (``DeprecationWarning``)
and gives the same objects as those two. It declares no ``__all__``, so the API reference
documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.sampling import (  # noqa: F401  (re-exported for old imports)
    FlowSampler,
    FlowTrajectory,
    check_prompts,
    sample_flow,
    sde_step,
)
from artifex.generative_models.flow.sde import (  # noqa: F401  (re-exported for old imports)
    MAX_NOISE_LEVEL,
    SDEConfig,
    gaussian_kl,
    gaussian_log_prob,
    sde_transition,
    time_grid,
)

warnings.warn(
    "artifex.generative_models.inference.flow_sampling is deprecated; import from "
    "artifex.generative_models.flow (flow.sampling, flow.sde) instead",
    DeprecationWarning,
    stacklevel=2,
)
