"""Flow-GRPO's old module paths still import: the same objects, with a DeprecationWarning.

Flow-GRPO moved into one package, ``artifex.generative_models.flow``; each old module (under
``models.flow``, ``inference.flow_sampling``, ``training.rl.flow_batch`` and ``flow_objective``)
is an alias that re-exports what it exported before and warns, naming the new path.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest

import artifex.generative_models.inference as inference

GM = "artifex.generative_models"
# old path (under GM) -> (its new modules, the names it exported)
OLD_PATHS = {
    "models.flow": (
        ("flow",),
        "DetectedShape DigitClassifier FlowDiT FlowDiTConfig FlowModel FlowModelConfig "
        "FlowTrainConfig ImageReward ObjectGroup SHAPES_VOCABULARY Scene TextFlowDiT "
        "TextFlowDiTConfig WordTokenizer all_captions brightness_reward check_class_labels "
        "check_token_ids classifier_reward combine_image_rewards compositional_accuracy "
        "compositional_reward compressibility_reward detect_shapes draw_scene flow_matching_loss "
        "load_digits_images load_flow_model make_shapes_dataset parse_caption patchify "
        "save_flow_model scene_checks sincos_position_embeddings split_captions timestep_features "
        "train_classifier train_flow_matching unpatchify",
    ),
    "models.flow.model": (
        ("flow.model",),
        "FlowModel FlowModelConfig check_class_labels timestep_features",
    ),
    "models.flow.dit": (
        ("flow.dit",),
        "FlowDiT FlowDiTConfig patchify sincos_position_embeddings unpatchify",
    ),
    "models.flow.text_dit": (
        ("flow.text_dit",),
        "TextFlowDiT TextFlowDiTConfig check_token_ids",
    ),
    "models.flow.io": (
        ("flow.io",),
        "load_flow_model register_flow_model save_flow_model",
    ),
    "models.flow.shapes": (
        ("flow.shapes",),
        "COLOURS COUNT_WORDS ObjectGroup RELATIONS SHAPES SHAPES_VOCABULARY Scene WordTokenizer "
        "all_captions draw_scene make_shapes_dataset parse_caption sample_scene split_captions",
    ),
    "models.flow.compositional": (
        ("flow.detection",),
        "DetectedShape compositional_accuracy compositional_reward detect_shapes scene_checks",
    ),
    "models.flow.rewards": (
        ("flow.rewards",),
        "DigitClassifier ImageReward brightness_reward classifier_reward combine_image_rewards "
        "compressibility_reward train_classifier",
    ),
    "models.flow.training": (
        ("flow.pretraining",),
        "FlowTrainConfig flow_matching_loss load_digits_images train_flow_matching",
    ),
    "inference.flow_sampling": (
        ("flow.sampling", "flow.sde"),
        "FlowSampler FlowTrajectory MAX_NOISE_LEVEL SDEConfig check_prompts gaussian_kl "
        "gaussian_log_prob sample_flow sde_step sde_transition time_grid",
    ),
    "training.rl.flow_batch": (
        ("flow.batch",),
        "FlowConditioning FlowLogProbFn flow_kl flow_log_prob_fn to_grpo_batch",
    ),
    "training.rl.flow_objective": (
        ("flow.objective",),
        "flow_grpo_objective",
    ),
}


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_path_warns_and_gives_the_same_objects(old, monkeypatch):
    news, names = OLD_PATHS[old]
    # import it afresh (its package too, for a submodule): the warnings again
    for name in [n for n in sys.modules if n == f"{GM}.{old}" or n.startswith(f"{GM}.{old}.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{GM}.{old} is deprecated")) as seen:
        alias = importlib.import_module(f"{GM}.{old}")
    message = next(str(w.message) for w in seen if str(w.message).startswith(f"{GM}.{old} "))
    assert f"{GM}.{news[0].split('.')[0]}" in message  # it names the flow package
    modules = [importlib.import_module(f"{GM}.{new}") for new in news]
    for name in names.split():
        new_obj = next(getattr(m, name) for m in modules if hasattr(m, name))
        assert getattr(alias, name) is new_obj, name
    assert not hasattr(alias, "__all__")  # documented once, at the new path


def test_a_new_module_exports_every_name_of_its_old_path():
    flow = importlib.import_module(f"{GM}.flow")
    for old, (news, names) in OLD_PATHS.items():
        exported = set().union(*(importlib.import_module(f"{GM}.{n}").__all__ for n in news))
        assert set(names.split()) <= exported | set(flow.__all__), old


def test_the_inference_package_no_longer_reexports_the_flow_samplers():
    # They live above it now; inference.flow_sampling is the alias of their old path.
    assert not {"FlowSampler", "SDEConfig", "sample_flow"} & set(inference.__all__)
