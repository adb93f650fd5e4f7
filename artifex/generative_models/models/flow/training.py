"""Deprecated: an old path of :mod:`artifex.generative_models.flow.pretraining`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.pretraining``. It declares no ``__all__``, so
the API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.pretraining import (  # noqa: F401  (re-exported for old imports)
    FlowTrainConfig,
    flow_matching_loss,
    load_digits_images,
    train_flow_matching,
)

warnings.warn(
    "artifex.generative_models.models.flow.training is deprecated; "
    "import from artifex.generative_models.flow.pretraining instead",
    DeprecationWarning,
    stacklevel=2,
)
