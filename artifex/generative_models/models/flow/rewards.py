"""Deprecated: an old path of :mod:`artifex.generative_models.flow.rewards`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.rewards``. It declares no ``__all__``, so the
API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.rewards import (  # noqa: F401  (re-exported for old imports)
    DigitClassifier,
    ImageReward,
    brightness_reward,
    classifier_reward,
    combine_image_rewards,
    compressibility_reward,
    train_classifier,
)

warnings.warn(
    "artifex.generative_models.models.flow.rewards is deprecated; "
    "import from artifex.generative_models.flow.rewards instead",
    DeprecationWarning,
    stacklevel=2,
)
