"""Deprecated: an old path of :mod:`artifex.generative_models.flow.shapes`.

Import from there instead. Importing this module warns (``DeprecationWarning``) and gives the
same objects as ``artifex.generative_models.flow.shapes``. It declares no ``__all__``, so the
API reference documents the objects once, at their new path.
"""

import warnings

from artifex.generative_models.flow.shapes import (  # noqa: F401  (re-exported for old imports)
    COLOURS,
    COUNT_WORDS,
    RELATIONS,
    SHAPES,
    SHAPES_VOCABULARY,
    ObjectGroup,
    Scene,
    WordTokenizer,
    all_captions,
    draw_scene,
    make_shapes_dataset,
    parse_caption,
    sample_scene,
    split_captions,
)

warnings.warn(
    "artifex.generative_models.models.flow.shapes is deprecated; "
    "import from artifex.generative_models.flow.shapes instead",
    DeprecationWarning,
    stacklevel=2,
)
