"""The captioned shapes data set: grammar, tokenizer, drawing, and the compositional reward."""

from __future__ import annotations

import numpy as np
import pytest

from artifex.generative_models.flow import (
    SHAPES_VOCABULARY,
    ObjectGroup,
    Scene,
    WordTokenizer,
    all_captions,
    compositional_accuracy,
    compositional_correct,
    compositional_counts,
    compositional_reward,
    detect_shapes,
    draw_scene,
    make_shapes_dataset,
    parse_caption,
    scene_checks,
    split_captions,
)
from artifex.generative_models.flow.shapes import COLOURS


def test_grammar_round_trips_through_parse_and_tokenizer():
    captions = all_captions()
    assert len(captions) == len(set(captions)) == 1092
    tok = WordTokenizer(SHAPES_VOCABULARY, max_length=8)
    assert tok.decode(tok.encode(captions)) == captions
    for caption in captions:
        assert parse_caption(caption).caption == caption
    assert parse_caption("one red square").caption == "a red square"  # "one" is "a"
    train, held = split_captions(0.25, seed=3)
    assert not set(train) & set(held) and len(train) + len(held) == 1092
    single = [c for c in held if parse_caption(c).relation is None]
    assert len(single) == 9  # a quarter of the 36 single-group captions


@pytest.mark.parametrize(
    ("caption", "match"),
    [
        ("four red squares", "expected a count word"),
        ("a purple square", "expected a colour"),
        ("two red square", "expected a shape"),
        ("a red squares", "expected a shape"),
        ("a red square near a blue circle", "expected a relation"),
        ("a red square left of a blue", "ends early"),
        ("a red square above a blue circle now", "unexpected words"),
    ],
)
def test_captions_outside_the_grammar_are_refused(caption, match):
    with pytest.raises(ValueError, match=match):
        parse_caption(caption)


def test_tokenizer_refusals():
    tok = WordTokenizer(SHAPES_VOCABULARY, max_length=4)
    with pytest.raises(ValueError, match="word 'purple' is not in the vocabulary"):
        tok.encode("a purple square")
    with pytest.raises(ValueError, match="word '<pad>' is not in the vocabulary"):
        tok.encode("a <pad> square")
    with pytest.raises(ValueError, match="over max_length 4"):
        tok.encode("two red squares left of a blue circle")
    with pytest.raises(TypeError, match="captions must be strings, got int at row 1"):
        tok.encode(["a red square", 3])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 20\)"):
        tok.decode(np.array([[1, 30]]))
    with pytest.raises(ValueError, match="distinct words"):
        WordTokenizer(["<pad>", "a", "a"], 3)


def _pixels(image, colour):
    return np.all(image == np.array(COLOURS[colour], np.float32), axis=-1)


@pytest.mark.parametrize("layout", ["grid", "free"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drawn_scenes_hold_what_the_caption_says(seed, layout):
    """Counted independently of the reward: pixels per colour, halves of the relation."""
    rng = np.random.default_rng(seed)
    for caption in rng.choice(all_captions(), 40, replace=False):
        scene = parse_caption(caption)
        image = draw_scene(scene, rng, layout=layout)
        assert image.shape == (32, 32, 3) and image.dtype == np.float32
        assert set(np.unique(image)) <= {-1.0, 1.0}
        colours = {g.colour for g in scene.groups}
        for colour in COLOURS:
            assert _pixels(image, colour).any() == (colour in colours)
        if scene.relation is not None and scene.groups[0].colour != scene.groups[1].colour:
            a = _pixels(image, scene.groups[0].colour)
            b = _pixels(image, scene.groups[1].colour)
            axis = 1 if scene.relation in ("left of", "right of") else 0
            ia, ib = np.nonzero(a)[axis], np.nonzero(b)[axis]
            if scene.relation in ("left of", "above"):
                assert ia.max() < ib.min()
            else:
                assert ia.min() > ib.max()


@pytest.mark.parametrize("layout", ["grid", "free"])
def test_the_reward_is_right_on_drawn_images(layout):
    """On drawn scenes every check passes, and the wrong caption fails the checks it should."""
    images, captions = make_shapes_dataset(300, seed=7, layout=layout)
    assert compositional_accuracy(images, captions).all()
    reward = compositional_reward()
    np.testing.assert_array_equal(reward(images, captions), 1.0)
    for image, caption in zip(images[:60], captions[:60], strict=True):
        scene = parse_caption(caption)
        shapes = detect_shapes(image)
        assert sorted((s.colour, s.shape) for s in shapes) == sorted(
            (g.colour, g.shape) for g in scene.groups for _ in range(g.count)
        )
        # one more of the first group: the count check fails, presence does not
        g = scene.groups[0]
        more = Scene(
            (ObjectGroup(g.count % 3 + 1, g.colour, g.shape), *scene.groups[1:]), scene.relation
        )
        checks = scene_checks(shapes, more)
        assert checks["present_0"] and not checks["count_0"]
        if scene.relation is not None:
            flipped = {
                "left of": "right of",
                "right of": "left of",
                "above": "below",
                "below": "above",
            }[scene.relation]
            checks = scene_checks(shapes, Scene(scene.groups, flipped))
            assert not checks["relation"] and checks["count_0"] and checks["count_1"]
        other = next(c for c in COLOURS if c not in {x.colour for x in scene.groups})
        wrong = Scene((ObjectGroup(g.count, other, g.shape), *scene.groups[1:]), scene.relation)
        checks = scene_checks(shapes, wrong)
        assert not checks["present_0"] and not checks["no_extra"]


def test_the_grid_layout_puts_each_shape_in_its_own_cell():
    images, captions = make_shapes_dataset(200, seed=5)
    for image, caption in zip(images, captions, strict=True):
        scene = parse_caption(caption)
        lit = (image > -1.0).any(axis=-1)
        cells = lit.reshape(4, 8, 4, 8).any(axis=(1, 3))
        assert cells.sum() == sum(g.count for g in scene.groups)
        for r, c in zip(*np.nonzero(cells), strict=True):
            block = lit[8 * r : 8 * r + 8, 8 * c : 8 * c + 8]
            assert not block[7].any() and not block[:, 7].any()  # the free row and column
            assert block[:7, :7].any(axis=1).all() or block[:7, :7].any(axis=0).all()
    with pytest.raises(ValueError, match="multiple of 4 for the grid layout"):
        draw_scene(parse_caption("a red square"), np.random.default_rng(0), image_size=30)
    with pytest.raises(ValueError, match="layout"):
        draw_scene(parse_caption("a red square"), np.random.default_rng(0), layout="ring")


def test_shape_kinds_and_noise():
    blank = np.full((32, 32, 3), -1.0, np.float32)
    assert detect_shapes(blank) == []
    img = blank.copy()
    img[2:10, 2:10] = COLOURS["red"]  # an 8x8 square
    img[20:22, 20:22] = COLOURS["blue"]  # 4 pixels: below min_area, noise
    yy, xx = np.mgrid[0:32, 0:32]
    img[(yy - 20.5) ** 2 + (xx - 8.5) ** 2 <= 16] = COLOURS["green"]  # a disk of radius 4
    tri = (yy >= 12) & (yy < 21) & (np.abs(xx - 24) <= (yy - 12) / 2)
    img[tri] = COLOURS["yellow"]
    found = {(s.colour, s.shape) for s in detect_shapes(img)}
    assert found == {("red", "square"), ("green", "circle"), ("yellow", "triangle")}
    # a dim red is background; a noisy near-red is red
    img2 = blank.copy()
    img2[4:12, 4:12] = (-0.2, -1.0, -1.0)
    img2[16:24, 16:24] = (0.8, -0.9, -0.7)
    assert [(s.colour, s.shape) for s in detect_shapes(img2)] == [("red", "square")]


def test_reward_input_checks():
    reward = compositional_reward()
    images = np.zeros((2, 32, 32, 3), np.float32) - 1
    images[1, 3, 4, 0] = np.nan
    with pytest.raises(ValueError, match="image 1: the image has 1 NaN or infinite values"):
        reward(images, ["a red square", "a red square"])
    images[1, 3, 4, 0] = np.inf
    with pytest.raises(ValueError, match="image 1: the image has 1 NaN or infinite values"):
        compositional_accuracy(images, ["a red square", "a red square"])
    ok = np.full((2, 3072), -1.0)
    with pytest.raises(ValueError, match="got 2 images but 1 prompts"):
        reward(ok, ["a red square"])
    with pytest.raises(TypeError, match="token-id prompts need the tokenizer"):
        reward(ok, np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match="expected a colour"):
        reward(ok, ["a red square", "a pink square"])
    with pytest.raises(ValueError, match="3 S\\^2 values"):
        reward(np.zeros((2, 100)), ["a red square"] * 2)
    tok = WordTokenizer(SHAPES_VOCABULARY, max_length=8)
    np.testing.assert_allclose(
        compositional_reward(tok)(ok, tok.encode(["a red square", "two blue circles"])),
        [1 / 3, 1 / 3],  # nothing drawn: present and count fail, nothing extra
        rtol=1e-6,
    )


def test_the_three_scores_follow_the_checks():
    """fraction, correct and counts are each the stated function of scene_checks."""
    images, captions = make_shapes_dataset(40, seed=11)
    rng = np.random.default_rng(3)
    # each image against its own caption and against a caption of another image
    wrong = [
        captions[(i + 1 + rng.integers(len(captions) - 1)) % len(captions)]
        for i in range(len(captions))
    ]
    asked = np.concatenate([images, images])
    caps = captions + wrong
    # an image with one extra red square drawn in the free bottom-right pixel block
    spam = images[0].copy()
    spam[24:31, 24:31] = COLOURS["red"]
    asked = np.concatenate([asked, spam[None]])
    caps = [*caps, captions[0]]
    expect = {"fraction": [], "correct": [], "counts": []}
    for image, caption in zip(asked, caps, strict=True):
        checks = scene_checks(detect_shapes(image), parse_caption(caption))
        values = list(checks.values())
        expect["fraction"].append(sum(values) / len(values))
        expect["correct"].append(float(all(values)))
        rest = [ok for name, ok in checks.items() if not name.startswith("present")]
        expect["counts"].append(sum(rest) / len(rest))
    for score, want in expect.items():
        got = compositional_reward(score=score)(asked, caps)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=score)
    assert 0.0 < np.mean(expect["correct"]) < 1.0
    assert not np.allclose(expect["fraction"], expect["counts"])
    images_list = list(asked)
    np.testing.assert_allclose(compositional_correct(caps, images_list), expect["correct"])
    np.testing.assert_allclose(compositional_counts(caps, images_list), expect["counts"], rtol=1e-6)
    with pytest.raises(ValueError, match="score must be one of"):
        compositional_reward(score="all")
