"""Deprecated: the old path of :mod:`artifex.generative_models.flow`; import from there instead.

Importing this module warns (``DeprecationWarning``) and gives the same objects as
``artifex.generative_models.flow``. It declares no ``__all__``, so the API reference documents
the objects once, at their new path. Its submodules (``model``, ``dit``, ``text_dit``, ``io``,
``shapes``, ``compositional``, ``rewards``, ``training``) are deprecated aliases of the modules
of the new package too.
"""

import warnings

from artifex.generative_models.flow import (  # noqa: F401  (re-exported for old imports)
    SHAPES_VOCABULARY,
    DetectedShape,
    DigitClassifier,
    FlowDiT,
    FlowDiTConfig,
    FlowModel,
    FlowModelConfig,
    FlowTrainConfig,
    ImageReward,
    ObjectGroup,
    Scene,
    TextFlowDiT,
    TextFlowDiTConfig,
    WordTokenizer,
    all_captions,
    brightness_reward,
    check_class_labels,
    check_token_ids,
    classifier_reward,
    combine_image_rewards,
    compositional_accuracy,
    compositional_reward,
    compressibility_reward,
    detect_shapes,
    draw_scene,
    flow_matching_loss,
    load_digits_images,
    load_flow_model,
    make_shapes_dataset,
    parse_caption,
    patchify,
    save_flow_model,
    scene_checks,
    sincos_position_embeddings,
    split_captions,
    timestep_features,
    train_classifier,
    train_flow_matching,
    unpatchify,
)

warnings.warn(
    "artifex.generative_models.models.flow is deprecated; "
    "import from artifex.generative_models.flow instead",
    DeprecationWarning,
    stacklevel=2,
)
