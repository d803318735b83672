"""Tests that check meaning: equations, invariants of each method, exactness of the scorer, and a
measured improvement of a short real run. Run with `python -m pytest -q`."""
import collections
import dataclasses
import functools
import inspect
import io
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
import tokenize
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import flow_grpo_credit as fgc

os.environ["HF_HUB_OFFLINE"] = "1"  # no network: every model here is built and saved by the tests
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n auto: a worker a core, one thread each (no oversubscription),
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # also in the processes a test starts (notebook kernels, torchrun, the CLI)

HERE = Path(__file__).parent
SCRIPT = str(HERE / "flow_grpo_credit.py")


def notebook_module(name):
    """notebooks/NAME.py imported as a module: benchmark (speed and memory) or toy_base (the toy model's recipe)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, HERE / "notebooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_module():
    return notebook_module("benchmark")


toy_base = notebook_module("toy_base")
solutions = notebook_module("solutions")  # the notebooks' exercises solved, and the wrong answers they reject


# the notebooks, first: notebook 02 is the longest test, and `pytest -n auto` hands tests out in this order
# (solutions and helpers below, with the notebooks' other tests)
NOTEBOOKS = ["02_credit_assignment_side_by_side.ipynb", "01_flow_grpo_walkthrough.ipynb", "03_head_to_head.ipynb",
             "04_over_optimisation.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_checks_reject_the_stub_the_shortcut_and_wrong_answers_and_pass_when_solved(
        name, tmp_path, monkeypatch):
    if name.startswith("03"):  # on a copy of the committed records, so that its comparison.md and figures go there
        monkeypatch.setenv("FGC_COMPARISON", str(shutil.copytree(COMMITTED_RECORDS, tmp_path / "comparison")))
    if name.startswith("04"):  # likewise, its preference.md and figures
        monkeypatch.setenv("FGC_PREFERENCE", str(shutil.copytree(COMMITTED_PREFERENCE, tmp_path / "preference")))
    for exercise, solved_by in solutions.SOLUTIONS[name].items():  # every exercise: the shortcut and a wrong answer
        assert any(w.startswith("shortcut") for w in solved_by.wrong), f"{exercise}: no library shortcut to reject"
        assert any(not w.startswith("shortcut") for w in solved_by.wrong), f"{exercise}: no wrong answer to reject"
    before = {path: path.read_bytes() for path in (HERE / "assets").glob("*.png")}
    shipped, wrong, solved = run_notebook(name)
    assert not [path.name for path, data in before.items() if path.read_bytes() != data], "it redrew committed figures"
    assert all("✗" in out and "✓" not in out for out in shipped), shipped
    for (exercise, what), out in wrong.items():
        assert "✗" in out, f"{name} {exercise}: the check accepts {what}: {out}"
    assert all("✓" in out and "✗" not in out for out in solved), solved


# ----------------------------------------------------------------------------------------------------
# toy world


def circle(color):
    item = {"class": "circle", "count": 1, "color": color}
    return {"tag": "colors", "include": [item], "prompt": f"a {color} circle"}


def squares(n):
    words = {2: "two", 3: "three"}
    return {"tag": "counting", "include": [{"class": "square", "count": n}],
            "exclude": [{"class": "square", "count": n + 1}], "prompt": f"{words[n]} squares"}


def circle_of_square(relation):
    return {"tag": "position", "include": [{"class": "square", "count": 1},
                                           {"class": "circle", "count": 1, "position": [relation, 0]}],
            "prompt": f"a circle {relation} a square"}


def as_images(arrays) -> torch.Tensor:
    """(RES, RES, 3) arrays -> (N, 3, RES, RES) images, as the renderer and the models give them."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("name_colours", [False, True])
def test_scorer_is_exact_on_rendered_ground_truth(name_colours):
    """Rendered ground truth of every category passes GenEval's rule with full dense credit and holds
    exactly the objects asked for, so the strict rule passes and no object is extra."""
    rng = random.Random(0)
    metas = [fgc.make_prompt(tag, rng, name_colours) for tag in fgc.TAGS for _ in range(100)]
    scores = fgc.score_batch(toy_base.render_batch(metas, rng), metas)
    assert set(scores) == {"geneval", "dense", "strict", "extra", "missing"}
    assert all(s.shape == (len(metas),) and s.device.type == "cpu" for s in scores.values())
    assert scores["geneval"].min() == 1 and scores["dense"].min() == 1
    assert scores["strict"].min() == 1 and scores["extra"].max() == 0 and scores["missing"].max() == 0


def with_extra_shape(img: np.ndarray, meta: dict, rng: random.Random) -> np.ndarray | None:
    """`img` with one more shape, of a class the prompt does not name, drawn in a free spot that leaves a
    black pixel between it and every other shape; None if there is no such spot."""
    size, named = toy_base.SHAPE_SIZE, {item["class"] for item in meta["include"]}
    cls = rng.choice([c for c in fgc.CLASSES if c not in named])
    busy = img.sum(-1) > 0  # (RES, RES)
    span = range(fgc.RES - size + 1)
    free = [(x, y) for y in span for x in span
            if not busy[max(0, y - 1):y + size + 1, max(0, x - 1):x + size + 1].any()]
    if not free:
        return None
    x, y = rng.choice(free)
    out = img.copy()
    out[y:y + size, x:x + size][toy_base.SHAPE_MASKS[cls]] = fgc.COLORS[rng.choice(list(fgc.COLORS))]
    return out


def ground_truth_with_extras(per_tag: int, seed: int):
    """(metas, clean images, the same images with one extra shape each): `per_tag` prompts of every category."""
    rng = random.Random(seed)
    metas, clean, extra = [], [], []
    for tag in fgc.TAGS:
        for _ in range(50 * per_tag):  # a drawn image may have no free spot left; draw another
            if sum(m["tag"] == tag for m in metas) == per_tag:
                break
            meta = fgc.make_prompt(tag, rng)
            img = toy_base.render(meta, rng)
            more = with_extra_shape(img, meta, rng)
            if more is not None:
                metas.append(meta)
                clean.append(img)
                extra.append(more)
        assert sum(m["tag"] == tag for m in metas) == per_tag, f"no room for an extra shape in {tag} images"
    return metas, as_images(clean), as_images(extra)


def test_an_extra_object_fails_the_strict_rule_and_costs_only_the_strict_reward():
    """GenEval's rule accepts objects beyond those asked for; the strict rule and the default toy reward do
    not: one extra shape (of a class the prompt does not name, touching nothing) leaves GenEval's verdict
    and the dense score as they were, makes strict 0 and extra 1, and costs toy-strict the strict half of the
    reward plus the penalty."""
    metas, clean, extra = ground_truth_with_extras(per_tag=8, seed=3)
    a, b = fgc.score_batch(clean, metas), fgc.score_batch(extra, metas)
    assert a["geneval"].min() == 1 and a["strict"].min() == 1 and a["extra"].max() == 0
    assert torch.equal(b["geneval"], a["geneval"]) and torch.equal(b["dense"], a["dense"])
    assert b["strict"].max() == 0 and torch.equal(b["extra"], torch.ones(len(metas)))
    penalty = 0.3
    strict_clean, strict_extra = (fgc.toy_strict_reward(images, metas, penalty) for images in (clean, extra))
    assert (strict_clean > strict_extra).all()
    torch.testing.assert_close(strict_clean - strict_extra, torch.full((len(metas),), 0.5 + penalty))
    torch.testing.assert_close(fgc.toy_reward(extra, metas), fgc.toy_reward(clean, metas))  # GenEval's rule
    default = fgc.build_reward(fgc.Args(), torch.device("cpu"))  # the toy model's default reward is toy-strict
    assert fgc.resolved(fgc.Args()).reward == "toy-strict"
    assert (default(clean, metas) - default(extra, metas)).min() == pytest.approx(0.5 + fgc.Args().extra_penalty)
    geneval = fgc.build_reward(fgc.Args(reward="toy"), torch.device("cpu"))
    torch.testing.assert_close(geneval(extra, metas), geneval(clean, metas))
    for i in (0, 1):  # one image at a time: all asked for and found, one more object
        img = extra[i].permute(1, 2, 0).numpy()
        assert fgc.score_image(img, metas[i]) == {"geneval": 1.0, "dense": 1.0, "strict": 0.0, "extra": 1, "missing": 0}


def without_last_object(meta: dict) -> dict:
    """`meta` with its last asked object gone (a count one lower) and so no relation: a drawing of it misses one."""
    *kept, last = meta["include"]
    return {"include": kept + ([{"class": last["class"], "count": last["count"] - 1}] if last["count"] > 1 else [])}


@pytest.mark.parametrize("penalty", [0.05, 0.25, 1.0])
def test_the_default_reward_ranks_images_as_the_strict_rule_does(penalty):
    """toy-strict, for every category and count: a strictly correct image scores 1, above every other; an image
    that keeps every asked object and adds one (of another class, or one more of a counted class) scores above
    the same prompt drawn without one of its asked objects, whatever the penalty."""
    metas, clean, extra = ground_truth_with_extras(per_tag=8, seed=3)
    rng = random.Random(4)
    counted = [squares(n) for n in (2, 3)]
    metas += counted
    clean = torch.cat([clean, as_images([toy_base.render(m, rng) for m in counted])])
    one_more = [{"include": [{"class": "square", "count": m["include"][0]["count"] + 1}]} for m in counted]
    extra = torch.cat([extra, as_images([toy_base.render(m, rng) for m in one_more])])
    dropped = as_images([toy_base.render(without_last_object(m), rng) for m in metas])
    reward = functools.partial(fgc.toy_strict_reward, metas=metas, penalty=penalty)
    r_clean, r_extra, r_dropped = reward(clean), reward(extra), reward(dropped)
    assert fgc.score_batch(dropped, metas)["missing"].min() == 1
    assert r_clean.min() == 1 and r_extra.max() < 1 and r_dropped.max() < 1
    assert (r_extra > r_dropped).all(), [m["prompt"] for m, ok in zip(metas, r_extra > r_dropped) if not ok]


def test_the_base_s_flaw_draws_one_object_its_caption_does_not_name():
    """with_unnamed_object (toy_base), the pretraining flaw: one more object, of a class the prompt does not name, so
    the drawing still passes GenEval's rule for the caption but fails the strict rule with one extra object."""
    rng = random.Random(5)
    metas = [fgc.make_prompt(tag, rng) for tag in fgc.TAGS for _ in range(20)]
    drawn = [toy_base.with_unnamed_object(m, rng) for m in metas]
    for m, d in zip(metas, drawn):
        assert d["prompt"] == m["prompt"] and d["include"][:-1] == m["include"]
        assert d["include"][-1]["class"] not in {item["class"] for item in m["include"]}
    scores = fgc.score_batch(toy_base.render_batch(drawn, rng), metas)
    assert scores["geneval"].mean() > 0.95 and scores["strict"].max() == 0 and scores["extra"].mean() > 0.95


def test_detailed_captions_name_the_colours_they_draw():
    """A detailed pretraining caption names the colour of every object whose colour it fixes; the
    toy-GenEval prompts (name_colours=False) name colours only in the colour categories."""
    rng = random.Random(2)
    for tag in fgc.TAGS:
        plain, detailed = fgc.make_prompt(tag, random.Random(3)), fgc.make_prompt(tag, random.Random(3), True)
        for meta in (plain, detailed):
            colours = [item["color"] for item in meta["include"] if "color" in item]
            assert sorted(w for w in meta["prompt"].split() if w in fgc.COLORS) == sorted(colours)
        assert ("color" in plain["include"][0]) == (tag in ("colors", "color_attr"))
        assert ("color" in detailed["include"][0]) == (tag != "counting")
    share = np.mean(["color" in m["include"][0] for m in fgc.train_prompts(2000, rng, detailed=0.5)])
    assert abs(share - (2 / 6 + 0.5 * 3 / 6)) < 0.04  # colour tags always, 3 of the other 4 tags half the time


def test_scorer_rejects_images_of_other_prompts():
    """The scorer can fail: an image rendered for one prompt fails a conflicting prompt."""
    rng = random.Random(1)
    conflicts = [(circle("red"), circle("blue")), (squares(3), squares(2)), (squares(2), squares(3)),
                 (circle_of_square("left of"), circle_of_square("right of"))]
    for shown, asked in conflicts:
        scores = fgc.score_batch(toy_base.render_batch([shown] * 20, rng), [asked] * 20)
        assert scores["geneval"].max() == 0 and scores["strict"].max() == 0 and scores["dense"].max() < 1
    empty = torch.zeros(1, 3, fgc.RES, fgc.RES)
    scores = fgc.score_batch(empty, [circle("red")])
    assert {k: v.tolist() for k, v in scores.items()} == {"geneval": [0.0], "dense": [0.0], "strict": [0.0],
                                                          "extra": [0.0], "missing": [1.0]}


def test_prompts_follow_geneval_schema():
    for m in fgc.eval_prompts(4):
        assert m["tag"] in fgc.TAGS and m["include"] and isinstance(m["prompt"], str)
        assert all(set(item) <= {"class", "count", "color", "position"} for item in m["include"])
        tokens = toy_base.build_tokenizer()(m["prompt"]).input_ids
        assert 1 not in tokens, "every prompt word is in the vocabulary (1 = [UNK])"


class GroundTruthPolicy:
    """A stand-in policy whose ODE lands on given images: v = (x - x0) / t, so an Euler step to t = 0 ends
    exactly at x0. The i-th prompt it encodes gets the i-th target (in [-1, 1])."""

    passes = 1

    def __init__(self, metas: list[dict], targets: torch.Tensor):
        self.metas, self.targets, self.encoded, self.device = metas, targets, 0, torch.device("cpu")

    def encode(self, prompts, device=None):
        first, self.encoded = self.encoded, self.encoded + len(prompts)
        assert prompts == [m["prompt"] for m in self.metas[first:self.encoded]], "prompts are encoded in order"
        return {"x0": self.targets[first:self.encoded].to(device or self.device)}

    def velocity(self, x, t, cond):
        return (x - cond["x0"]) / t.view(-1, 1, 1, 1)

    def latent_shape(self, n):
        return (n, 3, fgc.RES, fgc.RES)

    def time_grid(self, steps):
        return fgc.shifted_grid(steps)

    def decode(self, x):
        return ((x + 1) / 2).clamp(0, 1)


def test_evaluate_reports_geneval_strict_and_extra_rates_per_category():
    """evaluate() on a policy that draws known images: ground truth (passes both rules), ground truth with
    an extra shape (passes GenEval's rule only) or a blank image (fails both). eval_overall and
    eval_strict are means of the six category accuracies, eval_extra (eval_missing) the fraction of images with an
    extra (a missing) object, eval_se the standard error of eval_overall; images come back on the CPU."""
    metas, clean, extra = ground_truth_with_extras(per_tag=4, seed=5)
    kind = [i % 4 for i in range(len(metas))]  # per category: 2 clean, 1 with an extra shape, 1 blank
    images = torch.stack([extra[i] if k == 2 else torch.zeros_like(clean[i]) if k == 3 else clean[i]
                          for i, k in enumerate(kind)])
    policy = GroundTruthPolicy(metas, images * 2 - 1)
    args = fgc.Args(eval_steps=3)
    metrics, out, out_metas, scores = fgc.evaluate(policy, args, metas=metas)
    assert out.device.type == "cpu" and out_metas == metas
    torch.testing.assert_close(out, images, atol=1e-5, rtol=0)
    per_tag = len(metas) // len(fgc.TAGS)
    p = (per_tag - per_tag // 4) / per_tag  # the blank quarter fails GenEval's rule
    assert metrics["eval_overall"] == pytest.approx(p)
    assert all(metrics[f"eval_{tag}"] == pytest.approx(p) for tag in fgc.TAGS)
    assert metrics["eval_strict"] == pytest.approx(0.5)
    assert metrics["eval_extra"] == pytest.approx(0.25) and metrics["eval_missing"] == pytest.approx(0.25)  # blanks
    assert metrics["eval_gold"] == pytest.approx(float(scores["gold"].mean()))
    assert metrics["eval_se"] == pytest.approx(math.sqrt(len(fgc.TAGS) * p * (1 - p) / per_tag) / len(fgc.TAGS))
    default = fgc.build_reward(args, torch.device("cpu"))  # no reward_fn: the run's reward, toy-strict here
    assert metrics["eval_reward"] == pytest.approx(float(default(images, metas).mean()))
    policy.encoded = 0
    metrics, *_ = fgc.evaluate(policy, dataclasses.replace(args, micro_batch=5), fgc.toy_reward, metas)
    assert policy.encoded == len(metas), "in micro-batches, every prompt once"
    assert metrics["eval_reward"] == pytest.approx(float(fgc.toy_reward(images, metas).mean()))
    assert set(scores) == {"geneval", "dense", "strict", "extra", "missing", "reward", "pair", "gold", "taste"}
    assert scores["pair"].tolist() == list(range(len(metas)))  # each image's number in the held-out set
    two = [i for i, m in enumerate(metas) if m["tag"] in ("counting", "position")]  # any subset of the categories
    sub = GroundTruthPolicy([metas[i] for i in two], images[two] * 2 - 1)
    metrics, *_ = fgc.evaluate(sub, args, metas=[metas[i] for i in two])
    assert metrics["eval_overall"] == pytest.approx(p) and "eval_colors" not in metrics


def test_paired_gain_and_its_standard_error_follow_the_category_structure():
    """by_category of per-image differences: the mean over categories of each category's mean difference, with
    s.e. sqrt(sum_c var_c / n_c) / C; a gain that is the same on every image has a paired s.e. of 0."""
    tags = ["a"] * 4 + ["b"] * 2
    before, after = torch.tensor([0, 0, 1, 1, 0, 1.0]), torch.tensor([1, 0, 1, 1, 1, 1.0])
    gain = fgc.paired_gains({"strict": after, "geneval": after}, {"strict": before, "geneval": before}, tags)
    d_a, d_b = torch.tensor([1, 0, 0, 0.0]), torch.tensor([1, 0.0])
    assert gain["gain_overall"] == pytest.approx((0.25 + 0.5) / 2) == gain["gain_strict"]
    se = math.sqrt(d_a.var(unbiased=False) / 4 + d_b.var(unbiased=False) / 2) / 2
    assert gain["gain_overall_se"] == pytest.approx(se)
    shifted = fgc.paired_gains({"reward": before + 0.1}, {"reward": before}, ["prompt"] * 6)
    assert shifted == pytest.approx({"gain_overall": 0.1, "gain_overall_se": 0.0}, abs=1e-7)


# ----------------------------------------------------------------------------------------------------
# SDE step, log-prob, KL, grids


@pytest.mark.parametrize("kind", list(fgc.SDE_LEVELS))
def test_sde_log_prob_is_normal_log_prob_mean_over_dims(kind):
    x, v = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    t, t_next = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.6, 0.4, 0.2])
    x_next, log_prob, mean, std = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7)
    expected = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(x_next).flatten(1).mean(1)
    assert log_prob.shape == (4,) and (std > 0).all()
    torch.testing.assert_close(log_prob, expected)
    rescored = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7, prev_sample=x_next)[1]
    torch.testing.assert_close(rescored, log_prob)


def test_cps_step_is_the_official_formula_with_the_full_gaussian_log_prob():
    """Flow-GRPO's sde_type='cps' (arXiv 2509.05952): std = t_next sin(a pi / 2) and
    mean = (1 - t_next) x0_hat + sqrt(t_next^2 - std^2) x1_hat, x0_hat = x - t v, x1_hat = x + (1 - t) v.
    The log-prob is the Gaussian log-density, mean over dimensions; the official code keeps only
    mean_d -(x' - mean)^2, so ours = official / (2 s^2) - log s - log(2 pi) / 2 (Deviation 10)."""
    gen = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(4, 3, 8, 8, generator=gen) for _ in range(3))
    t, t_next, a = torch.tensor([1.0, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.6, 0.4, 0.1]), 0.8

    def col(s):
        return s.view(-1, 1, 1, 1)

    std = t_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - col(t) * v, x + (1 - col(t)) * v
    mean = (1 - col(t_next)) * x0_hat + col((t_next**2 - std**2).sqrt()) * x1_hat
    x_next, log_prob, got_mean, got_std = fgc.sde_step(x, v, t, t_next, kind="cps", noise_level=a, noise=noise)
    torch.testing.assert_close(got_std, std)
    torch.testing.assert_close(got_mean, mean)
    torch.testing.assert_close(x_next, mean + col(std) * noise)
    normal = torch.distributions.Normal(mean, col(std)).log_prob(x_next).flatten(1).mean(1)
    torch.testing.assert_close(log_prob, normal)
    official = (-((x_next - mean) ** 2)).flatten(1).mean(1)
    torch.testing.assert_close(log_prob, official / (2 * std**2) - std.log() - 0.5 * math.log(2 * math.pi))
    rescored = fgc.sde_step(x, v, t, t_next, kind="cps", noise_level=a, prev_sample=x_next)[1]
    torch.testing.assert_close(rescored, log_prob)
    args = fgc.resolved(fgc.Args(sde="cps"))  # --noise-level 0 is the SDE's default: 0.8 for cps
    given = fgc.resolved(fgc.Args(sde="cps", noise_level=0.5))
    assert args.noise_level == fgc.SDE_LEVELS["cps"] and given.noise_level == 0.5
    grid = fgc.shifted_grid(6)
    torch.testing.assert_close(fgc.step_stds(grid, args), grid[1:] * math.sin(args.noise_level * math.pi / 2))
    assert fgc.trainable_steps(grid, args).tolist() == [True] * 4 + [False] * 2  # from t = 1 on; std 0.001 into t_5


def test_euler_with_true_velocity_lands_on_data_and_zero_noise_sde_is_ode():
    x0, x1 = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    grid = fgc.shifted_grid(7, shift=3.0)
    x = x1
    for t, t_next in itertools.pairwise(grid):
        x = fgc.ode_step(x, x1 - x0, t, t_next)
    torch.testing.assert_close(x, x0)
    v = torch.randn_like(x0)
    for kind in fgc.SDE_LEVELS:
        sde = fgc.sde_step(x1, v, 0.6, 0.4, kind=kind, noise_level=0.0)[0]
        torch.testing.assert_close(sde, fgc.ode_step(x1, v, 0.6, 0.4))


def test_flow_sde_std_matches_the_sd35_reference_table():
    """Transition stds of Flow-GRPO's SDE on the SD3.5 10-step grid (a = 0.7), and of
    the ddim SDE at its default eta (--noise-level 0: 1.0)."""
    grid = fgc.shifted_grid(10, shift=3.0)
    stds = fgc.step_stds(grid, fgc.Args(sde="flow", noise_level=0.7))
    table = [0.7000, 0.7430, 0.5362, 0.4459, 0.3918, 0.3528, 0.3191, 0.2820, 0.2254, 0.0063]
    np.testing.assert_allclose(stds.numpy(), table, atol=6e-4)
    ddim = fgc.resolved(fgc.Args(sde="ddim"))
    assert ddim.noise_level == fgc.SDE_LEVELS["ddim"] == 1.0
    table = [0, .1824, .2525, .2982, .3238, .3258, .2932, .2034, .0076, 0]
    np.testing.assert_allclose(fgc.step_stds(grid, ddim).numpy(), table, atol=6e-4)


def test_kl_is_exact_gaussian_kl_per_dimension():
    mean, mean_ref, std = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.tensor([0.3, 0.5, 0.9])
    p = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1))
    q = torch.distributions.Normal(mean_ref, std.view(-1, 1, 1, 1))
    expected = torch.distributions.kl_divergence(p, q).flatten(1).mean(1)
    torch.testing.assert_close(fgc.gaussian_kl(mean, mean_ref, std), expected)


# ----------------------------------------------------------------------------------------------------
# advantages and method identities on a tiny random policy (fast)


def ctx_for(method_args: dict, reward=None, b=2, seed=0):
    flags = {"steps": 6, "group_size": 4, "noises_per_prompt": 2, "tweedie_substeps": 2, **method_args}
    args = fgc.resolved(fgc.Args(**flags))
    policy = random_policy()
    metas = fgc.eval_prompts(1)[:b]
    grid = fgc.shifted_grid(args.steps)
    reward = reward or (lambda images, metas: images.mean((1, 2, 3)))
    ctx = fgc.Context(policy, args, fgc.Meter(), fgc.generator(seed), metas,
                      policy.encode([m["prompt"] for m in metas]), grid, reward)
    if args.method == "chunk":
        n_trained = int(ctx.trainable.sum())
        ctx.chunk_sizes = fgc.parse_chunks(args.chunks, n_trained) or [1] * n_trained
    return ctx


_POLICY = {}


def random_policy():
    if "p" not in _POLICY:
        unet, text_encoder = toy_base.build_toy_modules(seed=0)
        policy = fgc.ToyPolicy(unet.eval(), text_encoder.eval(), toy_base.build_tokenizer())
        fgc.add_lora(policy, fgc.Args())
        with torch.no_grad():  # a non-zero adapter so that reference and policy differ
            for name, p in policy.net.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        _POLICY["p"] = policy
    return _POLICY["p"]


def adapter_params(policy):
    return [p for p in policy.net.parameters() if p.requires_grad]


def test_kl_to_base_sums_each_trained_step_s_kl_as_the_flow_sde_s_mean_gives_it_and_is_zero_at_the_base():
    """kl_to_base, written here from the flow SDE's mean (Flow-GRPO Eq. 9): mu - mu_base = -dt (1 + sigma^2 (1 - t)
    / (2t)) (v - v_base), so KL_k = mean_d (mu - mu_base)^2 / (2 s_k^2), summed over the trainable steps; 0 with the
    adapter off."""
    ctx = ctx_for({})
    policy, args, n = ctx.policy, ctx.args, len(ctx.grid) - 1
    x = fgc.initial_noise(policy, 2, fgc.generator(5))
    traj = fgc.rollout(policy, ctx.cond, x, ctx.grid, [False] * n, args, fgc.Meter())
    expected = torch.zeros(2)
    with torch.no_grad():
        for k in fgc.trainable_steps(ctx.grid, args).nonzero().flatten().tolist():
            t, dt, state = float(ctx.grid[k]), float(ctx.grid[k] - ctx.grid[k + 1]), traj.states[:, k]
            sigma2 = args.noise_level**2 * t / (1 - (t if t < 1 else float(ctx.grid[k + 1])))  # t_next at t = 1
            with fgc.adapter_disabled(policy.net):
                v_base = policy.velocity(state, ctx.grid[k].expand(2), ctx.cond)
            gap = dt * (1 + sigma2 * (1 - t) / (2 * t)) * (traj.velocities[:, k] - v_base)
            expected += (gap**2).flatten(1).mean(1) / (2 * sigma2 * dt)
        measured = fgc.kl_to_base(policy, ctx.cond, traj, args)
        assert expected.min() > 0
        torch.testing.assert_close(measured, expected, rtol=1e-4, atol=0)
        lora_b = [p for name, p in policy.net.named_parameters() if "lora_B" in name]
        kept = [p.clone() for p in lora_b]
        try:  # an adapter of zeros is the base
            for p in lora_b:
                p.zero_()
            base_traj = fgc.rollout(policy, ctx.cond, x, ctx.grid, [False] * n, args, fgc.Meter())
            assert fgc.kl_to_base(policy, ctx.cond, base_traj, args).abs().max() == 0
        finally:
            for p, value in zip(lora_b, kept):
                p.copy_(value)


def test_group_advantages_are_standardised_and_zero_variance_groups_are_zero():
    ctx = ctx_for({})
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    adv = ctx.advantages(r, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert abs(adv[:4].mean()) < 1e-6 and abs(adv[:4].std(unbiased=False) - 1) < 1e-3
    assert torch.equal(adv[4:], torch.zeros(4)) and torch.cat(ctx.stats["zero_std"]).tolist() == [False, True]
    ctx.advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), torch.tensor([3, 3, 7, 7]))  # one entry per call
    assert [z.tolist() for z in ctx.stats["zero_std"]] == [[False, True], [True, False]]


def test_a_group_of_equal_rewards_of_one_third_gets_advantage_exactly_zero():
    """Eight rewards of 1/3 (a counting prompt's partial credit): float32's running mean leaves a std of ~3e-8,
    which would give every member +3e-4 and train the group with one sign; group_normalise gives exactly 0."""
    r = torch.full((8,), 1 / 3)
    assert fgc.segment_mean((r - fgc.segment_mean(r, torch.zeros(8))[0]) ** 2, torch.zeros(8))[0].item() > 0
    adv, flat = fgc.group_normalise(torch.cat([r, torch.arange(8.0)]), torch.tensor([0] * 8 + [1] * 8))
    assert torch.equal(adv[:8], torch.zeros(8)) and flat.tolist() == [True, False]
    assert abs(adv[8:].std(unbiased=False) - 1) < 1e-3 and adv.dtype == torch.float32


def test_stepwise_advantages_telescope_to_the_normalised_final_reward():
    """Stepwise's telescoping gains: with shared initial noise (r[:, 0] equal in a group), each trajectory's
    jointly normalised gains sum to (r_final - group mean) / sigma_glob."""
    ctx = ctx_for({"method": "stepwise"})
    g, s = 4, 6
    r = torch.rand(2 * g, s + 1)
    r[:g, 0], r[g:, 0] = 0.3, 0.7
    prompt = fgc.repeat_each(torch.arange(2), g)
    adv = fgc.gain_advantages(ctx, r, prompt)
    gains = r[:, 1:] - r[:, :-1]
    sigma = torch.stack([gains[:g].std(unbiased=False), gains[g:].std(unbiased=False)])
    final = r[:, -1].view(2, g)
    expected = ((final - final.mean(1, keepdim=True)) / (sigma[:, None] + 1e-4)).flatten()
    torch.testing.assert_close(adv.sum(1), expected, atol=1e-4, rtol=1e-4)


def test_stepwise_shares_noise_within_a_group_and_trains_each_step():
    ctx = ctx_for({"method": "stepwise"})
    tr, _ = fgc.stepwise(ctx)
    first = tr[tr.step == 0]
    assert torch.equal(first.x[0], first.x[3]) and not torch.equal(first.x[0], first.x[4])
    assert sorted(torch.unique(tr.step).tolist()) == list(range(5))  # steps 0..S-2


def test_stepwise_credits_each_step_with_the_normalised_gain_of_its_states_tweedie_rewards():
    """Each trained transition's advantage is the gain r[i, k+1] - r[i, k] of the rewards of x0_hat of its trajectory's
    states (n Euler steps to t = 0; the last state is the image itself), normalised jointly over each prompt's
    (trajectory, step) pairs with the population std + 1e-4: written out here from the paper's formulas."""
    ctx = ctx_for({"method": "stepwise"})
    trajectories, sample = [], ctx.sample

    def kept(*args, **kwargs):  # the first rollout is the sampled trajectories; the others are Tweedie's ODEs
        trajectories.append(sample(*args, **kwargs))
        return trajectories[-1]

    ctx.sample = kept
    tr, _ = fgc.stepwise(ctx)
    traj, policy, n, (b, g, s) = trajectories[0], ctx.policy, ctx.args.tweedie_substeps, (2, 4, 6)
    prompt = fgc.repeat_each(torch.arange(b), g)
    cond = {k: e[prompt] for k, e in ctx.cond.items()}
    r = torch.zeros(b * g, s + 1)  # the reward of every state's x0_hat, k = 0..S
    with torch.no_grad():
        for k in range(s):
            x, t = traj.states[:, k], traj.times[:, k]
            for j in range(n):  # Euler from t to 0 in n equal steps
                t_j, t_next = t * (1 - j / n), t * (1 - (j + 1) / n)
                x = x + (t_next - t_j).view(-1, 1, 1, 1) * policy.velocity(x, t_j, cond)
            r[:, k] = policy.decode(x).mean((1, 2, 3))
        r[:, s] = policy.decode(traj.states[:, -1]).mean((1, 2, 3))
    gains, expected = r[:, 1:] - r[:, :-1], torch.zeros(b * g, s)
    for p in range(b):
        mine = gains[prompt == p]
        expected[prompt == p] = (mine - mine.mean()) / (mine.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(tr.advantage.view(b * g, -1), expected[:, :s - 1], rtol=1e-3, atol=1e-3)


def test_stepwise_tweedie_estimate_is_the_ode_from_the_state_with_its_first_step_free():
    """x0_hat(x_k) by n sub-steps equals an n-step ODE rollout from x_k that computes every velocity,
    while costing n - 1 passes per state (the first velocity is the sampler's); the group's shared start
    is refined once per group. A stepwise iteration costs B*G*S + (n-1)*(B*G*(S-1) + B) passes."""
    ctx = ctx_for({"method": "stepwise"})
    b, g, s, n = 2, 4, 6, ctx.args.tweedie_substeps
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, [True] * s)
    x, v, t = traj.states[:, 2], traj.velocities[:, 2], traj.times[:, 2]
    before = ctx.meter.nfe
    x0_hat = fgc.x0_estimate(ctx, prompt, x, v, t, n)
    assert ctx.meter.nfe - before == (n - 1) * b * g
    full = ctx.sample(prompt, x, t[:, None] * torch.linspace(1, 0, n + 1), [False] * n).states[:, -1]
    torch.testing.assert_close(x0_hat, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fgc.x0_estimate(ctx, prompt, x, v, t, 1), x - t[:, None, None, None] * v)
    ctx = ctx_for({"method": "stepwise"})
    fgc.stepwise(ctx)
    assert ctx.meter.nfe == b * g * s + (n - 1) * (b * g * (s - 1) + b)
    assert ctx.meter.images_scored == b * g * s + b


def test_tempflow_weights_average_one_and_advantages_are_zero_mean_per_seed_and_step():
    ctx = ctx_for({"method": "tempflow", "branch_steps": 0})
    tr, _ = fgc.tempflow(ctx)
    steps = torch.unique(tr.step)
    weights = torch.stack([tr.weight[tr.step == k][0] for k in steps])
    t, t_next = ctx.grid[:-1], ctx.grid[1:]  # Eq. 7's Norm(sigma_t sqrt(dt)), the flow SDE's a = 1 written out
    s = (t / (1 - torch.where(t >= 1, t_next, t))).sqrt() * (t - t_next).sqrt()
    torch.testing.assert_close(weights, s[steps] / s[steps].mean())  # mean 1 over the trained steps
    assert weights[0] > weights[-1]  # noisier steps weigh more
    blocks = tr.advantage.view(-1, ctx.args.group_size)  # G branches of one (prompt, seed, k)
    assert blocks.sum(1).abs().max() < 1e-3 * blocks.abs().max()
    x = tr.x.view(-1, ctx.args.group_size, *tr.x.shape[1:])
    assert (x - x[:, :1]).abs().max() == 0, "children of one (prompt, seed, k) start from the same ODE state"


def test_g2rpo_branches_share_the_ode_anchor_and_single_granularity_is_singular_sampling():
    ctx = ctx_for({"method": "g2rpo", "granularities": "1", "branch_steps": 0})
    tr, _ = fgc.g2rpo(ctx)
    noise = fgc.initial_noise(ctx.policy, 2, fgc.generator(0))  # the same first draw as the method's
    anchor = fgc.rollout(ctx.policy, ctx.cond, noise, ctx.grid, [False] * 6, ctx.args, fgc.Meter())
    for k in torch.unique(tr.step).tolist():
        expected = anchor.states[:, k].repeat_interleave(ctx.args.group_size, 0)  # (B*G, C, H, W)
        torch.testing.assert_close(tr[tr.step == k].x, expected)
    assert sorted(torch.unique(tr.step).tolist()) == [0, 1, 2]  # first half of the 6 steps
    for k in range(5):  # lambda = 1 continues on the base grid: singular stochastic sampling
        torch.testing.assert_close(fgc.continuation_grid(ctx.grid, k + 1, 1), ctx.grid[k + 1:])


def test_g2rpo_sums_one_group_z_score_per_granularity_and_logs_the_finest_images_reward():
    """Multi-granularity advantage integration: with the same draws, the fused advantage of Lambda = {2, 1} is the
    advantage of {1} plus that of {2}, each a unit-variance z-score of its group (so the logged adv_abs/k is up to
    |Lambda| times another method's); the rewards logged are those of the finest (lambda = 1) images alone; every
    step of the first half branches, as in G2RPO's code, whatever TempFlow's `branch_steps`."""
    def run(granularities):  # a reward whose spread dwarfs the normaliser's 1e-4
        ctx = ctx_for({"method": "g2rpo", "granularities": granularities, "branch_steps": 1},
                      reward=lambda images, metas: 1e3 * images.mean((1, 2, 3)))
        return fgc.g2rpo(ctx)

    (fine, fine_r), (coarse, coarse_r), (fused, fused_r) = run("1"), run("2"), run("2,1")
    assert torch.unique(fused.step).tolist() == [0, 1, 2]  # the first half of the 6 steps
    torch.testing.assert_close(fused.advantage, fine.advantage + coarse.advantage)
    torch.testing.assert_close(fused_r, fine_r)
    assert not torch.allclose(coarse_r, fine_r)  # the coarse continuation ends in another image
    for tr in (fine, coarse):  # per (prompt, k): a z-score of population std 1 over the group's 4 branches
        blocks = tr.advantage.view(-1, 4).double()
        torch.testing.assert_close(blocks.pow(2).mean(1), torch.ones(len(blocks), dtype=torch.double), atol=1e-3,
                                   rtol=0)


def test_paper_chunks_scale_the_papers_2_3_4_7_of_16_steps_to_the_trained_steps():
    assert fgc.parse_chunks("paper", 16) == [2, 3, 4, 7]  # Chunk-GRPO's and GCPO's 16 trained steps
    assert fgc.parse_chunks("paper", 9) == [1, 2, 2, 4]  # the toy's 9: boundaries round(9 * {2, 5, 9, 16} / 16)
    for n in range(1, 33):
        sizes = fgc.parse_chunks("paper", n)
        assert sum(sizes) == n and min(sizes) >= 1 and sizes == sorted(sizes) and len(sizes) <= 4
    with pytest.raises(fgc.UsageError, match=r"2,3,4 \(or auto or paper\), got .papers."):
        fgc.parse_chunks("papers", 9)


@pytest.mark.parametrize("start,lam,nodes", [
    (1, 1, list(range(1, 17))), (1, 2, [1, 2, 4, 6, 8, 10, 12, 14, 16]), (1, 3, [1, 2, 5, 8, 11, 14, 16]),
    (8, 3, [8, 9, 12, 15, 16]), (14, 3, [14, 15, 16]), (15, 2, [15, 16])])
def test_g2rpo_continuations_keep_the_first_base_step_then_every_lambda_th_node_and_end_at_zero(start, lam, nodes):
    """G2RPO's code: t_{k+1} (the SDE step's end), t_{k+2}, then every lambda-th node from there; t = 0 added where
    the stride stops short of it (Deviation 8). Nodes of a 16-step grid, written out by hand."""
    grid = fgc.shifted_grid(16, shift=3.0)
    torch.testing.assert_close(fgc.continuation_grid(grid, start, lam), grid[nodes])


def test_chunk_ratio_is_step_ratio_for_size_one_and_sequence_ratio_for_one_chunk():
    log_new, log_old = torch.randn(6) * 1e-3, torch.randn(6) * 1e-3
    step_log_ratio = log_new - log_old
    per_step = fgc.chunk_log_ratios(log_new, log_old, torch.arange(6))
    torch.testing.assert_close(per_step, step_log_ratio)
    one = fgc.chunk_log_ratios(log_new, log_old, torch.zeros(6, dtype=torch.long))
    torch.testing.assert_close(one, step_log_ratio.mean()[None])
    two = fgc.chunk_log_ratios(log_new, log_old, torch.tensor([0, 0, 1, 1, 1, 0]))
    torch.testing.assert_close(two, torch.stack([step_log_ratio[[0, 1, 5]].mean(), step_log_ratio[2:5].mean()]))


def test_chunk_method_assigns_chunk_ids_by_sizes_and_samples_a_fraction():
    ctx = ctx_for({"method": "chunk", "chunks": "2,3"})
    tr, _ = fgc.chunk(ctx)
    first = tr.chunk_id[: 5]  # trajectory 0, steps 0..4
    assert first[0] == first[1] != first[2] == first[3] == first[4]
    ctx = ctx_for({"method": "chunk", "chunks": "1,1,3", "chunk_fraction": 0.34, "weighted_chunks": True})
    tr, _ = fgc.chunk(ctx)
    per_traj = [torch.unique(tr.chunk_id[tr.chunk_id // 3 == i]).tolist() for i in range(8)]
    assert [len(ids) for ids in per_traj] == [1] * 8, "one chunk a trajectory"
    sizes = [1, 1, 3]  # a chosen chunk trains whole: all its steps, consecutive
    for (c,) in per_traj:
        steps = tr.step[tr.chunk_id == c].tolist()
        assert steps == list(range(sum(sizes[:c % 3]), sum(sizes[:c % 3 + 1]))), (c, steps)


def test_weighted_chunks_are_drawn_in_proportion_to_their_relative_l1(monkeypatch):
    """--weighted-chunks draws a trajectory's trained chunk with probability proportional to the chunk's mean
    relative L1 (here 1, 1 and 3: shares 0.2, 0.2 and 0.6); without it, uniformly. 192 trajectories: a share's
    s.e. is about 0.035."""
    rel = torch.tensor([1.0, 1.0, 3.0, 3.0, 3.0, 9.0])  # (S,) a step's relative L1; the last step is not trained
    monkeypatch.setattr(fgc, "relative_l1", lambda states: rel.expand(len(states), -1))
    for weighted, expected in [(True, [0.2, 0.2, 0.6]), (False, [1 / 3] * 3)]:
        ctx = ctx_for({"method": "chunk", "chunks": "1,1,3", "chunk_fraction": 0.34, "weighted_chunks": weighted,
                       "group_size": 32}, b=6)
        chosen = torch.unique(fgc.chunk(ctx)[0].chunk_id) % 3  # (192,) one chunk a trajectory, ids 3i + chunk
        assert len(chosen) == 6 * 32
        share = torch.bincount(chosen, minlength=3) / len(chosen)
        torch.testing.assert_close(share, torch.tensor(expected), atol=0.1, rtol=0)


def test_auto_chunks_split_the_profile_s_change_equally_so_fast_steps_get_small_chunks():
    """Worked out by hand. The profile's change a step, the first step taking the second's, is
    .3 .3 .3 0 0 0 0 .3 0 0 0 .3 (of 1.5): cumulative shares .2 .4 .6 .6 .6 .6 .6 .8 .8 .8 .8 1. Chunk j of 4 ends
    after the first step whose share reaches j/4 (steps 1, 2 and 7): sizes 2, 1, 5, 4. When all the change is one
    step's (step 4), every boundary falls there, and each later chunk still gets a step: 5, 1, 2."""
    profile = torch.tensor([1.0, 0.7, 0.4, 0.4, 0.4, 0.4, 0.4, 0.1, 0.1, 0.1, 0.1, 0.4])
    assert fgc.chunks_from_profile(profile, 4) == [2, 1, 5, 4]
    one_jump = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2])
    assert fgc.chunks_from_profile(one_jump, 3) == [5, 1, 2] and fgc.chunks_from_profile(one_jump, 2) == [5, 3]


@pytest.mark.parametrize("sde", ["flow", "cps"])
@pytest.mark.parametrize("method", list(fgc.METHODS))
def test_first_inner_step_is_on_policy_for_every_method(method, sde):
    """One iteration of every method under each SDE kind: finite transitions with their ids on the CPU,
    and an update whose first minibatch is exactly on-policy (ratio 1) with a KL to the reference; a
    quarter of the transitions is trained, to keep the test short."""
    ctx = ctx_for({"method": method, "beta": 0.01, "branch_steps": 2, "sde": sde, "inner_updates": 2,
                   "train_fraction": 0.25})
    tr, rewards = fgc.METHODS[method].assign(ctx)
    assert len(tr) > 0 and torch.isfinite(tr.advantage).all() and torch.isfinite(rewards).all()
    assert all(getattr(tr, f).device.type == "cpu" and getattr(tr, f).dtype == torch.long
               for f in ("prompt", "chunk_id", "step"))
    params = adapter_params(ctx.policy)
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    try:
        stats = fgc.update(ctx.policy, opt, ctx.cond, tr, ctx.args, fgc.generator(1))
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    assert abs(stats["ratio_first"] - 1) < 1e-5 and stats["clipfrac_first"] == 0
    assert stats["kl"] > 0, "the adapter is non-zero, so the reference differs"
    children = ctx.args.group_size if method in ("tempflow", "g2rpo") else 1  # a unit: a chunk, or a state's children
    units = int((tr.advantage != 0).sum()) // children
    assert stats["trained"] == max(1, round(units * 0.25)) * children, "one transition a chunk, G a branch point"


def test_toy_cfg_is_the_guided_combination_of_two_passes():
    """With --guidance w, v = v_uncond + w (v_cond - v_uncond), the unconditional branch from the empty
    prompt and without gradient, and a denoising step costs two forward passes."""
    base = random_policy()
    policy = fgc.ToyPolicy(base.net, base.text_encoder, base.tokenizer, guidance=3.0)
    x, t = torch.randn(2, 3, fgc.RES, fgc.RES), torch.tensor([0.8, 0.3])
    cond = policy.encode(["a red circle", "two squares"])
    with torch.no_grad():
        v_cond = policy.forward(x, t, cond)
        v_uncond = policy.forward(x, t, {k: e.expand(2, -1, -1) for k, e in policy.encode([""]).items()})
    v = policy.velocity(x, t, cond)
    torch.testing.assert_close(v, v_uncond + 3.0 * (v_cond - v_uncond))
    assert policy.passes == 2 and base.passes == 1
    assert policy.velocity(x, t, cond).requires_grad, "the conditional branch keeps its gradient"


def test_nfe_counts_every_forward_pass():
    ctx = ctx_for({"method": "g2rpo", "granularities": "1,2", "branch_steps": 0})
    fgc.g2rpo(ctx)
    # anchor 6 steps x 2 prompts; k in {0,1,2}: 8 branches x ((5-k) + coarse lambda=2 steps); the SDE step at k takes
    # the anchor's velocity, free
    coarse = sum(len(fgc.continuation_grid(ctx.grid, k + 1, 2)) - 1 for k in range(3))
    assert ctx.meter.nfe == 12 + 8 * ((5 + 4 + 3) + coarse)
    assert ctx.meter.images_scored == 8 * 3 * 2


@pytest.mark.parametrize("method", ["tempflow", "g2rpo"])
def test_a_branch_point_s_children_share_its_velocity_and_one_forward_pass_with_the_per_child_gradient(
        method, monkeypatch):
    """The children of a branch point start from one (state, time, prompt). Sampling takes the velocity their path
    already holds, and draws the same children as a pass of their own would. Training runs one forward pass a
    state, and its gradient is the per-child computation's; `nfe` counts the passes computed."""
    flags = {"method": method, "branch_steps": 2, "beta": 0.5, "adv_clip": 1.0}
    ctx = ctx_for(flags)
    tr, rewards = fgc.METHODS[method].assign(ctx)
    real_sample = fgc.Context.sample
    monkeypatch.setattr(fgc.Context, "sample", lambda self, *a: real_sample(self, *a[:4]))  # every velocity anew
    recomputed = ctx_for(flags)
    tr_anew, rewards_anew = fgc.METHODS[method].assign(recomputed)
    torch.testing.assert_close(tr_anew.x_next, tr.x_next, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rewards_anew, rewards, rtol=1e-4, atol=1e-5)
    assert recomputed.meter.nfe - ctx.meter.nfe == len(tr), "a pass saved a child (one trained step each)"
    g = ctx.args.group_size
    children = tr.state_id.view(-1, g)  # (states, G): a branch point's G children, one after another
    assert len(torch.unique(tr.state_id)) == len(children) and torch.equal(children, children[:, :1].expand(-1, g))
    shift = (torch.rand(len(tr), generator=torch.Generator().manual_seed(0)) * 4 - 2) * ctx.args.clip_range
    tr = dataclasses.replace(tr, log_prob=tr.log_prob + shift)  # ratios astride the clip
    rows, real_forward = [], ctx.policy.forward
    monkeypatch.setattr(ctx.policy, "forward", lambda x, *a: rows.append(len(x)) or real_forward(x, *a))
    params = adapter_params(ctx.policy)

    def gradient(transitions):
        for p in params:
            p.grad = None
        meter = fgc.Meter()
        fgc.accumulate_gradients(ctx.policy, ctx.cond, transitions, ctx.args, meter)
        return torch.cat([p.grad.flatten() for p in params]), meter.nfe

    (shared, nfe_shared), n_shared = gradient(tr), sum(rows)
    per_child, nfe_per_child = gradient(dataclasses.replace(tr, state_id=torch.arange(len(tr))))
    torch.testing.assert_close(shared, per_child, rtol=1e-4, atol=1e-5 * float(per_child.abs().max()))
    assert n_shared == 2 * len(tr) // g and sum(rows) - n_shared == 2 * len(tr), "a pass a state (and the reference's)"
    assert (nfe_shared, nfe_per_child) == (n_shared, 2 * len(tr))
    for p in params:
        p.grad = None


def test_train_fraction_and_branch_steps_subsample_what_is_trained(monkeypatch):
    ctx = ctx_for({"train_fraction": 0.5, "inner_updates": 2})
    tr, _ = fgc.flow_grpo(ctx)
    seen, real = [], fgc.grpo_loss

    def spy(policy, cond, mb, *rest):
        seen.append(len(mb))
        return real(policy, cond, mb, *rest)

    monkeypatch.setattr(fgc, "grpo_loss", spy)
    params = adapter_params(ctx.policy)  # lr 0: the shared test policy stays as it is
    fgc.update(ctx.policy, torch.optim.SGD(params, lr=0.0), ctx.cond, tr, ctx.args, fgc.generator(2))
    assert len(seen) == 2 and sum(seen) == round(len(tr) * 0.5)
    tr, _ = fgc.tempflow(ctx_for({"method": "tempflow", "branch_steps": 2}))
    assert len(torch.unique(tr.step)) == 2


def test_transitions_of_groups_with_equal_rewards_are_left_out_of_the_loss(monkeypatch):
    """A group whose rewards are all equal gets advantage 0 and teaches nothing: update() drops its
    transitions before any loss (Flow-GRPO's filter), and returns {} when nothing is left."""
    def second_prompt_flat(images, metas):  # every member of the second prompt's group gets 0.5
        flat = torch.tensor([m["prompt"] == second for m in metas])
        return torch.where(flat, torch.full((len(images),), 0.5), images.mean((1, 2, 3)))

    second = fgc.eval_prompts(1)[1]["prompt"]
    ctx = ctx_for({"inner_updates": 2}, reward=second_prompt_flat)
    tr, _ = fgc.flow_grpo(ctx)
    zero = tr.advantage == 0
    assert torch.equal(zero, tr.prompt == 1) and zero.any() and not zero.all()
    assert torch.cat(ctx.stats["zero_std"]).tolist() == [False, True]
    seen, real = [], fgc.grpo_loss

    def spy(policy, cond, mb, *rest):
        seen.append(mb.prompt)
        return real(policy, cond, mb, *rest)

    monkeypatch.setattr(fgc, "grpo_loss", spy)
    params = adapter_params(ctx.policy)
    stats = fgc.update(ctx.policy, torch.optim.SGD(params, lr=0.0), ctx.cond, tr, ctx.args, fgc.generator(3))
    trained = torch.cat(seen)
    assert len(trained) == stats["trained"] == int((~zero).sum()) and (trained == 0).all()
    seen.clear()
    flat = ctx_for({}, reward=lambda images, metas: torch.ones(len(images)))
    tr, _ = fgc.flow_grpo(flat)
    assert fgc.update(flat.policy, torch.optim.SGD(params, lr=0.0), flat.cond, tr, flat.args, fgc.generator(3)) == {}
    assert not seen


@pytest.mark.parametrize("method_args", [{}, {"method": "chunk", "chunks": "2,3"}], ids=["steps", "chunks"])
def test_micro_batches_bound_every_pass_and_add_up_to_the_minibatch_gradient(method_args, monkeypatch):
    """accumulate_gradients in pieces of `micro_batch` transitions gives the gradient of the whole minibatch
    (KL term included). A piece never splits a chunk: it is closed only when the next chunk does not fit, and no
    forward pass of the model holds more than `micro_batch` transitions or, where one chunk is longer, that chunk."""
    ctx = ctx_for({**method_args, "beta": 0.05}, b=1)
    tr, _ = fgc.METHODS[ctx.args.method].assign(ctx)
    chunk_sizes = torch.unique(tr.chunk_id, return_counts=True)[1]
    assert (chunk_sizes.max() > 1) == bool(method_args)
    params, passes, velocity = adapter_params(ctx.policy), [], ctx.policy.velocity
    monkeypatch.setattr(ctx.policy, "velocity", lambda x, *a: passes.append(len(x)) or velocity(x, *a))
    pieces, real_loss = [], fgc.grpo_loss
    monkeypatch.setattr(fgc, "grpo_loss", lambda policy, cond, piece, *a: pieces.append(piece.chunk_id)
                        or real_loss(policy, cond, piece, *a))

    def gradients(micro_batch):
        for p in params:
            p.grad = None
        passes.clear()
        pieces.clear()
        args = dataclasses.replace(ctx.args, micro_batch=micro_batch)
        stats = fgc.accumulate_gradients(ctx.policy, ctx.cond, tr, args)
        return [p.grad.clone() for p in params], stats

    whole, whole_stats = gradients(len(tr))  # one piece
    assert len(whole_stats) == 1 and passes == [len(tr)] * 2, "one pass and its reference pass"
    scale = max(g.abs().max() for g in whole)
    assert scale > 0
    for size in (1, 2, 3, 7):
        parts, parts_stats = gradients(size)
        largest = max(size, int(chunk_sizes.max()))
        assert len(parts_stats) == len(pieces) > 1
        assert max(passes) <= largest and all(len(piece) <= largest for piece in pieces)
        assert sorted(torch.cat(pieces).tolist()) == sorted(tr.chunk_id.tolist()), "each transition once"
        assert len(torch.unique(torch.cat([piece.unique() for piece in pieces]))) == len(chunk_sizes), "chunks whole"
        assert all(len(a) + int((tr.chunk_id == b[0]).sum()) > size for a, b in zip(pieces, pieces[1:])), "filled"
        if not method_args:
            assert len(pieces) == math.ceil(len(tr) / size)
        for a, b in zip(whole, parts):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)
    for p in params:
        p.grad = None


def stated_objective(policy, cond, tr, args):
    """The loss as the docstrings state it, written here from the formulas: the flow SDE's mean (Flow-GRPO Eq. 9)
    of the guided velocity (its unconditional branch constant), log-probs by torch.distributions, a ratio a chunk,
    mean_j w_j max(-A_j rho_j, -A_j clip(rho_j)) with A_j clamped, + beta mean_k KL(N(mu, s) || N(mu_ref, s));
    -> (objective, the stated stats: policy_loss the chunks' mean term, approx_kl 1/2 mean_j log(rho_j)^2)."""
    def col(values):
        return values.view(-1, 1, 1, 1)

    def mean_of(v):
        t, t_next, x, a = col(tr.t), col(tr.t_next), tr.x, args.noise_level
        sigma = a * (t / (1 - torch.where(t >= 1, t_next, t))).sqrt()
        return x - (t - t_next) * (v + sigma**2 / (2 * t) * (x + (1 - t) * v))

    def velocity():
        c = {k: e[tr.prompt] for k, e in cond.items()}
        v = policy.forward(tr.x, tr.t, c)
        if policy.cfg == 1.0:
            return v
        empty = {k: e.expand(len(tr), *e.shape[1:]) for k, e in policy.empty.items()}
        v_uncond = policy.forward(tr.x, tr.t, empty).detach()
        return v_uncond + policy.cfg * (v - v_uncond)

    mean, std = mean_of(velocity()), col(tr.std)
    log_prob = torch.distributions.Normal(mean, std).log_prob(tr.x_next).flatten(1).mean(1)
    ids = torch.unique(tr.chunk_id).tolist()
    terms, log_ratios = [], []
    for j in ids:
        member = tr.chunk_id == j
        log_ratios.append((log_prob[member] - tr.log_prob[member]).mean())
        ratio = torch.exp(log_ratios[-1])
        adv = tr.advantage[member][0].clamp(-args.adv_clip, args.adv_clip)
        clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
        terms.append(tr.weight[member][0] * torch.maximum(-adv * ratio, -adv * clipped))
    policy_loss = torch.stack(terms).mean()  # the mean over chunks
    objective = policy_loss
    if args.beta > 0:
        with torch.no_grad(), fgc.adapter_disabled(policy.net):
            mean_ref = mean_of(velocity())
        kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                               torch.distributions.Normal(mean_ref, std)).flatten(1).mean(1)
        objective = objective + args.beta * kl.mean()
    stats = {"policy_loss": policy_loss, "approx_kl": 0.5 * torch.stack(log_ratios).pow(2).mean()}
    return objective, {k: v.detach() for k, v in stats.items()}


GRADIENT_CASES = {  # mechanism -> (method flags, what must hold of the transitions for the case to test something)
    "surrogate, clip and advantage clip": {"adv_clip": 1.0},
    "step weights": {"method": "tempflow", "branch_steps": 2},
    "chunk ratios in micro-batches": {"method": "chunk", "chunks": "2,3", "micro_batch": 3},
    "KL": {"beta": 0.5},
    "CFG's detached branch": {"guidance": 3.0},
}


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_the_gradient_applied_is_the_stated_objective_s(case):
    """accumulate_gradients' gradient equals autograd's gradient of stated_objective, written independently above,
    on transitions whose ratios straddle the clip (old log-probs moved by up to 2 eps) and whose advantages pass the
    clamp; each case's mechanism is shown to move the gradient, so a path that no longer matches fails here."""
    flags = GRADIENT_CASES[case]
    ctx = ctx_for({k: v for k, v in flags.items() if k != "guidance"}, b=2)
    if "guidance" in flags:
        base = ctx.policy
        ctx.policy = fgc.ToyPolicy(base.net, base.text_encoder, base.tokenizer, guidance=flags["guidance"])
    tr, _ = fgc.METHODS[ctx.args.method].assign(ctx)
    shift = (torch.rand(len(tr), generator=torch.Generator().manual_seed(0)) * 4 - 2) * ctx.args.clip_range
    tr = dataclasses.replace(tr, log_prob=tr.log_prob + shift, advantage=tr.advantage * 1.5)
    params = adapter_params(ctx.policy)

    def gradient(fn, args):
        for p in params:
            p.grad = None
        fn(args)
        return torch.cat([p.grad.flatten() for p in params])

    def code(args):
        fgc.accumulate_gradients(ctx.policy, ctx.cond, tr, args)

    def stated(args):
        stated_objective(ctx.policy, ctx.cond, tr, args)[0].backward()

    got, expected = gradient(code, ctx.args), gradient(stated, ctx.args)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    _, stats = fgc.grpo_loss(ctx.policy, ctx.cond, tr, ctx.args)
    assert 0 < stats["clipfrac"] < 1, "some ratios clipped, some not"
    for name, value in stated_objective(ctx.policy, ctx.cond, tr, ctx.args)[1].items():  # the logged stats too
        torch.testing.assert_close(stats[name], value, rtol=1e-4, atol=1e-7)
    if case == "surrogate, clip and advantage clip":
        assert (tr.advantage.abs() > ctx.args.adv_clip).any() and (tr.advantage.abs() < ctx.args.adv_clip).any()
    if case == "KL":  # each mechanism switched off moves the gradient, so the comparison above sees it
        without = gradient(stated, dataclasses.replace(ctx.args, beta=0.0))
    elif case == "CFG's detached branch":
        ctx.policy.cfg = 1.0
        without = gradient(stated, ctx.args)
    else:
        off = {"step weights": {"weight": torch.ones_like(tr.weight)},
               "chunk ratios in micro-batches": {"chunk_id": torch.arange(len(tr))}}.get(case, {})
        tr = dataclasses.replace(tr, **off)
        without = gradient(stated, ctx.args if off else dataclasses.replace(ctx.args, adv_clip=100.0))
    assert (without - expected).norm() > 0.05 * expected.norm(), f"{case} moves the gradient"
    for p in params:
        p.grad = None


def test_a_run_at_a_larger_beta_ends_closer_to_the_reference(tiny_cache, tmp_path):
    """--beta trains: the same run with a larger weight on the KL ends with a smaller KL to the reference."""
    kl = {}
    for beta in (1e-4, 10.0):
        history = fgc.train(tiny_args(tiny_cache, tmp_path / str(beta), iterations=6, group_size=4, inner_updates=4,
                                      lr=1e-2, beta=beta, eval_every=10, checkpoint_every=10))
        kl[beta] = [h["kl"] for h in history if "kl" in h]
    assert kl[10.0][-1] < 0.25 * kl[1e-4][-1], kl


def test_trained_steps_under_every_sde_leave_out_near_deterministic_ones():
    """On the toy's grid each SDE trains its stochastic steps but the last and any whose std is below a tenth of
    the median step's (ddim's and cps's step into t_{S-1}): no trained step's log-prob gradient is over 10x the
    median step's, where those left out for their std pass 50x."""
    grid = fgc.shifted_grid(10, shift=3.0)
    expected = {"flow": range(0, 9), "ddim": range(1, 8), "cps": range(0, 8)}
    for sde, steps in expected.items():
        args = fgc.resolved(fgc.Args(sde=sde))
        trained = fgc.trainable_steps(grid, args)
        assert torch.nonzero(trained).flatten().tolist() == list(steps), sde
        norms = []
        for k in range(10):  # d log_prob / d v of one sample a step: the score's size
            gen = torch.Generator().manual_seed(k)
            x, v = torch.randn(4, 3, 16, 16, generator=gen), torch.randn(4, 3, 16, 16, generator=gen).requires_grad_()
            level = args.noise_level
            log_prob = fgc.sde_step(x, v, grid[k], grid[k + 1], kind=sde, noise_level=level, gen=gen)[1]
            log_prob.sum().backward()
            norms.append(float(v.grad.norm()))
        ratio = torch.tensor(norms) / torch.tensor(norms)[trained].median()
        by_std = (fgc.step_stds(grid, args) > 0) & ~trained & (torch.arange(10) < 9)  # left out for their std
        assert ratio[trained].max() < 10 and (ratio[by_std] > 50).all() and by_std.any() == (sde != "flow"), ratio


# ----------------------------------------------------------------------------------------------------
# devices: what crosses between the CPU (ids, masks, counters, generators) and the accelerator, checked
# on this CPU-only machine with fake tensors, which carry a device and a shape but no data


FAKE_CUDA = torch.device("cuda", 0)  # with its index: a bare "cuda" asks the (absent) CUDA runtime which GPU


def fake_mode():
    """A FakeTensorMode that raises on mixed devices as CUDA kernels do; real tensors that meet fake ones
    are taken in, and data-dependent sizes (a boolean mask's selection) become symbols."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


def test_fake_tensors_catch_an_op_that_mixes_cpu_and_device_tensors():
    """The tool of the device tests: torch.isin of CPU ids against ids on the device raises under the fake
    mode, on a fake CUDA device and on a fake meta device alike, also when the op runs outside the `with`
    (a fake tensor takes its mode along)."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with fake_mode():
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.isin(torch.arange(3), torch.arange(3, device=FAKE_CUDA))
        assert torch.isin(torch.arange(3, device=FAKE_CUDA), torch.arange(2, device=FAKE_CUDA)).device == FAKE_CUDA
    with fake_mode():
        on_meta = torch.arange(3, device="meta")
    with pytest.raises(FakeTensorDeviceMismatchError):
        torch.isin(torch.arange(3), on_meta)
    with pytest.raises(FakeTensorDeviceMismatchError):
        torch.ones(3) + on_meta.float()


def device_transitions(n: int, device) -> fgc.Transitions:
    """n transitions whose float fields are fake tensors on `device` and whose ids are real CPU tensors."""
    with fake_mode():
        floats = {name: torch.rand(n, device=device) for name in ("t", "t_next", "log_prob", "advantage", "weight")}
        states = {name: torch.randn(n, 3, 4, 4, device=device) for name in ("x", "x_next")}
        std = torch.rand(n, device=device) + 0.1
    return fgc.Transitions(**floats, **states, std=std, prompt=torch.arange(n) % 2, chunk_id=torch.arange(n) // 2,
                           state_id=torch.arange(n), step=torch.arange(n) % 3)


def test_transitions_select_with_cpu_masks_and_keep_every_field_on_its_device():
    """Selecting transitions as update() and accumulate_gradients() do (a CPU bool mask, torch.isin over the CPU
    chunk ids, a mask computed from a device field, CPU indices) keeps the floats on the device and the ids on the CPU.
    The device is a fake meta device: Tensor.__getitem__ takes a device guard that a CPU-only build of
    torch lacks for CUDA, and the fake mode checks meta against the CPU exactly as it checks CUDA."""
    tr = device_transitions(6, "meta")
    devices = {f.name: getattr(tr, f.name).device.type for f in dataclasses.fields(tr)}
    assert devices["x"] == "meta" and devices["chunk_id"] == "cpu"
    masks = [torch.tensor([True, False, True, True, False, True]), torch.isin(tr.chunk_id, torch.tensor([0, 2])),
             tr.advantage.cpu() != 0]
    for sub in [tr[mask] for mask in masks] + [tr[piece] for piece in torch.arange(6).split(4)]:
        assert {f.name: getattr(sub, f.name).device.type for f in dataclasses.fields(sub)} == devices
    assert tr[masks[1]].chunk_id.tolist() == [0, 0, 2, 2], "the CPU ids are real and selected exactly"
    assert tr[torch.arange(6).split(4)[1]].chunk_id.tolist() == [2, 2]


def test_build_reward_moves_every_term_to_the_device(monkeypatch):
    """The toy terms score on the CPU; the sum comes back on the device as float (N,), as a CLIP term on the
    device would, so that terms on different devices never meet."""
    monkeypatch.setattr(fgc, "toy_strict_reward", lambda images, metas, penalty: torch.full((len(images),), penalty))
    monkeypatch.setattr(fgc, "toy_reward", lambda images, metas: torch.ones(len(images), dtype=torch.float64))
    args = fgc.Args(reward="toy-strict:2,toy:0.5", extra_penalty=0.25)
    with fake_mode():
        images = torch.rand(3, 3, fgc.RES, fgc.RES, device=FAKE_CUDA)
        r = fgc.build_reward(args, FAKE_CUDA)(images, [{}] * 3)
    assert r.device == FAKE_CUDA and r.shape == (3,) and r.dtype == torch.float32
    r = fgc.build_reward(args, torch.device("cpu"))(torch.rand(3, 3, fgc.RES, fgc.RES), [{}] * 3)
    torch.testing.assert_close(r, torch.full((3,), 2 * 0.25 + 0.5))


@pytest.mark.parametrize("kind", list(fgc.SDE_LEVELS))
def test_sde_step_takes_device_states_with_cpu_times_and_cpu_noise(kind):
    """sde_step on (fake) CUDA states, with times from a CPU grid (a tensor or floats) and noise drawn on a
    CPU generator, or re-scoring a stored sample: every output is on the states' device."""
    with fake_mode():
        x, v = (torch.randn(4, 3, 8, 8, device=FAKE_CUDA) for _ in range(2))
        t, t_next = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.6, 0.4, 0.2])
        sampled = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7, noise=torch.randn(4, 3, 8, 8))
        rescored = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7, prev_sample=sampled[0])
        floats = fgc.sde_step(x, v, 0.6, 0.4, kind=kind, noise_level=0.7, noise=torch.randn(4, 3, 8, 8))
        kl = fgc.gaussian_kl(sampled[2], rescored[2], sampled[3])
    for out in (sampled, rescored, floats):
        assert [o.device for o in out] == [FAKE_CUDA] * 4
        assert [tuple(o.shape) for o in out] == [(4, 3, 8, 8), (4,), (4, 3, 8, 8), (4,)]
    assert kl.device == FAKE_CUDA and kl.shape == (4,)


class LinearNet(torch.nn.Module):
    """A stand-in denoiser: v = w x + t * mean(embedding), with an adapter switch (off: w = 0.4)."""

    def __init__(self, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((), 0.5, device=device))
        self.adapter = True

    def disable_adapters(self):
        self.adapter = False

    def enable_adapters(self):
        self.adapter = True

    def forward(self, x, t, emb):
        w = self.w if self.adapter else torch.full_like(self.w, 0.4)
        return w * x + t.view(-1, 1, 1, 1) * emb.mean((1, 2)).view(-1, 1, 1, 1)


class LinearPolicy:
    def __init__(self, device):
        self.net = self.denoiser = LinearNet(device)

    @property
    def device(self):
        return self.net.w.device

    def velocity(self, x, t, cond):
        return self.denoiser(x, t, cond["emb"])


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_loss_and_advantages_run_on_device_transitions_with_cpu_ids(beta):
    """grpo_loss on transitions whose floats are on the device and ids on the CPU (fake meta tensors, see
    above), with the KL's reference pass when beta > 0: loss, gradient and stats stay on the device, and
    no op mixes devices. Context.advantages takes device rewards with CPU group ids the same way."""
    tr = device_transitions(6, "meta")
    with fake_mode():
        policy, cond, rewards = LinearPolicy("meta"), {"emb": torch.randn(2, 5, 7, device="meta")}, torch.rand(6)
        rewards = rewards.to("meta")
    loss, stats = fgc.grpo_loss(policy, cond, tr, fgc.Args(beta=beta))
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == () and policy.net.w.grad.device.type == "meta"
    assert set(stats) == {"policy_loss", "kl", "ratio_mean", "clipfrac", "approx_kl"}
    assert all(s.device.type == "meta" and s.shape == () and not s.requires_grad for s in stats.values())
    ctx = fgc.Context(policy, fgc.Args(), fgc.Meter(), fgc.generator(0), [], cond, torch.zeros(2), None)
    adv = ctx.advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert adv.device.type == "meta" and adv.shape == (6,)


def test_dist_reduces_to_a_float64_tensor_on_its_device():
    """Dist owns the device of its collectives: a number (or a CPU flag) comes back as float64 there."""
    x = fgc.Dist(device=torch.device("meta")).reduce(3)
    assert x.device.type == "meta" and x.dtype == torch.float64 and x.shape == ()
    one = fgc.Dist()
    assert one.reduce(3, "max").item() == 3.0 and one.reduce(torch.tensor(True), "min").dtype == torch.float64
    assert torch.equal(one.gather(torch.arange(3)), torch.arange(3))


# ----------------------------------------------------------------------------------------------------
# CLI: bad input is one line and exit status 2, with nothing written


def test_every_flag_is_an_args_field_whose_comment_is_its_help(capsys, monkeypatch):
    """--help lists every Args field as a flag, with the comment written after the field (read here with
    tokenize, independently of the CLI) and its default."""
    source = inspect.getsource(fgc.Args)
    comments = {tok.start[0]: tok.string.lstrip("# ") for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a help text
    with pytest.raises(SystemExit):
        fgc.parse_args(["--help"])
    options = {m[1]: " ".join(m[2].split()) for m in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  --|\Z)",
                                                                   capsys.readouterr().out, re.M | re.S)}
    assert set(options) == {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(fgc.Args)}
    for f in dataclasses.fields(fgc.Args):
        row = next(i for i, line in enumerate(source.splitlines(), 1) if line.strip().startswith(f"{f.name}:"))
        assert options[f"--{f.name.replace('_', '-')}"].endswith(f"{comments[row]} (default: {f.default})"), f.name


@pytest.mark.parametrize("argv,needle", [
    (["--method", "ppo"], "flow_grpo, stepwise, tempflow, g2rpo, chunk"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--iterations", "-1"], "--iterations must be >= 0"),
    (["--steps", "three"], "--steps: invalid int value: 'three'"),
    (["--method", "chunk", "--chunks", "2,2"], "summing to the 9 trained steps"),
    (["--method", "g2rpo", "--granularities", "1,0"], "--granularities"),
    (["--method", "g2rpo", "--granularities", "1,1,2"], "--granularities must be distinct positive integers"),
    (["--method", "chunk", "--chunks", "2-4"], "--chunks must be integers like 2,3,4"),
    (["--method", "all"], "unknown --method 'all'; choose flow_grpo"),
    (["--method", "g2rpo", "--sde", "ddim", "--steps", "3"], "has no step to train"),
    (["--sde", "euler"], "flow, ddim, cps"),
    (["--sde", "cps", "--noise-level", "1.5"], "--noise-level of the cps SDE must be in (0, 1]"),
    (["--ema-decay", "1"], "--ema-decay must be in [0, 1), got 1.0"),
    (["--device", "cuda"], "no CUDA"),
    (["--out", "/proc/forbidden"], "cannot create"),
    (["--toy-base", "/no/such/toy"], "--toy-base /no/such/toy: no such folder"),
    (["--full-eval-nfe", "64k"], "--full-eval-nfe must be integers like 1,2,3"),
    (["--method", "g2rpo", "--granularities", ""], "--granularities must be distinct positive integers"),
])
def test_bad_input_is_a_one_line_error_with_status_2(argv, needle, tmp_path, capsys):
    """main() (the CLI's whole path but the interpreter's exit, which the next test runs) prints one line and
    returns 2, leaving no run folder behind."""
    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is present")
    out = ["--out", str(tmp_path / "runs")] if "--out" not in argv else []
    assert fgc.main([*argv, *out]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert not (tmp_path / "runs").exists()


def test_the_script_exits_with_status_2_and_one_line_on_a_bad_flag(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--group-size", "1", "--out", str(tmp_path / "runs")], check=False,
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --group-size must be >= 2, got 1"
    assert not (tmp_path / "runs").exists()


def test_benchmark_under_torchrun_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert benchmark_module().main(["--repeat", "1"]) == 2
    assert "without torchrun" in capsys.readouterr().err


def test_the_reward_decodes_and_scores_micro_batch_images_at_a_time():
    """Stepwise scores B*G*S images an iteration: the reward takes them `micro_batch` at a time, and real
    models get a micro-batch of 4 unless told otherwise (the toy 128)."""
    sizes = []

    def reward(images, metas):
        sizes.append(len(images))
        return images.mean((1, 2, 3))

    ctx = ctx_for({"micro_batch": 3}, reward=reward)
    x = torch.randn(8, 3, 16, 16)
    r = ctx.reward(x, torch.zeros(8, dtype=torch.long))
    assert sizes == [3, 3, 2] and torch.allclose(r, ctx.policy.decode(x).mean((1, 2, 3)))
    assert fgc.resolved(fgc.Args(model="./sd3")).micro_batch == 4 and fgc.resolved(fgc.Args()).micro_batch == 128
    assert fgc.resolved(fgc.Args(model="./sd3", micro_batch=2)).micro_batch == 2


def test_moving_average_warms_up_as_flow_grpo_and_ema_applied_restores_the_live_weights(tiny_run):
    """The average that is evaluated and saved (diffusers' EMAModel): its first update takes the weights as
    they are, update n >= 1 moves with decay min((1 + n) / (10 + n), decay), Flow-GRPO's warm-up, up to the
    cap; ema_applied puts the average in the parameters and gives the live weights back afterwards, also
    when the body raises. With --ema 0 the average is the latest weights. A run's average (its checkpoint's)
    has the settings of the one checked here."""
    from diffusers.training_utils import EMAModel

    p = torch.nn.Parameter(torch.zeros(3))
    ema, cap, expected = EMAModel([p], decay=0.9), 0.9, torch.zeros(3)
    values = torch.rand(90, 3, generator=torch.Generator().manual_seed(0))
    for n, value in enumerate(values):
        with torch.no_grad():
            p.copy_(value)
        ema.step([p])
        decay = 0.0 if n == 0 else min((1 + n) / (10 + n), cap)
        expected = decay * expected + (1 - decay) * value
        torch.testing.assert_close(ema.shadow_params[0], expected)
    assert min((1 + n) / (10 + n), cap) == cap, "the run reached the cap"
    with fgc.ema_applied(ema, [p]):
        torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(p.detach(), values[-1])  # the live weights are back for training
    with pytest.raises(KeyboardInterrupt), fgc.ema_applied(ema, [p]):
        raise KeyboardInterrupt
    torch.testing.assert_close(p.detach(), values[-1])
    off = EMAModel([p], decay=0.0)
    for value in values[:3]:
        with torch.no_grad():
            p.copy_(value)
        off.step([p])
    torch.testing.assert_close(off.shadow_params[0], values[2])
    args, run, _ = tiny_run

    def settings(state):  # an EMAModel's state without its values and its step count
        return {k: v for k, v in state.items() if k not in ("shadow_params", "optimization_step")}

    saved = torch.load(run / "checkpoint.pt", weights_only=True)["ema"]
    assert settings(saved) == settings(EMAModel([p], decay=args.ema_decay).state_dict())


def test_every_method_has_a_default_run_length_and_lr_and_a_flag_given_keeps_its_value():
    """--iterations 0 and --lr 0 (the defaults) pick the method's run length and lr (a method without them would
    fail only when a user runs it); G2RPO's noise level is its code's 0.7; a value given is never replaced."""
    assert fgc.Args().iterations == 0 == fgc.Args().lr and all(m.iterations and m.lr for m in fgc.METHODS.values())
    for method in fgc.METHODS:
        args = fgc.validate(fgc.Args(method=method))
        assert args.iterations >= 1 and args.lr > 0 and args.lr == fgc.METHODS[method].lr
        assert args.noise_level == (0.7 if method == "g2rpo" else 1.0)
    given = fgc.validate(fgc.Args(method="g2rpo", lr=1e-3, noise_level=1.0, iterations=3))
    assert (given.lr, given.noise_level, given.iterations) == (1e-3, 1.0, 3)
    for sde, level in fgc.SDE_LEVELS.items():  # G2RPO's 0.7 is its flow SDE's a; ddim and cps keep their own eta
        assert fgc.validate(fgc.Args(method="g2rpo", sde=sde)).noise_level == (0.7 if sde == "flow" else level)


def test_a_default_run_s_args_hold_what_ran_and_records_written_before_read_the_same():
    """resolved fills every 0 that leaves a value to the method, the SDE or the model (toy: guidance 1, LoRA 16/16,
    128 samples a pass), and is idempotent; a record's args written with 0s for them gives the same run and label."""
    args = fgc.validate(fgc.Args())
    filled = ("iterations", "lr", "noise_level", "micro_batch", "guidance", "lora_rank", "lora_alpha")
    assert all(getattr(args, k) for k in filled) and fgc.resolved(args) == args
    assert (args.guidance, args.lora_rank, args.lora_alpha, args.micro_batch) == (1.0, 16, 16.0, 128)
    saved = {**dataclasses.asdict(fgc.Args(method="g2rpo")), "lr_schedule": "constant"}  # a field that is gone
    for former, name in fgc.FORMER_NAMES.items():
        saved[former] = saved.pop(name)
    assert fgc.resolved(fgc.args_of(saved)) == fgc.validate(fgc.Args(method="g2rpo"))
    assert fgc.run_label(fgc.args_of(saved)) == "g2rpo"
    real = fgc.resolved(fgc.Args(model="some/sd3"))  # a pipeline's guidance is its own (SD3 4.5, FLUX 3.5)
    assert (real.micro_batch, real.lora_rank, real.lora_alpha, real.guidance) == (4, 32, 64.0, 0.0)


def test_a_method_registered_with_its_defaults_trains_under_them_and_one_without_them_under_method_s(
        tiny_cache, tmp_path, monkeypatch):
    """A sixth method is one METHODS entry: registered with its defaults it trains under them; registered with its
    function alone it takes Method's (64 iterations, lr 1e-3, the SDE's noise level), and flags still override them."""
    monkeypatch.setitem(fgc.METHODS, "sixth", fgc.Method(fgc.flow_grpo, iterations=2, lr=5e-3))
    monkeypatch.setattr(fgc, "toy_strict_reward", lambda images, metas, penalty: images.mean((1, 2, 3)).cpu())
    history = fgc.train(tiny_args(tiny_cache, tmp_path / "sixth", method="sixth", iterations=0))
    steps = [h for h in history if "reward_mean" in h]
    assert len(steps) == 2 and all(h["trained"] > 0 and h["lr"] == 5e-3 for h in steps)
    monkeypatch.setitem(fgc.METHODS, "seventh", fgc.Method(fgc.flow_grpo))
    seventh = fgc.validate(fgc.Args(method="seventh"))
    assert (seventh.iterations, seventh.lr, seventh.noise_level) == (64, 1e-3, 1.0)
    assert fgc.validate(fgc.Args(method="seventh", lr=2e-3, iterations=3)).lr == 2e-3


def test_setup_resolves_the_method_s_lr_itself():
    """setup(Args()) called directly (as a notebook may) gets the method's lr, not the 0 that means "the method's"."""
    parts = fgc.setup(fgc.Args(), fgc.Dist())
    assert parts.opt.param_groups[0]["lr"] == fgc.METHODS["flow_grpo"].lr > 0


def test_parse_args_reads_every_flag_and_parse_ints_names_the_flag():
    """Every Args field is a flag (only the flags given override the defaults); parse_ints' error is one
    UsageError line naming the flag, and '' is no integers."""
    args = fgc.parse_args(["--sde", "cps", "--micro-batch", "3", "--extra-penalty", "0.25", "--low-memory",
                           "--no-base-cache"])
    expected = dataclasses.replace(fgc.Args(), sde="cps", micro_batch=3, extra_penalty=0.25, low_memory=True,
                                   base_cache=False)
    assert args == expected and fgc.parse_args([]) == fgc.Args()
    assert fgc.parse_ints("1,2,3", "--granularities") == [1, 2, 3] and fgc.parse_ints("", "--full-evals") == []
    for bad in ("a", "2-4", "1,", ","):
        with pytest.raises(fgc.UsageError, match=re.escape(f"--chunks must be integers like 2,3,4, got {bad!r}")):
            fgc.parse_ints(bad, "--chunks", "2,3,4")


# ----------------------------------------------------------------------------------------------------
# end to end on a briefly pretrained toy model: determinism, resume, non-finite guard, LoRA files


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A cache folder that holds a toy model of the shipped architecture, pretrained 30 steps (toy_base's recipe)."""
    cache = tmp_path_factory.mktemp("cache")
    assert toy_base.main(["--out", str(cache / "toy"), "--steps", "30"]) == 0
    return str(cache)


def tiny_args(cache, out, **kw):
    base = {"iterations": 3, "prompts_per_iter": 2, "group_size": 2, "steps": 4, "eval_steps": 2, "eval_per_tag": 1,
            "eval_every": 2, "toy_base": str(Path(cache) / "toy"), "cache_dir": cache, "out": str(out),
            "checkpoint_every": 1, "base_cache": False}
    return fgc.Args(**{**base, **kw})


def first_group_flat(images, metas, penalty):
    """A toy reward under which the first prompt's group (the first G images: images come grouped by
    prompt) has equal rewards and every other group a spread."""
    r = images.mean((1, 2, 3)).cpu()
    r[:len(images) // 2] = 0.5
    return r


@pytest.fixture(scope="session")
def tiny_run(tiny_cache, tmp_path_factory):
    """(args, run folder, history) of a finished 2-iteration toy run of 2 prompts whose first group gets
    equal rewards (first_group_flat)."""
    out = tmp_path_factory.mktemp("tiny_run")
    args = tiny_args(tiny_cache, out, iterations=2, lr=1e-2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fgc, "toy_strict_reward", first_group_flat)
        history = fgc.train(args)
    return args, next(out.iterdir()), history


def strip_time(history):
    return [{k: v for k, v in h.items() if k != "wall_s"} for h in history]


def test_the_curves_evaluations_score_every_kth_pair_of_each_category_paired_with_the_base_and_the_end_scores_all(
        tiny_cache, tmp_path):
    """With 5 prompts a category and curve_per_tag 2 (k = 2), iteration 1 scores pairs 0, 2 and 4 of each category
    (18 of 30) with their own noise, its gain paired with the base's scores of the same pairs; the start and the end
    score all 30. k follows each category's real size: 50 prompts of one kind at curve_per_tag 32 are all scored.
    --full-evals and the first iteration past a --full-eval-nfe budget score all too. --tune evaluates other prompts
    with other noise."""
    history = fgc.train(tiny_args(tiny_cache, tmp_path, iterations=2, eval_every=1, eval_per_tag=5, curve_per_tag=2))
    run, evals = next(tmp_path.iterdir()), [h for h in history if "eval_pairs" in h]
    assert [h["eval_pairs"] for h in evals] == [30, 18, 30]
    base, mid = (torch.load(run / f"scores_{i:04d}.pt") for i in (0, 1))
    chosen = [category * 5 + j for category in range(6) for j in (0, 2, 4)]
    assert mid["pair"].tolist() == chosen and base["pair"].tolist() == list(range(30))
    tags = [fgc.eval_prompts(5)[i]["tag"] for i in chosen]
    assert evals[1]["gain_strict"] == pytest.approx(fgc.by_category(mid["strict"] - base["strict"][chosen], tags)[0])
    spent = [h["nfe"] for h in history if "reward_mean" in h]  # passes after iterations 1 and 2, the same below
    flags = {"full_evals": "1", "full_eval_nfe": f"{spent[1] + 1},{10**9}"}  # the first budget reached at iteration 3
    longer = fgc.train(tiny_args(tiny_cache, tmp_path / "full", iterations=5, eval_every=1, eval_per_tag=5,
                                 curve_per_tag=2, **flags))
    assert [h["eval_pairs"] for h in longer if "eval_pairs" in h] == [30, 30, 18, 30, 18, 30]
    assert "full" not in fgc.run_label(tiny_args(tiny_cache, tmp_path, **flags)), "where it evaluates is no label"
    policy = fgc.load_toy(fgc.validate(tiny_args(tiny_cache, tmp_path)), torch.device("cpu"))
    _, _, metas, scores = fgc.evaluate(policy, fgc.Args(eval_per_tag=2, eval_steps=2), pairs=[0, 2, 5])
    _, images, _, every_pair = fgc.evaluate(policy, fgc.Args(eval_per_tag=2, eval_steps=2))
    assert [m["prompt"] for m in metas] == [fgc.eval_prompts(2)[i]["prompt"] for i in (0, 2, 5)]
    assert torch.equal(scores["reward"], every_pair["reward"][[0, 2, 5]])  # the same pairs: the same noise
    held_out = [{"tag": "prompt", "prompt": f"p{i}"} for i in range(50)]
    assert fgc.curve_pairs(held_out, 32) == list(range(50)) and fgc.curve_pairs(held_out, 10) == list(range(0, 50, 5))
    assert fgc.curve_pairs(fgc.eval_prompts(256), 32) == list(range(0, 1536, 8))  # the default: every 8th pair
    tune = fgc.Args(eval_per_tag=2, eval_steps=2, tune=True)
    assert [m["prompt"] for m in fgc.evaluate(policy, tune)[2]] != [m["prompt"] for m in fgc.eval_prompts(2)]
    assert not torch.equal(fgc.evaluate(policy, tune, metas=fgc.eval_prompts(2))[1], images)  # other noise


def test_same_seed_gives_the_same_metrics(tiny_cache, tmp_path):
    a = fgc.train(tiny_args(tiny_cache, tmp_path / "a"))
    b = fgc.train(tiny_args(tiny_cache, tmp_path / "b"))
    assert strip_time(a) == strip_time(b)
    c = fgc.train(tiny_args(tiny_cache, tmp_path / "c", seed=1))
    assert strip_time(a) != strip_time(c)


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tiny_cache, tmp_path, monkeypatch):
    """A run killed in iteration 3 and resumed from its checkpoint (a weights-only load) ends with the
    metrics, adapter, moving average and lr of the run that was never stopped; the lr is constant."""
    full = fgc.train(tiny_args(tiny_cache, tmp_path / "full", iterations=4))
    lr = fgc.METHODS["flow_grpo"].lr
    assert [h["lr"] for h in full if "lr" in h] == [lr] * 4
    calls = {"n": 0}
    real = fgc.METHODS["flow_grpo"]

    def dies_in_iteration_3(ctx):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real.assign(ctx)

    monkeypatch.setitem(fgc.METHODS, "flow_grpo", dataclasses.replace(real, assign=dies_in_iteration_3))
    with pytest.raises(KeyboardInterrupt):
        fgc.train(tiny_args(tiny_cache, tmp_path / "killed", iterations=4))
    monkeypatch.setitem(fgc.METHODS, "flow_grpo", real)
    run = next((tmp_path / "killed").iterdir())
    assert torch.load(run / "checkpoint.pt", weights_only=True)["iteration"] == 2
    args = fgc.parse_args(["--run", str(run)])
    assert args.iterations == 4 and args.run == str(run)
    resumed = fgc.train(args)
    assert strip_time(resumed) == strip_time(full)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert strip_time(lines) == strip_time(full)
    full_run = next((tmp_path / "full").iterdir())
    a, b = (torch.load(r / "checkpoint.pt", weights_only=True) for r in (full_run, run))
    assert a["lora"].keys() == b["lora"].keys() and all(torch.equal(a["lora"][k], b["lora"][k]) for k in a["lora"])
    shadows = zip(a["ema"]["shadow_params"], b["ema"]["shadow_params"], strict=True)
    assert all(torch.equal(x, y) for x, y in shadows)
    stepped = sum(1 for h in full if h.get("trained"))  # iterations that took optimizer steps
    assert a["ema"]["optimization_step"] == b["ema"]["optimization_step"] == stepped > 0
    assert [c["optimizer"]["param_groups"][0]["lr"] for c in (a, b)] == [lr, lr]


def test_a_resume_refuses_the_flags_its_checkpoint_fixes(tiny_run, tiny_cache, tmp_path, capsys):
    """The checkpoint is an adapter of one method, seed, model and rank, and its optimizer and moving average hold
    their lr, weight decay and decay: --run with other values is a one-line error (a finished run's record is not
    overwritten under another label), and the run folder says what the run does. A longer run is fine: the lr is
    constant."""
    args, run, _ = tiny_run
    before = {name: (run / name).read_text() for name in ("args.json", "record.json")}
    other_rank = str(fgc.resolved(args).lora_rank + 1)
    for flag, value in [("--lr", "0.5"), ("--weight-decay", "0.1"), ("--ema-decay", "0.5"), ("--seed", "1"),
                        ("--method", "stepwise"), ("--lora-rank", other_rank), ("--lora-alpha", "3")]:
        assert fgc.main(["--run", str(run), flag, value]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{flag} is" in err and "start a new run" in err
    assert {name: (run / name).read_text() for name in before} == before
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == json.loads(before["args.json"])["lr"] == args.lr
    fgc.train(tiny_args(tiny_cache, tmp_path, iterations=1))
    longer = fgc.train(fgc.parse_args(["--run", str(next(tmp_path.iterdir())), "--iterations", "2"]))
    assert [h["lr"] for h in longer if "lr" in h] == [fgc.METHODS["flow_grpo"].lr] * 2


def test_chunk_boundaries_come_from_the_base_model_also_when_a_run_resumes(tiny_cache, tmp_path, monkeypatch):
    calls, real = [], fgc.chunks_from_profile

    def spy(profile, num_chunks):  # whether the profiled model has an adapter yet, its profile, the sizes
        calls.append((hasattr(policies[-1].net, "peft_config"), profile.clone(), real(profile, num_chunks)))
        return calls[-1][2]

    policies, load = [], fgc.load_policy

    def keep(args, device):
        policies.append(load(args, device))
        return policies[-1]

    monkeypatch.setattr(fgc, "chunks_from_profile", spy)
    monkeypatch.setattr(fgc, "load_policy", keep)
    first = fgc.train(tiny_args(tiny_cache, tmp_path, method="chunk", num_chunks=2, iterations=2, lr=1e-2))
    run = next(tmp_path.iterdir())
    fgc.train(fgc.parse_args(["--run", str(run), "--iterations", "3"]))
    (adapter_0, profile_0, sizes_0), (adapter_1, profile_1, sizes_1) = calls
    assert not adapter_0 and not adapter_1, "the profile is the base model's, taken before any adapter"
    torch.testing.assert_close(profile_1, profile_0)  # the resumed run's trained adapter did not move it
    assert sizes_1 == sizes_0 == first[0]["chunk_sizes"]


def test_non_finite_rewards_skip_updates_and_then_stop(tiny_cache, tmp_path, monkeypatch):
    real = fgc.toy_strict_reward
    calls = {"n": 0}

    def nan_in_iteration_2(images, metas, penalty):  # calls: the evaluation at 0, iteration 1, iteration 2, ...
        calls["n"] += 1
        r = real(images, metas, penalty)
        return r * float("nan") if calls["n"] == 3 else r

    monkeypatch.setattr(fgc, "toy_strict_reward", nan_in_iteration_2)
    history = fgc.train(tiny_args(tiny_cache, tmp_path / "once"))
    skipped = [h for h in history if h.get("skipped")]
    assert [h["iteration"] for h in skipped] == [2] and history[-1].get("eval_overall") is not None

    monkeypatch.setattr(fgc, "toy_strict_reward", lambda images, metas, penalty: torch.full((len(images),), torch.nan))
    with pytest.raises(fgc.RunError, match="3 iterations in a row"):
        fgc.train(tiny_args(tiny_cache, tmp_path / "always", iterations=5))
    run = next((tmp_path / "always").iterdir())
    assert not (run / "checkpoint.pt").exists(), "no checkpoint from a poisoned state"
    with pytest.raises(fgc.RunError, match="stopped at iteration 2: 2 iterations in a row"):  # fewer than 3: no finish
        fgc.train(tiny_args(tiny_cache, tmp_path / "short", iterations=2))
    assert "error" in json.loads((next((tmp_path / "short").iterdir()) / "record.json").read_text())


def reading_path() -> tuple[list, set]:
    """The module docstring's reading path -> (its call tree as nested [name, children] lists, the left-out names)."""
    text = fgc.__doc__.split("Reading path:")[1].split("\n\n")[0]
    left_out = set(re.findall(r"\w+(?:\.\w+)*", text.split("Left out, one-liners:")[1].split("\n    ")[0]))
    root = []
    parents = {-1: root}  # depth -> the node whose children the next, deeper line holds
    for line in (line for line in text.split("\n") if line.startswith("    ")):  # the tree: 4 spaces an indent
        depth = (len(line) - len(line.lstrip())) // 4 - 1
        for item in line.strip().split(", "):
            parent = parents[depth - 1]
            for element in item.split(" -> "):  # a chain: each element calls the next
                node = [re.match(r"[\w.]+", element)[0], []]
                parent.append(node)
                parent = node[1]
            parents[depth] = parent  # the last element's children are on the next, deeper lines
    return root, left_out


def call_tree(fn, start: str, stop: str, left_out: set) -> list:
    """The calls fn() makes to the module's functions (and to a few of torch's and diffusers'), from the first call
    of `start` to the return of `stop`, as nested [name, children] lists: each call under its nearest recorded
    caller, and a function called again by the same caller merged into its first call."""
    external = {"Tensor.backward": "loss.backward", "clip_grad_norm_": "clip_grad_norm_", "Adam.step": "opt.step",
                "AdamW.step": "opt.step", "EMAModel.step": "ema.step"}
    root, stack, recording = [], [], [False]

    def profile(frame, event, arg):
        name = frame.f_code.co_qualname
        if event == "call":
            recording[0] |= name == start
            mine = frame.f_globals.get("__name__") == fgc.__name__ and "<" not in name and name not in left_out
            node = None
            if recording[0] and (mine or name in external):
                siblings = next((n[1] for _, n in reversed(stack) if n is not None), root)
                name = external.get(name, name)
                node = next((n for n in siblings if n[0] == name), None)
                if node is None:
                    siblings.append(node := [name, []])
            stack.append((frame, node))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()
            recording[0] &= name != stop

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return root


def test_the_reading_path_is_the_call_tree_of_one_flow_grpo_iteration(tiny_cache, tmp_path):
    """The module docstring's reading path is exactly the call tree of one Flow-GRPO iteration, from
    iteration_context to the checkpoint, a curve evaluation included (iteration 1 of 2, evaluated every
    iteration): every call in the order made, none left out but the one-liners it names."""
    path, left_out = reading_path()
    assert [name for name, _ in path][:2] == ["iteration_context", "flow_grpo"] and len(left_out) > 5
    args = tiny_args(tiny_cache, tmp_path, iterations=2, eval_every=1, curve_per_tag=1, eval_per_tag=2, group_size=4)
    traced = call_tree(lambda: fgc.train(args), "iteration_context", "RunFolder.checkpoint", left_out)
    assert traced == path


def test_a_non_finite_gradient_mid_update_leaves_the_model_and_the_optimizer_as_they_were(
        tiny_cache, tmp_path, monkeypatch):
    """A NaN in the gradient of iteration 2's third minibatch undoes that iteration's update: the adapter, Adam's
    step counts and moments and the moving average stay as iteration 1 left them; nfe counts the passes computed."""
    real_accumulate, real_update, seen = fgc.accumulate_gradients, fgc.update, []

    def poisoned(policy, cond, mb, args, meter):
        stats = real_accumulate(policy, cond, mb, args, meter)
        seen[-1]["minibatches"].append(len(mb))
        if len(seen) == 2 and len(seen[-1]["minibatches"]) == 3:
            next(p for p in policy.net.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        return stats

    def state(policy, opt):
        params = adapter_params(policy)
        moments = [opt.state[p][k].clone() for p in params if p in opt.state for k in ("step", "exp_avg", "exp_avg_sq")]
        return [p.detach().clone() for p in params] + moments

    def watched(policy, opt, *rest):
        seen.append({"before": state(policy, opt), "minibatches": []})
        stats = real_update(policy, opt, *rest)
        seen[-1] |= {"after": state(policy, opt), "stats": stats}
        return stats

    monkeypatch.setattr(fgc, "accumulate_gradients", poisoned)
    monkeypatch.setattr(fgc, "update", watched)
    history = fgc.train(tiny_args(tiny_cache, tmp_path, group_size=4, eval_every=10, checkpoint_every=10))
    first, poisoned_update, last = seen
    assert len(poisoned_update["minibatches"]) == 3 and len(first["minibatches"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(poisoned_update["before"], poisoned_update["after"]))
    assert not all(torch.equal(a, b) for a, b in zip(last["before"], last["after"])), "the next update trains"
    assert poisoned_update["stats"] == {"skipped": 1.0, "trained": sum(poisoned_update["minibatches"])}
    steps = [h for h in history if "reward_mean" in h]
    sampling = 2 * 4 * 4  # 2 prompts x group 4, 4 steps
    assert steps[1]["nfe"] - steps[0]["nfe"] == sampling + sum(poisoned_update["minibatches"])
    ema = torch.load(next(tmp_path.iterdir()) / "checkpoint.pt", weights_only=True)["ema"]
    assert ema["optimization_step"] == 2, "iterations 1 and 3 step the moving average, iteration 2 does not"


def test_a_run_counts_groups_with_equal_rewards_and_trains_only_the_others(tiny_run):
    """End to end: when the first prompt's group gets equal rewards in every iteration, zero_std_frac is
    1/2 and only the other group's transitions are trained (and counted in nfe)."""
    args, _, history = tiny_run
    assert args.prompts_per_iter == 2 and args.group_size == 2 and args.steps == 4
    steps = [h for h in history if "reward_mean" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["zero_std_frac"] == 0.5 and h["trained"] == h["transitions"] // 2 > 0
    sampling = 2 * 2 * 4  # 2 prompts x group 2, 4 steps a trajectory
    assert steps[0]["nfe"] == sampling + steps[0]["trained"]


def test_a_second_writer_of_a_run_folder_is_a_one_line_error(tiny_run, tmp_path):
    """A run folder has one writer: while a process holds it, a second start in the same folder is refused."""
    import shutil

    from filelock import FileLock
    args, run, _ = tiny_run
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    with FileLock(copy / ".lock", timeout=0):
        with pytest.raises(fgc.UsageError, match="being written by another process"):
            fgc.train(dataclasses.replace(args, iterations=3, run=str(copy)))


def test_the_script_imports_and_reads_its_flags_where_fcntl_is_absent():
    """Windows has no fcntl: the script imports without it (the run folder's lock goes through filelock)."""
    code = ("import sys; sys.modules['fcntl'] = None; import flow_grpo_credit as fgc; "
            "print(fgc.parse_args(['--method', 'chunk']).method)")
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout == "chunk\n", done.stderr


def test_the_moving_average_steps_only_after_an_optimizer_step(tiny_cache, tmp_path, monkeypatch):
    """Every group flat: no optimizer step is taken, so the adapter's moving average does not step either."""
    monkeypatch.setattr(fgc, "toy_strict_reward", lambda images, metas, penalty: torch.zeros(len(images)))
    history = fgc.train(tiny_args(tiny_cache, tmp_path, iterations=2))
    state = torch.load(next(tmp_path.iterdir()) / "checkpoint.pt", weights_only=True)
    assert all(h["zero_std_frac"] == 1 and "trained" not in h for h in history if "reward_mean" in h)
    assert state["ema"]["optimization_step"] == 0


def test_saved_lora_loads_into_a_fresh_unet_with_diffusers(tiny_run):
    args, run, _ = tiny_run
    assert (run / "lora" / "pytorch_lora_weights.safetensors").exists()
    assert (run / "reward_curve.png").exists() and (run / "samples_0002.png").exists()
    trained = fgc.load_toy(args, torch.device("cpu"))
    average = torch.load(run / "checkpoint.pt", weights_only=True)["ema"]["shadow_params"]
    with torch.no_grad():  # what is saved is the moving average of the adapter weights, as Flow-GRPO saves its EMA
        for p, avg in zip(fgc.add_lora(trained, args), average, strict=True):
            p.copy_(avg)
    fresh = fgc.load_toy(args, torch.device("cpu"))
    fresh.net.load_lora_adapter(str(run / "lora"), prefix="unet", weight_name="pytorch_lora_weights.safetensors")
    base = fgc.load_toy(args, torch.device("cpu"))
    x, t = torch.randn(2, 3, fgc.RES, fgc.RES), torch.tensor([0.7, 0.3])
    cond = trained.encode(["a red circle", "two squares"])
    with torch.no_grad():
        v_trained, v_fresh, v_base = (p.velocity(x, t, cond) for p in (trained, fresh, base))
    torch.testing.assert_close(v_fresh, v_trained, atol=1e-5, rtol=1e-4)
    assert (v_trained - v_base).abs().max() > 1e-4, "the adapter changed the model"


def test_a_checkpoint_holds_only_data_and_loads_onto_the_cpu(tiny_run, tmp_path):
    """checkpoint.pt loads with weights_only=True (no pickled code), and RunFolder.open maps it to the CPU
    whatever the policy's device: a policy that reports the meta device (with the real CPU net) gets its
    adapter, optimizer state and moving average back."""
    from diffusers.training_utils import EMAModel
    from peft.utils import get_peft_model_state_dict

    args, run, _ = tiny_run
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["iteration"] == 2 and saved["ema"]["optimization_step"] == 2
    real = fgc.load_toy(args, torch.device("cpu"))
    params = fgc.add_lora(real, args)
    opt, ema = torch.optim.AdamW(params, lr=args.lr), EMAModel(params, decay=args.ema_decay)
    policy = types.SimpleNamespace(device=torch.device("meta"), net=real.net, denoiser=real.net)
    shutil.copytree(run, tmp_path / "run")  # open rewrites the folder's args.json and metrics.jsonl
    folder = fgc.RunFolder(dataclasses.replace(args, run=str(tmp_path / "run")), fgc.Dist())
    assert folder.open(types.SimpleNamespace(policy=policy, opt=opt, chunk_sizes=None), ema)[1] == 3
    folder.file.close()
    folder.lock.release()
    lora = get_peft_model_state_dict(real.net)
    assert lora.keys() == saved["lora"].keys() and all(torch.equal(lora[k], saved["lora"][k]) for k in lora)
    assert all(s.device.type == "cpu" for s in ema.shadow_params) and ema.optimization_step == 2
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, saved["ema"]["shadow_params"], strict=True))
    moments = [v for s in opt.state_dict()["state"].values() for v in s.values() if v.dim() > 0]
    assert moments and all(m.device.type == "cpu" for m in moments)


def test_torchrun_with_two_cpu_ranks_keeps_their_weights_identical(tiny_cache, tmp_path):
    """2 processes, gloo backend, group size 2: each group has one member on each rank, so only the
    all-gathered rewards give it a spread (zero_std_frac 0, not 1) and a non-zero advantage; DDP averages the
    gradients, so both ranks end with the same adapter; rank 0 alone writes the run folder; its metrics
    count both ranks' work."""
    script = tmp_path / "ddp_run.py"
    script.write_text(f"""import os, sys, torch
sys.path.insert(0, {str(HERE)!r})
import flow_grpo_credit as fgc
real_add_lora, params, init = fgc.add_lora, [], []

def add_lora(policy, args):  # keep a handle on the adapter's parameters and their initial values
    params.extend(real_add_lora(policy, args))
    init.extend(p.detach().clone() for p in params)
    return params

fgc.add_lora = add_lora
fgc.toy_strict_reward = lambda images, metas, penalty: images.mean((1, 2, 3)).cpu()  # never two equal rewards
args = fgc.Args(iterations=2, prompts_per_iter=2, group_size=2, steps=4, eval_steps=2, eval_per_tag=1,
                eval_every=2, toy_base={str(Path(tiny_cache) / "toy")!r}, cache_dir={tiny_cache!r},
                out={str(tmp_path / 'runs')!r}, device="cpu", lr=1e-2)
fgc.train(args)
rank = os.environ['RANK']
torch.save({{"trained": [p.detach() for p in params], "init": init}}, {str(tmp_path)!r} + f"/rank{{rank}}.pt")
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               str(script)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(a["trained"]) == len(b["trained"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["trained"], b["trained"])), "both ranks hold the same weights"
    assert any(not torch.equal(x, y) for x, y in zip(a["trained"], a["init"])), "and training moved them"
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, "only rank 0 writes a run folder"
    lines = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    first = next(h for h in lines if h["iteration"] == 1 and "reward_mean" in h)
    assert first["images_scored"] == 2 * 2, "both ranks' images (2 prompts x 1 member each) are counted"
    train_lines = [h for h in lines if "reward_mean" in h]
    assert [h["zero_std_frac"] for h in train_lines] == [0.0, 0.0], "groups spanning ranks were normalised whole"


def test_group_advantages_under_torchrun_equal_the_single_process_ones(tmp_path):
    """Rewards are all-gathered before group normalisation: two ranks holding halves of every group get
    exactly the advantages one process computes for the whole batch, each its own half."""
    script = tmp_path / "ddp_adv.py"
    script.write_text(f"""import os, sys, torch
sys.path.insert(0, {str(HERE)!r})
import flow_grpo_credit as fgc
dist = fgc.Dist.join(torch.device("cpu"))
r = torch.arange(8.0) ** 2 + dist.rank * 5  # rank 0: members 0-7, rank 1: members 8-15
group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # every group has 2 members here and 2 on the other rank
ctx = fgc.Context(None, fgc.Args(), fgc.Meter(), fgc.generator(0), [], {{}}, torch.zeros(2), None, dist=dist)
adv = ctx.advantages(r, group)
zero_std = torch.cat(ctx.stats["zero_std"])
ops = [float(dist.reduce(dist.rank + 1, op)) for op in ("sum", "min", "max")] + dist.gather(r[:1]).tolist()
torch.save({{"adv": adv, "zero_std": zero_std, "ops": ops}}, {str(tmp_path)!r} + f"/adv{{dist.rank}}.pt")
torch.distributed.destroy_process_group()  # gloo aborts at exit without it, now and then
""")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534",
               str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [torch.load(tmp_path / f"adv{rank}.pt") for rank in (0, 1)]
    r = torch.cat([torch.arange(8.0) ** 2, torch.arange(8.0) ** 2 + 5])
    whole = fgc.Context(None, fgc.Args(), fgc.Meter(), fgc.generator(0), [], {}, torch.zeros(2), None)
    expected = whole.advantages(r, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3] * 2))
    torch.testing.assert_close(torch.cat([g["adv"] for g in got]), expected)
    zero_std = [g["zero_std"].tolist() for g in got]
    assert zero_std[0] == zero_std[1] == torch.cat(whole.stats["zero_std"]).tolist() == [False] * 4
    assert got[0]["ops"] == got[1]["ops"] == [3.0, 1.0, 2.0, 0.0, 5.0], "reduce's sum, min, max; gather in rank order"


def test_benchmark_counts_the_work_of_one_iteration_and_splits_its_time_into_phases(tiny_cache, monkeypatch):
    """The benchmark times one iteration after a warm-up: its counts are those of one iteration of the method
    (passes of sampling and training, images, and the transitions update() trained: one group had equal rewards, so
    only the other's),
    and the reward's seconds are taken out of sampling's."""
    def slow_reward(images, metas, penalty):  # two seconds a call: far more than this tiny sampling takes
        time.sleep(2.0)
        return first_group_flat(images, metas, penalty)

    monkeypatch.setattr(fgc, "toy_strict_reward", slow_reward)
    result = benchmark_module().benchmark(tiny_args(tiny_cache, "unused", group_size=3, device="cpu"), repeat=1)
    assert result["transitions"] == 3 * 3, "the group with a spread: 3 trajectories x 3 trained steps"
    assert result["images"] == 2 * 3 and result["passes"] == 2 * 3 * 4 + 3 * 3, "2 prompts x group 3, 4 SDE steps; " \
        "then one pass a trained transition"
    assert all(result[k] > 0 for k in ("encode_s", "sample_s", "reward_s", "train_s")) and result["peak_rss_gb"] > 0
    assert result["reward_s"] >= 2.0 and result["sample_s"] < 2.0, "one reward call a flow_grpo iteration, in reward_s"


# ----------------------------------------------------------------------------------------------------
# real models: tiny random SD3 / FLUX pipelines and a tiny CLIP reward, built here with the real
# classes, saved to disk and loaded back through the script's loading code (no network)


def clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())  # a byte-level vocabulary without merges: 514 tokens
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def tiny_text_config(**kw):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                          projection_dim=32, max_position_embeddings=16, vocab_size=514, bos_token_id=512,
                          eos_token_id=513, pad_token_id=513, **kw)


@pytest.fixture(scope="session")
def tiny_real(tmp_path_factory):
    """Folders of a tiny SD3 pipeline, a tiny FLUX pipeline, a tiny CLIP reward model, a prompt file."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )

    root = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)

    def vae():
        return AutoencoderKL(block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8, sample_size=32,
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             scaling_factor=1.5, shift_factor=0.06)

    def t5():
        words = ["<pad>", "</s>", "<unk>", "▁", *"abcdefghijklmnopqrstuvwxyz"]
        return (T5EncoderModel(T5Config(vocab_size=32, d_model=32, d_ff=37, num_layers=2, num_heads=4, d_kv=8)),
                T5TokenizerFast(vocab=[(w, -1.0) for w in words], extra_ids=0, model_max_length=16))

    t5_model, t5_tok = t5()
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=32)
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae(),
        text_encoder=CLIPTextModelWithProjection(tiny_text_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(tiny_text_config()), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_model, tokenizer_3=t5_tok).save_pretrained(root / "sd3")
    t5_model, t5_tok = t5()
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    FluxPipeline(
        transformer=transformer, vae=vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        text_encoder=CLIPTextModel(tiny_text_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=t5_model, tokenizer_2=t5_tok).save_pretrained(root / "flux")
    vision = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8, "projection_dim": 32}
    CLIPModel(CLIPConfig(text_config=tiny_text_config().to_dict(), vision_config=vision,
                         projection_dim=32)).save_pretrained(root / "clip")
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=processor, tokenizer=clip_tokenizer()).save_pretrained(root / "clip")
    (root / "prompts.txt").write_text("".join(f"a photo of {w}\n" for w in
                                              ["a cat", "a dog", "two cups", "a red car", "a house", "a tree",
                                               "a bird", "a boat", "a lamp", "a clock", "a chair", "a ball"]))
    return root


def real_args(root, out, model="sd3", **kw):
    base = {"model": str(root / model), "reward": "pickscore", "reward_model": str(root / "clip"),
            "prompts": str(root / "prompts.txt"), "resolution": 32, "iterations": 1, "prompts_per_iter": 2,
            "group_size": 2, "steps": 4, "eval_steps": 2, "eval_every": 1, "out": str(out), "guidance": 0.0,
            "branch_steps": 1, "tweedie_substeps": 1, "chunks": "1,2", "base_cache": False}
    return fgc.resolved(fgc.Args(**{**base, **kw}))


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_every_method_trains_a_real_pipeline_a_sample_a_pass_and_its_lora_loads_into_diffusers(
        tiny_real, tmp_path, model, monkeypatch):
    """Every method trains the tiny pipeline with --micro-batch 1: in every phase (the chunk profile, sampling
    with its reward, evaluation) the transformer, the VAE's decoder and the reward see one sample a call, and in
    training the transformer sees one chunk a call (one sample but in Chunk-GRPO). The first inner step is
    on-policy, and the saved LoRA loads into a fresh pipeline with diffusers."""
    from diffusers import DiffusionPipeline

    phase, largest, load_policy = ["setup"], collections.Counter(), fgc.load_policy

    def record(part, n):
        largest[phase[0], part] = max(largest[phase[0], part], n)

    def in_phase(name, fn):
        def wrapped(*a, **kw):
            phase[0] = name
            return fn(*a, **kw)
        return wrapped

    def spied_policy(args, device):
        policy = load_policy(args, device)
        policy.net.register_forward_pre_hook(lambda module, inputs: record("transformer", len(inputs[0])))
        policy.pipe.vae.decoder.register_forward_pre_hook(lambda module, inputs: record("vae", len(inputs[0])))
        return policy

    monkeypatch.setattr(fgc, "load_policy", spied_policy)
    build_reward = fgc.build_reward
    monkeypatch.setattr(fgc, "build_reward", lambda *a: (lambda images, metas, score=build_reward(*a): record(
        "reward", len(images)) or score(images, metas)))
    for name, fn in [("chunk profile", fgc.chunk_sizes_of), ("training", fgc.update), ("evaluation", fgc.evaluate)]:
        monkeypatch.setattr(fgc, fn.__name__, in_phase(name, fn))
    for method, registered in fgc.METHODS.items():
        monkeypatch.setitem(fgc.METHODS, method, dataclasses.replace(registered, assign=in_phase("sampling",
                                                                                                registered.assign)))
    for method in fgc.METHODS:
        largest.clear()
        chunked = {"chunks": "auto", "num_chunks": 2} if method == "chunk" else {}  # 3 steps in 2 chunks
        history = fgc.train(real_args(tiny_real, tmp_path / method, model, method=method, micro_batch=1, **chunked))
        steps = [h for h in history if "reward_mean" in h]
        assert len(steps) == 1 and steps[0]["trained"] > 0 and np.isfinite(steps[0]["policy_loss"])
        assert abs(steps[0]["ratio_first"] - 1) < 1e-5
        assert [h["iteration"] for h in history if "eval_overall" in h] == [0, 1]
        expected = {(p, part) for p in ("sampling", "evaluation") for part in ("transformer", "vae", "reward")}
        expected |= {("training", "transformer")} | ({("chunk profile", "transformer")} if method == "chunk" else set())
        # a training pass holds whole chunks: Chunk-GRPO's largest, 2 steps, is one pass of 2 samples
        largest_chunk = max(history[0]["chunk_sizes"]) if method == "chunk" else 1
        assert largest.pop(("training", "transformer")) == largest_chunk, (method, largest)
        assert set(largest) == expected - {("training", "transformer")} and set(largest.values()) == {1}, largest
    assert max(history[0]["chunk_sizes"]) == 2
    run = next((tmp_path / "flow_grpo").iterdir())
    args = real_args(tiny_real, tmp_path, model)
    trained = fgc.load_policy(args, torch.device("cpu"))
    average = torch.load(run / "checkpoint.pt", weights_only=True)["ema"]["shadow_params"]
    with torch.no_grad():  # the saved LoRA is the moving average of the adapter weights
        for p, avg in zip(fgc.add_lora(trained, args), average, strict=True):
            p.copy_(avg)
    pipe = DiffusionPipeline.from_pretrained(tiny_real / model)
    pipe.load_lora_weights(run / "lora")  # diffusers' own loader reads the saved file
    fresh = fgc.PipelinePolicy(pipe, args, torch.device("cpu"))
    base = fgc.load_policy(args, torch.device("cpu"))
    x = torch.randn(trained.latent_shape(2))
    prompts = ["a photo of a cat", "a house"]
    t, cond = torch.tensor([0.9, 0.4]), trained.encode(prompts)
    with torch.no_grad():
        v_trained, v_fresh, v_base = (p.velocity(x, t, cond) for p in (trained, fresh, base))
    torch.testing.assert_close(v_fresh, v_trained, atol=1e-5, rtol=1e-4)
    assert (v_trained - v_base).abs().max() > 1e-6, "training changed the adapter"


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_every_method_trains_a_bf16_pipeline_on_policy_and_saves_an_fp32_lora(tiny_real, tmp_path, model):
    """--dtype bf16 (the CUDA default), run on the CPU: the transformer computes in bf16, every method's losses
    are finite, its first inner step is on-policy up to bf16 rounding (|ratio - 1| < 1e-3, the toy's clip
    range; the sampling and training passes see different batches), and the adapter trains and saves in fp32."""
    from safetensors.torch import load_file

    for method in fgc.METHODS:
        history = fgc.train(real_args(tiny_real, tmp_path / method, model, method=method, dtype="bf16"))
        step = next(h for h in history if "reward_mean" in h)
        assert step["trained"] > 0 and all(np.isfinite(step[k]) for k in ("policy_loss", "grad_norm", "approx_kl"))
        assert abs(step["ratio_first"] - 1) < 1e-3, (method, step["ratio_first"])
        run = next((tmp_path / method).iterdir())
        lora = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
        checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
        assert lora and {v.dtype for v in lora.values()} == {torch.float32}
        assert {v.dtype for v in [*checkpoint["lora"].values(), *checkpoint["ema"]["shadow_params"]]} == {torch.float32}
    policy = fgc.load_policy(real_args(tiny_real, "x", model, dtype="bf16"), torch.device("cpu"))
    assert policy.net.dtype == torch.bfloat16


def test_torchrun_trains_a_real_pipeline_in_step_and_its_ranks_issue_the_same_collectives(tiny_real, tmp_path):
    """Two gloo ranks train the tiny SD3 pipeline with a KL term, one sample a pass and the low-memory recipe
    (gradient checkpointing under DDP), with Flow-GRPO and with TempFlow's branching: both ranks end with the
    same adapter, which training moved. Every collective the script issues (op, shapes, dtypes, devices) is
    logged: both ranks issue the same sequence, every tensor is on the rank's device, evaluation issues none."""
    script = tmp_path / "ddp_real.py"
    script.write_text(f"""import json, os, sys, torch
sys.path.insert(0, {str(HERE)!r})
import flow_grpo_credit as fgc
from test_flow_grpo_credit import real_args
from pathlib import Path
log, phase, params, init = [], ["train"], [], []
real_add_lora, real_evaluate = fgc.add_lora, fgc.evaluate

def add_lora(policy, args):
    params[:] = real_add_lora(policy, args)
    init[:] = [p.detach().clone() for p in params]
    return params

def evaluate(*a, **kw):
    phase[0] = "evaluation"
    try:
        return real_evaluate(*a, **kw)
    finally:
        phase[0] = "train"

def logged(name, op):
    def wrapped(*a, **kw):
        tensors = [t for x in a for t in (x if isinstance(x, list) else [x]) if isinstance(t, torch.Tensor)]
        log.append([phase[0], name, [[list(t.shape), str(t.dtype), str(t.device)] for t in tensors]])
        return op(*a, **kw)
    return wrapped

for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce", "gather"):
    setattr(torch.distributed, name, logged(name, getattr(torch.distributed, name)))
fgc.add_lora, fgc.evaluate = add_lora, evaluate
rank, out = int(os.environ["RANK"]), {{}}
for method in ("flow_grpo", "tempflow"):
    log.clear()
    fgc.train(real_args(Path({str(tiny_real)!r}), {str(tmp_path / 'runs')!r}, method=method, iterations=2,
                        eval_every=2, beta=0.1, micro_batch=1, low_memory=True, device="cpu"))
    out[method] = {{"log": list(log), "moved": any(not torch.equal(p, q) for p, q in zip(params, init)),
                   "weights": [p.detach().clone() for p in params]}}
torch.save(out, {str(tmp_path)!r} + f"/rank{{rank}}.pt")
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29535",
               str(script)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for method in ("flow_grpo", "tempflow"):
        a, b = (r[method] for r in ranks)
        assert a["moved"] and b["moved"], "training moved the adapter"
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True)), method
        assert a["log"] == b["log"] and len(a["log"]) > 10, "the same collectives in the same order"
        ops = {op for _, op, _ in a["log"]}
        assert {"all_reduce", "all_gather"} <= ops, ops
        assert {device for _, _, tensors in a["log"] for _, _, device in tensors} == {"cpu"}
        assert not [entry for entry in a["log"] if entry[0] == "evaluation"], "rank 0 evaluates alone"


def test_real_time_grids_come_from_the_pipelines_schedulers(tiny_real):
    sd3 = fgc.load_policy(real_args(tiny_real, "x"), torch.device("cpu"))
    shift = 3.0  # SD3's static shift: sigma' = s*sigma / (1 + (s-1)*sigma) of the linear grid, up to the
    lin = fgc.shifted_grid(10)[:-1]  # scheduler's sigma_min (the last step moves by < 6e-3)
    torch.testing.assert_close(sd3.time_grid(10)[:-1], shift * lin / (1 + (shift - 1) * lin), atol=6e-3, rtol=0)
    flux = fgc.load_policy(real_args(tiny_real, "x", "flux"), torch.device("cpu"))
    grid = flux.time_grid(10)
    assert grid[0] == 1 and grid[-1] == 0 and (grid[1:] < grid[:-1]).all()
    assert not torch.allclose(grid, fgc.shifted_grid(10))


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_the_deterministic_rollout_reproduces_the_pipelines_own_latents(tiny_real, model):
    """From the same starting noise, with the same steps and guidance (SD3: real CFG at 4.5 against the ""
    prompt; FLUX: the distilled scale 3.5 as an input), the ODE rollout ends on the latents that
    StableDiffusion3Pipeline and FluxPipeline return with output_type="latent", and the evaluation's images
    are the pipelines' decoded ones (output_type="pt"), both up to float rounding."""
    args = real_args(tiny_real, "x", model)
    policy = fgc.load_policy(args, torch.device("cpu"))
    prompts, steps = ["a photo of a cat", "a house"], 4
    noise = torch.randn(policy.latent_shape(2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = fgc.rollout(policy, policy.encode(prompts), noise, policy.time_grid(steps), [False] * steps, args,
                           fgc.Meter()).states[:, -1]
        theirs = policy.pipe(prompts, latents=noise.clone(), num_inference_steps=steps, height=32, width=32,
                             guidance_scale=policy.cfg if model == "sd3" else 3.5, output_type="latent").images
    assert theirs.shape == ours.shape and (ours - noise).abs().mean() > 0.1, "the rollout moved far from the noise"
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    metas = [{"prompt": p, "tag": "prompt"} for p in prompts]
    images = fgc.evaluate(policy, dataclasses.replace(args, eval_steps=steps), lambda im, m: im.mean((1, 2, 3)),
                          metas)[1]
    eval_noise = fgc.initial_noise(policy, 2, fgc.generator("eval-noise"))
    with torch.no_grad():
        decoded = policy.pipe(prompts, latents=eval_noise, num_inference_steps=steps, height=32, width=32,
                              guidance_scale=policy.cfg if model == "sd3" else 3.5, output_type="pt").images
    torch.testing.assert_close(images, decoded, atol=1e-4, rtol=1e-4)


def test_the_prompt_cache_keeps_the_most_recently_used_prompts_up_to_its_size(tiny_real, monkeypatch):
    """The cache is bounded: past `cache_size` prompts the least recently used one goes, and a prompt
    used again moves to the end; an evaluation runs the text encoders once for all its prompts."""
    policy = fgc.load_policy(real_args(tiny_real, "x", low_memory=True), torch.device("cpu"))
    monkeypatch.setattr(policy, "cache_size", 3)
    policy.encode(["a", "b", "c"])
    policy.encode(["a", "d"])
    assert list(policy.cache) == ["c", "a", "d"], "b went first: a was used again"
    moves = []
    monkeypatch.setattr(policy.encoders, "to", lambda device: moves.append(str(device)) or policy.encoders)
    args = real_args(tiny_real, "x", eval_steps=1, micro_batch=1)
    metas = [{"prompt": f"prompt {i}", "tag": "prompt"} for i in range(5)]
    fgc.evaluate(policy, args, lambda images, metas: images.mean((1, 2, 3)), metas)
    assert moves == ["cpu", "cpu"], "one trip of the text encoders to the device and back (here the CPU)"
    assert len(policy.cache) == 3


def test_prompt_embeddings_are_encoded_once_and_cached_on_the_cpu(tiny_real, monkeypatch):
    """Each prompt goes through the text encoders once (the negative "" when the policy is made); the
    cache lives on the CPU and encode() hands the embeddings out batch-first on the policy's device."""
    policy = fgc.load_policy(real_args(tiny_real, "x"), torch.device("cpu"))
    encoded, real = [], policy.pipe.encode_prompt

    def spy(prompt, *rest, **kw):
        encoded.append(list(prompt))
        return real(prompt, *rest, **kw)

    monkeypatch.setattr(policy.pipe, "encode_prompt", spy)
    first = policy.encode(["a cat", "a dog", "a cat"])
    again = policy.encode(["a dog", "a tree"])
    assert encoded == [["a cat", "a dog"], ["a tree"]]
    assert set(policy.cache) == {"a cat", "a dog", "a tree", ""}
    assert all(e.device.type == "cpu" for entry in policy.cache.values() for e in entry.values())
    assert first["encoder_hidden_states"].shape[0] == 3 and first["pooled_projections"].shape[0] == 3
    torch.testing.assert_close(first["encoder_hidden_states"][1], again["encoder_hidden_states"][0])
    torch.testing.assert_close(first["encoder_hidden_states"][0], first["encoder_hidden_states"][2])


def test_a_resolution_the_model_cannot_hold_is_a_one_line_usage_error(tiny_real, tmp_path):
    """The tiny SD3 has VAE scale 2, patch size 2 and a 32-patch position embedding: --resolution must be
    a multiple of 4 and at most 128. The largest one runs; one patch more is beyond what the transformer
    itself accepts; anything else is a one-line UsageError, and exit status 2 from the CLI."""
    args = real_args(tiny_real, tmp_path / "runs")
    policy = fgc.load_policy(args, torch.device("cpu"))
    step = policy.pipe.vae_scale_factor * policy.net.config.patch_size
    largest = policy.net.config.pos_embed_max_size * step
    assert (step, largest) == (4, 128)
    for resolution, needle in [(largest - 2, f"a multiple of {step}"), (largest + step, f"at most {largest}"),
                               (step // 2, f"a multiple of {step}")]:
        with pytest.raises(fgc.UsageError, match=re.escape(needle)) as err:
            fgc.PipelinePolicy(policy.pipe, dataclasses.replace(args, resolution=resolution), torch.device("cpu"))
        assert "\n" not in str(err.value) and f"--resolution {resolution}" in str(err.value)
    big = fgc.PipelinePolicy(policy.pipe, dataclasses.replace(args, resolution=largest), torch.device("cpu"))
    cond = big.encode(["a cat"])
    with torch.no_grad():
        assert big.forward(torch.randn(big.latent_shape(1)), torch.tensor([0.5]), cond).shape == big.latent_shape(1)
        too_big = torch.randn(1, 4, largest // 2 + step // 2, largest // 2 + step // 2)
        with pytest.raises(ValueError):
            big.forward(too_big, torch.tensor([0.5]), cond)
    flags = ["--model", args.model, "--reward", "pickscore", "--reward-model", args.reward_model, "--prompts",
             args.prompts, "--resolution", "30", "--iterations", "1", "--out", args.out]
    proc = subprocess.run([sys.executable, SCRIPT, *flags], check=False, capture_output=True, text=True, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == proc.stderr.strip().splitlines()[-1:], proc.stderr
    assert errors[0].startswith("error: --resolution 30: this model needs a multiple of 4")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run folder is left"


def test_benchmark_of_a_real_pipeline_counts_cfg_passes(tiny_real):
    """The benchmark on the tiny SD3 (real CFG: two forward passes a step): counts of passes, images and trained
    transitions of one iteration, the CPU's peak memory (no CUDA figures) and every phase's seconds."""
    result = benchmark_module().benchmark(real_args(tiny_real, "unused", device="cpu"), repeat=1)
    images, passes = 2 * 2, 2 * 2 * 4 * 2 + 2 * 2 * 3 * 2  # sampling, then the 3 trained steps of each image
    assert result["images"] == images and result["passes"] == passes, "2 prompts x group 2, 4 steps, 2 passes a step"
    assert result["transitions"] == images * 3
    assert result["peak_rss_gb"] > 0 and "peak_allocated_gb" not in result
    assert all(result[k] > 0 for k in ("encode_s", "sample_s", "reward_s", "train_s", "images_per_s"))


def test_clip_rewards_follow_their_formulas_and_weighted_sums_add(tiny_real):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    images = (torch.rand(3, 3, 32, 32) * 255).round() / 255
    metas = [{"prompt": p} for p in ["a cat", "two cups", "a red car"]]
    args = real_args(tiny_real, "x")
    cpu = torch.device("cpu")
    pick = fgc.build_reward(args, cpu)(images, metas)
    clip = fgc.build_reward(dataclasses.replace(args, reward="clip"), cpu)(images, metas)
    model, proc = CLIPModel.from_pretrained(tiny_real / "clip"), CLIPProcessor.from_pretrained(tiny_real / "clip")
    pil = [Image.fromarray((im.permute(1, 2, 0) * 255).byte().numpy()) for im in images]
    inputs = proc(text=[m["prompt"] for m in metas], images=pil, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)
    torch.testing.assert_close(pick, model.logit_scale.exp().detach() * cos / 26, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(clip, 2.5 * cos.clamp_min(0), atol=1e-4, rtol=1e-4)
    named = f"pickscore={tiny_real / 'clip'},clip={tiny_real / 'clip'}"
    both = fgc.build_reward(dataclasses.replace(args, reward="pickscore:0.7,clip:0.3", reward_model=named), cpu)
    torch.testing.assert_close(both(images, metas), 0.7 * pick + 0.3 * clip)


def test_bad_real_inputs_are_one_line_errors(tiny_real, tmp_path):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
    from transformers import CLIPTextModel

    DDPMPipeline(UNet2DModel(block_out_channels=(8, 8), norm_num_groups=4, sample_size=8,
                             down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2),
                 DDPMScheduler()).save_pretrained(tmp_path / "ddpm")
    CLIPTextModel(tiny_text_config()).save_pretrained(tmp_path / "text_only")
    cases = [({"model": str(tmp_path / "missing")}, "no such folder"),
             ({"model": str(tmp_path / "ddpm")}, "is a DDPMPipeline"),
             ({"reward": "pickscore:heavy"}, "weights must be numbers"),
             ({"reward": "aesthetic"}, "unknown reward 'aesthetic'"),
             ({"reward_model": str(tmp_path / "text_only")}, "needs a CLIP model"),
             ({"reward": "toy"}, "--reward toy scores the built-in toy prompts"),
             ({"reward": "toy-strict"}, "--reward toy scores the built-in toy prompts"),
             ({"prompts": str(tmp_path / "none.txt")}, "--prompts"),
             ({"resolution": 30}, "--resolution 30: this model needs a multiple of 4"),
             ({"dtype": "fp8"}, "unknown --dtype 'fp8'")]
    for overrides, needle in cases:
        with pytest.raises(fgc.UsageError, match=re.escape(needle)) as err:
            fgc.train(real_args(tiny_real, tmp_path / "runs", **overrides))
        assert "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "nothing half-written"


# ----------------------------------------------------------------------------------------------------
# measured with the shipped toy base model


def test_the_shipped_base_model_loads_by_default_and_scores_as_the_readme_states():
    """A fresh clone starts from the shipped weights (no pretraining): assets/toy_base, loaded by default, scores
    the README's base values on the fixed held-out set (to within float differences between CPUs): it draws what
    it is asked (at least half of its images without an extra object are strictly correct) and carries its one
    flaw, an unasked object in about a third of its images."""
    args = fgc.Args()
    assert not args.toy_base and (fgc.TOY_BASE / "unet" / "diffusion_pytorch_model.safetensors").exists()
    size = sum(f.stat().st_size for f in fgc.TOY_BASE.rglob("*") if f.is_file())
    assert size < 10e6, f"the shipped base is {size / 1e6:.1f} MB"
    stated = re.search(r"it scores\s+(\S+) under GenEval's rule and (\S+) under the strict rule; (\S+)% of its images",
                       (HERE / "README.md").read_text())
    overall, strict, extra = float(stated[1]), float(stated[2]), float(stated[3]) / 100
    metrics, _, _, scores = fgc.evaluate(fgc.load_toy(args, torch.device("cpu")), args)
    assert metrics["eval_strict"] == pytest.approx(strict, abs=0.01)
    assert metrics["eval_overall"] == pytest.approx(overall, abs=0.01)
    assert metrics["eval_extra"] == pytest.approx(extra, abs=0.01) and 0.25 < metrics["eval_extra"] < 0.4
    assert scores["strict"][scores["extra"] == 0].mean() >= 0.5


def test_a_short_grpo_run_raises_the_reward_of_its_prompts():
    """Flow-GRPO for 12 iterations on two prompts raises their deterministic (ODE, fixed-noise) reward:
    the whole pipeline learns, measured, not just runs. The reward is a smooth one, how red the image
    is, so the margin does not hang on the pretrained weights, which differ slightly between CPUs
    (toy-GenEval gains are measured by the README's benchmark runs instead)."""
    args = fgc.resolved(fgc.Args(prompts_per_iter=2, group_size=8, inner_updates=4, lr=2e-3))  # faster at 2e-3
    policy = fgc.load_toy(args, torch.device("cpu"))
    opt = torch.optim.AdamW(fgc.add_lora(policy, args), lr=args.lr, weight_decay=args.weight_decay)
    metas = fgc.eval_prompts(1)[:2]
    cond, grid = policy.encode([m["prompt"] for m in metas]), fgc.shifted_grid(args.steps)

    def redness(images, metas):  # (N, 3, H, W) -> (N,): red channel minus the mean of the others
        return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))

    def ode_reward(n=16):
        prompt = torch.arange(len(metas)).repeat_interleave(n)
        x = fgc.initial_noise(policy, len(prompt), fgc.generator("held-out noise"))
        prompt_cond = {k: v[prompt] for k, v in cond.items()}
        traj = fgc.rollout(policy, prompt_cond, x, grid, [False] * args.steps, args, fgc.Meter())
        return redness(policy.decode(traj.states[:, -1]), None).mean().item()

    before = ode_reward()
    for it in range(12):
        ctx = fgc.Context(policy, args, fgc.Meter(), fgc.generator("test-rollout", it), metas, cond, grid, redness)
        transitions, _ = fgc.flow_grpo(ctx)
        fgc.update(policy, opt, cond, transitions, args, ctx.gen)
    after = ode_reward()
    print(f"redness of the trained prompts' ODE samples: {before:.3f} -> {after:.3f}")
    assert after > before + 0.04


def test_a_finished_run_writes_its_record_and_the_same_command_again_trains_nothing(tiny_cache, tmp_path,
                                                                                   monkeypatch, capsys):
    """A run of --run FOLDER writes record.json, atomically: its label (the method and the flags off its
    defaults), flags, cost, machine, the script's git object id, the base's evaluation and every later one with
    per-pair scores (a curve point on 3 of each category's 9 pairs, its gain paired with the base's). The same
    command again exits at once and trains nothing."""
    args = tiny_args(tiny_cache, tmp_path, method="g2rpo", granularities="1", iterations=2, eval_every=1,
                     eval_per_tag=9, curve_per_tag=2, run=str(tmp_path / "run"))
    history = fgc.train(args)
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["label"].startswith("g2rpo:") and "granularities=1" in record["label"].split(":")
    assert "seed" not in record["label"] and "run=" not in record["label"] and record["args"]["granularities"] == "1"
    assert (record["iterations"], record["nfe"], record["threads"]) == (2, history[-1]["nfe"], torch.get_num_threads())
    git_id = subprocess.run(["git", "hash-object", fgc.__file__], capture_output=True, text=True).stdout.strip()
    assert record["code"] == git_id and record["torch"] == torch.__version__ and record["cpu"]
    assert [e["iteration"] for e in record["evaluations"]] == [1, 2] and len(record["training"]["reward_mean"]) == 2
    base, (curve, end) = record["base"], record["evaluations"]
    chosen = [category * 9 + j for category in range(6) for j in (0, 4, 8)]
    assert curve["scores"]["pair"] == chosen and end["scores"]["pair"] == list(range(54)) == base["scores"]["pair"]
    tags = [fgc.eval_prompts(9)[i]["tag"] for i in chosen]
    gain = torch.tensor(curve["scores"]["strict"]) - torch.tensor(base["scores"]["strict"])[chosen]
    assert curve["gain_strict"] == pytest.approx(fgc.by_category(gain.double(), tags)[0])
    assert not list((tmp_path / "run").glob("*.tmp*"))
    monkeypatch.setattr(fgc, "setup", lambda *a: pytest.fail("a finished run loaded its model again"))
    capsys.readouterr()
    assert fgc.train(args) == history and "finished already" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "record.json").read_text()) == record


def test_a_killed_run_started_again_ends_with_the_record_of_an_unbroken_one(tiny_cache, tmp_path, monkeypatch):
    """Killed in iteration 3 (no record), the same command resumes from the checkpoint and writes the record that
    the unbroken run writes (but for its seconds)."""
    def record_of(run):
        record = json.loads((run / "record.json").read_text())
        evaluations = [e | {"wall_s": None} for e in [record["base"], *record["evaluations"]]]
        return record | {"seconds": None, "args": record["args"] | {"run": None}, "evaluations": evaluations}

    fgc.train(tiny_args(tiny_cache, tmp_path, iterations=4, eval_every=2, run=str(tmp_path / "unbroken")))
    real, calls = fgc.METHODS["flow_grpo"], {"n": 0}

    def dies_in_iteration_3(ctx):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as a kill: no record
        return real.assign(ctx)

    args = tiny_args(tiny_cache, tmp_path, iterations=4, eval_every=2, run=str(tmp_path / "killed"))
    monkeypatch.setitem(fgc.METHODS, "flow_grpo", dataclasses.replace(real, assign=dies_in_iteration_3))
    with pytest.raises(KeyboardInterrupt):
        fgc.train(args)
    assert not (tmp_path / "killed" / "record.json").exists()
    monkeypatch.setitem(fgc.METHODS, "flow_grpo", real)
    fgc.train(args)
    assert record_of(tmp_path / "killed") == record_of(tmp_path / "unbroken")


def test_a_cached_base_gives_the_gains_of_a_base_evaluated_in_the_run(tiny_cache, tmp_path, monkeypatch):
    """The base's evaluation is cached under a key of all that determines it: a second run of other training flags
    reuses it (evaluate is not called for it) and logs what a run that evaluates its base logs; other evaluation
    flags miss the cache."""
    cache = tmp_path / "cache"  # no base evaluated yet
    kw = {"cache_dir": str(cache), "iterations": 2, "eval_every": 1, "eval_per_tag": 3}
    fgc.train(tiny_args(tiny_cache, tmp_path / "first", base_cache=True, **kw))
    assert len(list((cache / "base_eval").glob("*.pt"))) == 1
    fresh = fgc.train(tiny_args(tiny_cache, tmp_path / "fresh", lr=1e-2, **kw))
    real, calls = fgc.evaluate, []
    monkeypatch.setattr(fgc, "evaluate", lambda *a, **k: calls.append(k.get("pairs")) or real(*a, **k))
    cached = fgc.train(tiny_args(tiny_cache, tmp_path / "cached", lr=1e-2, base_cache=True, **kw))
    assert strip_time(cached) == strip_time(fresh) and len(calls) == 2, "the base's evaluation came from the cache"
    fgc.train(tiny_args(tiny_cache, tmp_path / "other", base_cache=True, **(kw | {"eval_steps": 3})))
    assert len(list((cache / "base_eval").glob("*.pt"))) == 2


def test_a_run_that_an_error_stops_leaves_a_record_that_names_it(tiny_cache, tmp_path, monkeypatch):
    """Non-finite rewards in every iteration stop the run; its record says so and where, and the same command
    tries again (it does not count as finished)."""
    monkeypatch.setattr(fgc, "toy_strict_reward", lambda images, metas, penalty: torch.full((len(images),), torch.nan))
    args = tiny_args(tiny_cache, tmp_path, iterations=5, run=str(tmp_path / "run"))
    with pytest.raises(fgc.RunError):
        fgc.train(args)
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["error"].startswith("RunError: stopped at iteration 3") and record["iteration"] == 3
    with pytest.raises(fgc.RunError):
        fgc.train(args)


# ----------------------------------------------------------------------------------------------------
# the preference world: the gold (toy_gold), and the proxy notebooks/toy_pref.py trained (assets/toy_pref)

TOY_PREF = HERE / "assets" / "toy_pref"


def one_square(color="red", corner=(4, 3)):
    """(a prompt asking for one `color` square, an image (1, 3, RES, RES) of exactly that square at `corner`)."""
    item = {"class": "square", "count": 1, "color": color}
    meta = {"tag": "colors", "include": [item], "prompt": f"a {color} square"}
    img, (x, y) = torch.zeros(1, 3, fgc.RES, fgc.RES), corner
    img[0, :, y:y + toy_base.SHAPE_SIZE, x:x + toy_base.SHAPE_SIZE] = torch.tensor(fgc.COLORS[color])[:, None, None]
    return meta, img


def test_gold_is_strict_plus_half_dense_minus_the_charge_plus_cleanliness():
    """A clean correct image scores 1 + 1/2 + 1; an off-palette pixel lowers the cleanliness term alone, by its
    distance to the palette over sqrt(5)/2 over the pixel count; an extra square costs strict's 1 and the charge; an
    empty image keeps only cleanliness and pays the charge for the missing square."""
    meta, clean = one_square()

    def gold(images, charge=0.5):
        scores = fgc.score_batch(images, [meta] * len(images))
        return fgc.toy_gold(scores, fgc.colour_cleanliness(images), charge).item()

    assert gold(clean) == pytest.approx(2.5)
    smudged = clean.clone()
    smudged[0, :, 14, 14] = torch.tensor([0.5, 1.0, 1.0])  # the farthest colour from the palette: distance sqrt(5)/2
    smudged[0, :, 0, 0] = torch.tensor([0.0, 0.0, 0.3])  # 0.3 from black
    cleanliness = 1 - (1 + 0.3 / (math.sqrt(5) / 2)) / fgc.RES ** 2
    assert fgc.colour_cleanliness(smudged).item() == pytest.approx(cleanliness, abs=1e-6)
    assert gold(smudged) == pytest.approx(1.5 + cleanliness, abs=1e-6)  # single pixels: no object, scores as clean
    extra = clean + one_square("blue", corner=(10, 10))[1]
    for charge in (0.5, 0.3):
        assert gold(extra, charge) == pytest.approx(2.5 - 1 - charge)
        assert gold(torch.zeros_like(clean), charge) == pytest.approx(1 - charge)
    rng = random.Random(6)
    metas = [fgc.make_prompt(tag, rng) for tag in fgc.TAGS for _ in range(20)]
    images = as_images([toy_base.render(m, rng) for m in metas])  # every category: the gold's maximum
    gold = fgc.toy_gold(fgc.score_batch(images, metas), fgc.colour_cleanliness(images))
    torch.testing.assert_close(gold, torch.full((120,), 2.5))


def least_significant_count(n: int, alpha: float = 1e-3) -> int:
    """The least k with P(X >= k) < alpha for X ~ Binomial(n, 1/2): k of n correct is no coin's luck."""
    return next(k for k in range(n + 1) if sum(math.comb(n, j) for j in range(k, n + 1)) / 2 ** n < alpha)


def worse_versions(meta: dict, img: np.ndarray, rng: random.Random) -> dict[str, np.ndarray]:
    """`img` (ground truth of `meta`) made worse by name: 'erased' (its first shape blanked), 'extra' (one more
    shape, where there is room) and 'smear' (a 6 x 6 block pulled half-way to grey: no pixel changes its nearest
    colour, so it costs cleanliness alone)."""
    first = fgc.detect(img)[0]
    (cx, cy), (w, h) = first.centre, first.size
    erased = img.copy()
    erased[int(cy - h / 2):int(cy + h / 2), int(cx - w / 2):int(cx + w / 2)] = 0
    smeared, (x, y) = img.copy(), (rng.randrange(fgc.RES - 5), rng.randrange(fgc.RES - 5))
    smeared[y:y + 6, x:x + 6] = 0.5 * smeared[y:y + 6, x:x + 6] + 0.25
    worse = {"erased": erased, "extra": with_extra_shape(img, meta, rng), "smear": smeared}
    return {kind: w for kind, w in worse.items() if w is not None}


def test_the_shipped_proxy_loads_through_clip_reward_and_prefers_the_gold_better_image():
    """assets/toy_pref scores through the script's pickscore path. On pairs of held-out-like prompts' ground truth
    and the same image made worse (worse_versions), the gold prefers the ground truth; so does the proxy, for each
    way of making it worse (the smear: the gold's taste term alone) in more pairs than a coin would within p < 1e-3.
    A caption scores alike alone and beside longer captions: the proxy's tokenizer ends each caption with the id CLIP
    pools the text at, which the longest caption of a padded batch would otherwise lack."""
    reward = fgc.clip_reward("pickscore", str(TOY_PREF), "cpu")
    rng = random.Random(7)
    metas, good, bad, kinds = [], [], [], []
    for meta in (fgc.make_prompt(tag, rng) for tag in fgc.TAGS for _ in range(12)):
        img = toy_base.render(meta, rng)
        for kind, worse in worse_versions(meta, img, rng).items():
            metas.append(meta)
            good.append(img)
            bad.append(worse)
            kinds.append(kind)
    good, bad = as_images(good), as_images(bad)
    gold = [fgc.toy_gold(fgc.score_batch(images, metas), fgc.colour_cleanliness(images)) for images in (good, bad)]
    assert (gold[0] > gold[1]).all()
    with torch.no_grad():
        s_good, s_bad = reward(good, metas), reward(bad, metas)
        alone = torch.cat([reward(good[i:i + 1], metas[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(alone, s_good[:6], atol=1e-5, rtol=1e-5)
    right = collections.Counter(kind for kind, ok in zip(kinds, (s_good > s_bad).tolist()) if ok)
    counts = collections.Counter(kinds)
    print({kind: f"{right[kind]} of {n}" for kind, n in counts.items()})
    for kind in ("erased", "extra", "smear"):
        assert right[kind] >= least_significant_count(counts[kind]), (kind, right[kind], counts[kind])


def test_the_shipped_proxy_orders_held_out_pairs_of_base_samples_as_the_gold_does_above_chance():
    """384 held-out prompts, two base samples each (the evaluation's ODE, noise the proxy never saw): the proxy orders
    the pairs as the gold does in more of them than a coin would within p < 1e-3 (its report: 67% of 1,536)."""
    policy, metas = fgc.load_toy(fgc.Args(), "cpu"), fgc.eval_prompts(64)
    images = notebook_module("toy_pref").sample_pairs(policy, metas, fgc.generator("proxy-test-noise"), steps=10)
    doubled = [m for m in metas for _ in range(2)]  # rows 2i and 2i + 1: prompt i's pair
    gold = fgc.toy_gold(fgc.score_batch(images, doubled), fgc.colour_cleanliness(images)).view(-1, 2)
    with torch.no_grad():
        proxy = fgc.build_reward(fgc.Args(reward="toy-pref"), torch.device("cpu"))(images, doubled).view(-1, 2)
    ordered = gold[:, 0] != gold[:, 1]
    agree = int(((proxy[:, 0] > proxy[:, 1]) == (gold[:, 0] > gold[:, 1]))[ordered].sum())
    print(f"the proxy orders {agree} of {int(ordered.sum())} pairs as the gold does")
    assert agree >= least_significant_count(int(ordered.sum()))


def test_the_proxy_recipe_writes_a_folder_under_1_mb_that_the_script_scores_as_the_recipe_did(tmp_path):
    """notebooks/toy_pref.py at a tiny size: its weights stay under 1 MB, its own check passes (the held-out scores
    through the script's clip_reward equal those of the model it trained), its model's config is the shipped one's
    (no path of the machine that made it), --reward pickscore --reward-model FOLDER loads the folder, and a folder
    that exists is refused."""
    recipe = notebook_module("toy_pref")
    out = tmp_path / "proxy"
    assert recipe.main(["--out", str(out), "--prompts", "40", "--heldout-per-tag", "2", "--epochs", "1"]) == 0
    made, shipped = (json.loads((folder / "config.json").read_text()) for folder in (out, TOY_PREF))
    assert {**made, "transformers_version": None} == {**shipped, "transformers_version": None}
    report = json.loads((out / "report.json").read_text())
    assert report["weights_bytes"] == (out / "model.safetensors").stat().st_size <= 1_000_000
    assert (report["train_pairs"], report["val_pairs"], report["heldout_pairs"]) == (36, 4, 12)
    metas = fgc.eval_prompts(1)
    images = torch.rand(len(metas), 3, fgc.RES, fgc.RES, generator=fgc.generator("recipe-test"))
    reward = fgc.build_reward(fgc.Args(reward="pickscore", reward_model=str(out)), torch.device("cpu"))
    with torch.no_grad():
        scores = reward(images, metas)
    assert scores.shape == (len(metas),) and scores.std() > 0, "a score of its own for each image"
    assert recipe.main(["--out", str(out)]) == 2


def test_a_run_under_toy_pref_logs_the_gold_its_terms_and_the_kl_to_the_base(tiny_cache, tmp_path):
    """Every toy evaluation reports the gold (toy_gold of each image, its mean eval_gold, its paired gain), the taste
    term and the images missing an asked object; under --reward toy-pref eval_reward is the proxy's mean (the record
    keeps it and the gold per pair), and --eval-kl adds the KL to the base: 0 at the start, where the adapter is 0,
    positive once trained."""
    args = tiny_args(tiny_cache, tmp_path, iterations=2, lr=1e-2, reward="toy-pref", eval_kl=True, eval_every=1)
    history = fgc.train(args)
    run = next(tmp_path.iterdir())
    evals = [h for h in history if "eval_overall" in h]
    base, held_out = torch.load(run / "scores_0000.pt", weights_only=True), fgc.eval_prompts(args.eval_per_tag)
    assert [h["iteration"] for h in evals] == [0, 1, 2]
    assert evals[0]["eval_kl"] == 0 and evals[-1]["eval_kl"] > 0
    for h in evals:
        scores = torch.load(run / f"scores_{h['iteration']:04d}.pt", weights_only=True)
        expected = (scores["strict"] + scores["dense"] / 2 - 0.5 * (scores["extra"] + scores["missing"])
                    + scores["taste"])
        torch.testing.assert_close(scores["gold"], expected)
        assert h["eval_gold"] == pytest.approx(float(scores["gold"].mean()))
        assert h["eval_taste"] == pytest.approx(float(scores["taste"].mean()))
        assert h["eval_missing"] == pytest.approx(float((scores["missing"] > 0).float().mean()))
        assert h["eval_reward"] == pytest.approx(float(scores["reward"].mean()))
        tags = [held_out[i]["tag"] for i in scores["pair"].tolist()]
        for key in ("reward", "gold"):  # the proxy's and the gold's gains, paired on the evaluation's pairs
            diff = (scores[key] - base[key][scores["pair"]]).double()
            per_tag = [diff[[i for i, t in enumerate(tags) if t == tag]] for tag in dict.fromkeys(tags)]
            assert h[f"gain_{key}"] == pytest.approx(float(sum(d.mean() for d in per_tag) / len(per_tag)))
            se = math.sqrt(sum(float(((d - d.mean()) ** 2).mean()) / len(d) for d in per_tag)) / len(per_tag)
            assert h[f"gain_{key}_se"] == pytest.approx(se)
        assert h["gain_gold"] != 0 or not h["iteration"]
    record = json.loads((run / "record.json").read_text())
    assert record["args"]["reward"] == "toy-pref"
    for kept in [record["base"], *record["evaluations"]]:  # the proxy's and the gold's per-pair scores, to 4 digits
        scores = torch.load(run / f"scores_{kept['iteration']:04d}.pt", weights_only=True)
        for key in ("reward", "gold"):
            assert kept["scores"][key] == pytest.approx(scores[key].tolist(), abs=5e-5)


# ----------------------------------------------------------------------------------------------------
# notebooks: each runs top to bottom as shipped, and its exercise checks can both fail and pass


def run_notebook(name: str) -> tuple[list[str], dict[tuple[str, str], str], list[str]]:
    """Execute notebooks/<name> top to bottom as shipped (a cell error raises CellExecutionError); then, in the same
    kernel, each exercise cell and its checks with each wrong answer of notebooks/solutions.py in place of the
    exercise; then every cell from the first exercise to the end with the solutions in place of the exercises.
    Returns what the check cells printed: as shipped, with each (exercise, wrong answer), and solved."""
    import nbformat
    from nbclient import NotebookClient

    folder = HERE / "notebooks"
    nb = nbformat.read(folder / name, as_version=4)
    exercises = [i for i, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", [])]
    checks = [i for i, c in enumerate(nb.cells) if "check" in c.metadata.get("tags", [])]
    by_name = solutions.SOLUTIONS[name]
    assert checks and {nb.cells[i].metadata["exercise"] for i in exercises} == set(by_name)

    def printed(cells):
        return ["".join(o.get("text", "") for o in nb.cells[i].outputs) for i in cells]

    client = NotebookClient(nb, kernel_name="python3", timeout=900, resources={"metadata": {"path": str(folder)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        shipped, wrong = printed(checks), {}

        def with_exercise(i: int, source: str) -> str:  # exercise cell i as `source`, then its checks: their output
            its_checks = list(itertools.takewhile(lambda j: j in checks, range(i + 1, len(nb.cells))))
            nb.cells[i].source = source
            for j in [i, *its_checks]:
                client.execute_cell(nb.cells[j], j)
            return "".join(printed(its_checks))

        for i in exercises:
            exercise = nb.cells[i].metadata["exercise"]
            for what, source in by_name[exercise].wrong.items():
                wrong[exercise, what] = with_exercise(i, source)
            with_exercise(i, by_name[exercise].solution)  # a correct state again for the next exercise
        for i in range(exercises[0], len(nb.cells)):
            if i in exercises:
                nb.cells[i].source = by_name[nb.cells[i].metadata["exercise"]].solution
            client.execute_cell(nb.cells[i], i)
        solved = printed(checks)
    return shipped, wrong, solved


COMMITTED_RECORDS = HERE / "assets" / "comparison"
COMMITTED_PREFERENCE = HERE / "assets" / "preference"
# each label's strict gains, in sixths (the first j of the six categories right, the base none right), seeds 0-2
SYNTHETIC_SIXTHS = {"flow_grpo": [1, 2, 1], "stepwise": [2, 2, 3], "tempflow": [2, 3, 5], "g2rpo": [1, 1, 2],
                    "chunk": [3, 4, 2], "g2rpo:granularities=1": [0, 1, 1], "chunk:chunks=paper": [2, 4, 3]}


def synthetic_records(folder: Path) -> Path:
    """A head-to-head folder of records with known gains: 2 held-out pairs a category; each run evaluates one pair a
    category at every iteration and all twelve where the campaign's flags ask (iterations 2 and 3 as --full-evals,
    the first iteration past 25 forward passes as --full-eval-nfe, and its end); forward passes per iteration and
    run lengths differ by method. Every full evaluation of a run scores its label and seed's sixths. A run trains 30
    seconds an iteration, but for a pause in one of tempflow's and tempflow's seed 2, which ran on another, slower CPU
    (60 s an iteration); its record's `seconds` say 60 in all."""
    args = dataclasses.asdict(fgc.Args(eval_per_tag=2, eval_every=1, full_evals="2,3", full_eval_nfe="25"))
    tags = [m["tag"] for m in fgc.eval_prompts(2)]

    def evaluation(iteration, nfe, pairs, j):
        strict = [int(p < 2 * j) for p in pairs]  # the first j categories right
        categories = {f"eval_{t}": 0.5 + 0.1 * (t in tags[: 2 * j]) for t in fgc.TAGS}
        return {"iteration": iteration, "nfe": nfe, "gain_strict": j / 6, "gain_strict_se": 0.01, "gain_overall": 0.1,
                "gain_overall_se": 0.01, "eval_extra": 0.2, "eval_pairs": len(pairs), **categories,
                "scores": {"pair": pairs, "strict": strict, "geneval": strict, "extra": [0] * len(pairs),
                           "missing": [0] * len(pairs)}}

    folder.mkdir(parents=True)
    (folder / "base.json").write_text(json.dumps(evaluation(0, 0, list(range(12)), 0) | {"eval_extra": 0.3}))
    passes = {"flow_grpo": 10, "stepwise": 20, "tempflow": 15, "g2rpo": 25, "chunk": 10}
    length = {"flow_grpo": 4, "stepwise": 2, "tempflow": 3, "g2rpo": 2, "chunk": 3}
    for label, sixths in SYNTHETIC_SIXTHS.items():
        cost, n = passes[label.split(":")[0]], length[label.split(":")[0]]
        for seed, j in enumerate(sixths):
            full = {2, 3, n} | {i for i in range(1, n + 1) if (i - 1) * cost < 25 <= i * cost}
            evaluations = [evaluation(i, i * cost, list(range(12)) if i in full else list(range(0, 12, 2)), j)
                           for i in range(1, n + 1)]
            paused, slower = label == "tempflow" and seed == 0, label == "tempflow" and seed == 2
            for e in evaluations:  # 30 s an iteration (60 on the slower CPU); the pause: 1,000 s in the second
                e["wall_s"] = (60.0 if slower else 30.0) * e["iteration"] + 1000.0 * (paused and e["iteration"] >= 2)
            record = {"label": label, "seed": seed, "args": args | {"iterations": n}, "iterations": n, "nfe": n * cost,
                      "seconds": 60.0, "threads": 1, "torch": torch.__version__, "code": "test",
                      "cpu": "slow cpu" if slower else "test",
                      "training": {"reward_mean": [0.0] * n}, "evaluations": evaluations}
            (folder / f"{label.replace(':', '+')}-seed{seed}.json").write_text(json.dumps(record))
    return folder


# notebook 03's family: each method against Flow-GRPO at equal iterations and at equal forward passes, two ablations
FAMILY = [(m, "flow_grpo", by) for m in ("stepwise", "tempflow", "g2rpo", "chunk") for by in ("iterations", "passes")]
FAMILY += [("g2rpo", "g2rpo:granularities=1", "iterations"), ("chunk", "chunk:chunks=paper", "iterations")]


def family_rows(differences: dict, where: dict) -> dict:
    """Each test's row of notebook 03's paired differences, worked out here from its per-seed differences: the mean,
    its interval at the Bonferroni level 1 - 0.05/10 of the family of ten, its half-width, the paired t-test's
    p-value adjusted by Holm over the ten (a test without runs counts p = 1) and the verdict; as far as the verdict,
    since the rest of the row are the notebook's own descriptions. `where`: each test's comparison point as shown."""
    from scipy import stats

    m, level = len(FAMILY), 1 - 0.05 / len(FAMILY)
    p = {t: 2 * stats.t.sf(abs(x.mean()) / (x.std(ddof=1) / math.sqrt(len(x))), len(x) - 1)
         for t, x in differences.items()}
    order = sorted(FAMILY, key=lambda t: p.get(t, 1.0))  # Holm: the i-th smallest times (m - i), never below the last
    adjusted = dict(zip(order, np.maximum.accumulate([min(1, (m - i) * p.get(t, 1.0)) for i, t in enumerate(order)])))
    rows = {}
    for t, x in differences.items():
        half = stats.t.ppf(1 - (1 - level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
        low, high = x.mean() - half, x.mean() + half
        verdict = ("holds" if low > 0 else "contradicted" if high < 0 else
                   "equivalent within ±0.03" if -0.03 < low and high < 0.03 else "not told apart")
        rows[t] = (f"| {t[0]} − {t[1]} | {where[t]}", f"| **{x.mean():+.3f}** [{low:+.3f}, {high:+.3f}] | "
                   f"±{half:.3f} | "
                   f"{adjusted[t]:.3f} | {verdict} |")
    return rows


def test_the_committed_records_stay_within_16_mb():
    """The head-to-head's records, those of the campaign under way in pending/ included (notebook 03 reads the
    folder's own *-seed*.json files only)."""
    assert sum(p.stat().st_size for p in COMMITTED_RECORDS.rglob("*.json")) < 16e6


def holm_rows(differences: dict) -> dict[str, str]:
    """Each method's row of notebook 03's paired differences, worked out here from its per-seed differences from
    Flow-GRPO: the mean, the paired t-test's p-value, Holm's adjustment over the methods and each interval's level."""
    from scipy import stats

    p = {m: 2 * stats.t.sf(abs(x.mean()) / (x.std(ddof=1) / math.sqrt(len(x))), len(x) - 1)
         for m, x in differences.items()}
    order = sorted(p, key=p.get)  # Holm: the i-th smallest p-value times (m - i), never below the one before
    adjusted = np.maximum.accumulate([min(1, (len(order) - i) * p[m]) for i, m in enumerate(order)])
    rows = {}
    for rank, m in enumerate(order):
        level, x = 1 - 0.05 / (len(order) - rank), differences[m]
        half = stats.t.ppf(1 - (1 - level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
        rows[m] = (f"| {m} − flow_grpo | equal iterations | **{x.mean():+.3f}** [{x.mean() - half:+.3f}, "
                   f"{x.mean() + half:+.3f}] | {level:.2%} | {adjusted[rank]:.3f} |")
    return rows


def test_comparison_md_and_the_readme_show_each_label_s_gain_and_each_test_of_the_family_from_the_committed_records():
    """Each label's mean end strict gain over its committed seeds, with Student's 95% t-interval worked out here, is
    its row in the summary of assets/comparison.md (notebook 03's); each test of the family, worked out here from the
    records (both sides' evaluations of every held-out pair at the comparison point, paired by seed), is its row of
    the paired differences, with its Bonferroni interval and Holm p-value. The README shows the summary and claims."""
    from scipy import stats

    records = [json.loads(p.read_text()) for p in COMMITTED_RECORDS.glob("*-seed*.json")]
    text, readme = (HERE / "assets" / "comparison.md").read_text(), (HERE / "README.md").read_text()
    summary, claims, differences = (text.split(f"## {part}\n\n")[1].split("\n\n")[0]
                                    for part in ("Summary", "The papers' claims", "Paired differences"))
    runs = {(r["label"], r["seed"]): r for r in records}
    seeds = {label: sorted(s for lab, s in runs if lab == label) for label, _ in runs}
    for label, of_label in seeds.items():
        g = np.array([runs[label, s]["evaluations"][-1]["gain_strict"] for s in of_label])
        half = stats.t.ppf(0.975, len(g) - 1) * g.std(ddof=1) / math.sqrt(len(g)) if len(g) > 1 else None
        shown = f"[{g.mean() - half:+.3f}, {g.mean() + half:+.3f}]" if half is not None else "[one seed]"
        assert f"| {label} | {len(g)} | **{g.mean():+.3f}** {shown} |" in summary, label
    assert len(summary.splitlines()) == len(seeds) + 2  # a header, a rule and a row a label
    assert summary in readme and claims in readme

    budget = int(records[0]["args"]["full_eval_nfe"])
    length = {label: runs[label, of_label[0]]["iterations"] for label, of_label in seeds.items()}

    def gain_at(run, point):  # its evaluation of every held-out pair at an iteration, or the first past the budget
        e = next(e for e in run["evaluations"]
                 if (e["iteration"] == point if point != "budget" else e["nfe"] >= budget))
        assert e["eval_pairs"] == 1536
        return e["gain_strict"]

    d, sides, where = {}, {}, {}
    for t in FAMILY:
        both = [s for s in seeds.get(t[0], []) if s in seeds.get(t[1], [])]
        if len(both) > 1:
            point = min(length[t[0]], length[t[1]]) if t[2] == "iterations" else "budget"
            sides[t] = [np.array([gain_at(runs[label, s], point) for s in both]) for label in t[:2]]
            d[t] = sides[t][0] - sides[t][1]
            where[t] = f"iteration {point}" if t[2] == "iterations" else f"{budget:,} passes"
    assert len(differences.splitlines()) == len(d) + 2, "a row for each test whose sides share two seeds or more"
    t_of = lambda n: stats.t.ppf(1 - 0.025 / len(FAMILY), n - 1)  # noqa: E731  the family's Bonferroni level
    for t, (start, rest) in family_rows(d, where).items():
        line = next(line for line in differences.splitlines() if line.startswith(start))
        # then the seeds at which this spread gives +-0.03 at the family's level, the share of (method seed,
        # reference seed) pairs the method wins (ties half: rliable's probability of improvement), and the wins
        needed = next(n for n in range(2, 1000) if t_of(n) * d[t].std(ddof=1) / math.sqrt(n) <= 0.03)
        x, y = sides[t]
        poi = np.mean([(a > b) + 0.5 * (a == b) for a in x for b in y])
        assert f"{rest} {needed} | {poi:.2f} [" in line and line.endswith(f"| {(d[t] > 0).sum()} of {len(x)} |"), t


def test_notebooks_are_committed_executed_and_small():
    import nbformat

    for name in NOTEBOOKS:
        path = HERE / "notebooks" / name
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), f"{name}: commit it executed, so that GitHub shows the outputs"
        assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
        assert path.stat().st_size < 1.5e6


def test_notebook_02_runs_each_method_of_its_batch_with_the_method_s_own_defaults():
    """The side-by-side batch resolves each method's flags (METHODS): its committed table shows G2RPO
    sampling at its noise level 0.7 and the others at 1.0, as a run of each method would."""
    import nbformat

    cells = nbformat.read(HERE / "notebooks" / "02_credit_assignment_side_by_side.ipynb", as_version=4).cells
    printed = ["".join(o.get("text", "") for o in c.outputs) for c in cells if c.cell_type == "code"]
    table = next(text for text in printed if "noise level a" in text)
    rows = [line.split() for line in table.splitlines()]
    levels = {row[0]: float(row[1]) for row in rows if row and row[0] in fgc.METHODS}
    assert levels == {m: fgc.validate(fgc.Args(method=m)).noise_level for m in fgc.METHODS}
    assert levels["g2rpo"] == 0.7


def test_tune_holds_out_other_lines_of_a_prompts_file_than_the_held_out_set(tmp_path):
    """With --prompts, the held-out set is every 10th line from the first and --tune's every 10th from the 6th:
    the two never share a line, and both come from the same file."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(f"prompt {i}" for i in range(40)))
    held_out = [m["prompt"] for m in fgc.prompt_sets(fgc.Args(prompts=str(path)))[1]]
    tuning = [m["prompt"] for m in fgc.prompt_sets(fgc.Args(prompts=str(path), tune=True))[1]]
    assert held_out == [f"prompt {i}" for i in (0, 10, 20, 30)] and tuning == [f"prompt {i}" for i in (5, 15, 25, 35)]


def test_notebook_03_computes_a_method_s_interval_and_the_family_s_holm_adjusted_differences_as_worked_out_here(
        tmp_path, monkeypatch):
    """On records with known gains: tempflow's mean strict gain with Student's 95% interval; each of the ten tests of
    the family, at its comparison point, with its Bonferroni interval, Holm's adjusted p-value and verdict;
    tempflow's probability of improvement over Flow-GRPO; and a sixth method's label, outside the campaign, read as
    the others are, its row after the campaign's."""
    import nbformat
    from nbclient import NotebookClient

    folder = synthetic_records(tmp_path / "comparison")
    for seed in (0, 1):  # Flow-GRPO's runs relabelled: their files sort first, so the notebook reads their flags
        record = json.loads((folder / f"flow_grpo-seed{seed}.json").read_text())
        record["label"] = record["args"]["method"] = "a_sixth_method"
        (folder / f"a_sixth_method-seed{seed}.json").write_text(json.dumps(record))
    monkeypatch.setenv("FGC_COMPARISON", str(folder))
    nb = nbformat.read(HERE / "notebooks" / "03_head_to_head.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if not {"exercise", "check"} & set(c.metadata.get("tags", []))]
    NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(HERE / "notebooks")}}
                   ).execute()
    text = (tmp_path / "comparison.md").read_text()

    def line_starting(start):  # the table row of comparison.md that begins so
        return next(line for line in text.splitlines() if line.startswith(start))

    gains = np.array(SYNTHETIC_SIXTHS["tempflow"]) / 6  # 2/6, 3/6, 5/6
    half = 4.303 * gains.std(ddof=1) / math.sqrt(3)  # Student's t of 2 degrees of freedom, 97.5%
    low, high = gains.mean() - half, gains.mean() + half
    assert f"| tempflow | 3 | **{gains.mean():+.3f}** [{low:+.3f}, {high:+.3f}] |" in text
    sixths = {label: np.array(v) / 6 for label, v in SYNTHETIC_SIXTHS.items()}
    length = {"flow_grpo": 4, "stepwise": 2, "tempflow": 3, "g2rpo": 2, "chunk": 3}  # synthetic_records' runs
    where = {t: "25 passes" if t[2] == "passes" else f"iteration {min(length[t[0]], length[t[1].split(':')[0]])}"
             for t in FAMILY}
    rows = family_rows({t: sixths[t[0]] - sixths[t[1]] for t in FAMILY}, where)
    for t, (start, rest) in rows.items():
        assert rest in line_starting(start), t
    # training minutes: 30 s an iteration, the paused stretch aside, not the record's 60 seconds; each CPU its own
    # median, in the order of their names ("slow cpu", then "test"), "–" where a label has no run on one
    assert f"| {0.5 * 3:.1f} |" in line_starting("| tempflow | 0 | 3 |")
    assert "minutes (slow cpu / test) |" in text
    assert line_starting("| tempflow | 3 |").endswith("| 3.0 / 1.5 |")
    assert line_starting("| stepwise | 3 |").endswith("| – / 1.0 |")
    # rliable's probability of improvement, over all pairs of runs: tempflow's 2, 3, 5 sixths beat Flow-GRPO's 1, 2, 1
    # in 8 of the 9 pairs and tie in one (8.5 / 9). Its bootstrap interval reaches 1 (in over half the resamples every
    # tempflow run beats every Flow-GRPO run) and cannot fall below 0.5 (the resample of 2 sixths on both sides)
    row = line_starting("| tempflow − flow_grpo | iteration 3 |")
    value, low, high = map(float, re.search(r"\| ([\d.]+) \[([\d.]+), ([\d.]+)\] \| 3 of 3 \|$", row).groups())
    assert value == round(8.5 / 9, 2) and high == 1.0 and 0.5 <= low <= value
    # the sixth method: Flow-GRPO's gains of seeds 0 and 1, with Student's t of 1 degree of freedom; the summary lists
    # the campaign's labels in its order, then it; the count keeps the campaign's runs apart from it
    gains = np.array(SYNTHETIC_SIXTHS["flow_grpo"][:2]) / 6
    mean, half = gains.mean(), 12.706 * gains.std(ddof=1) / math.sqrt(2)
    assert f"| a_sixth_method | 2 | **{mean:+.3f}** [{mean - half:+.3f}, {mean + half:+.3f}] |" in text
    summary = text.split("## Summary\n\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split(" | ")[0][2:] for line in summary] == [*SYNTHETIC_SIXTHS, "a_sixth_method"]
    assert "21 of the campaign's 72 runs and 2 of labels outside it, 12 held-out pairs" in text


# notebook 04: the preference world's runs, on records with known gold curves

PREF_SLOPE = {"stepwise": 0.2, "tempflow": 0.3, "g2rpo": 0.1, "chunk": 0.25}  # a method's gold gain at its end


def pref_gold(method, beta, seed, i):
    """The synthetic gold gain at iteration i: Flow-GRPO at beta 0 peaks at 32, 0.4 (i/32) e^(1 - i/32), and falls;
    at beta 0.004 it rises, 0.3 (1 - e^(-i/32)); at beta 0.04 it only falls, -0.1 i/128, never above the base; the
    other methods rise linearly to their PREF_SLOPE at their default length. Seeds add 0.01 a seed (Flow-GRPO) or
    0.02 a seed (the others)."""
    if method == "flow_grpo":
        shapes = {0: 0.4 * i / 32 * math.exp(1 - i / 32), 0.004: 0.3 * (1 - math.exp(-i / 32)), 0.04: -0.1 * i / 128}
        return shapes[beta] + 0.01 * seed
    return PREF_SLOPE[method] * i / fgc.METHODS[method].iterations + 0.02 * seed


def synthetic_preference(folder: Path) -> Path:
    """A preference folder (notebook 04's) with 2 held-out pairs a category: every 8 iterations an evaluation of one
    pair a category, at the end of all twelve; each evaluation shifts every pair's gold by pref_gold and its proxy
    by 0.001 an iteration. Flow-GRPO runs 128 iterations at beta 0 (seeds 0-2), 0.004 and 0.04 (seeds 0-1); the
    other methods their default lengths on seeds 0-2."""
    args = dataclasses.asdict(fgc.Args(eval_per_tag=2, reward="toy-pref", eval_kl=True))
    base_gold, base_proxy = [p / 12 for p in range(12)], [p / 24 for p in range(12)]

    def evaluation(i, gold, pairs):
        return {"iteration": i, "eval_kl": (i / 64) ** 2, "gain_reward": 0.001 * i, "gain_gold": gold,
                "gain_gold_se": 0.01, "gain_strict": 0.1, "eval_extra": 0.2, "eval_missing": 0.1,
                "scores": {"pair": pairs, "reward": [base_proxy[p] + 0.001 * i for p in pairs],
                           "gold": [base_gold[p] + gold for p in pairs]}}

    folder.mkdir(parents=True)
    (folder / "base.json").write_text(json.dumps(evaluation(0, 0.0, list(range(12))) | {"eval_extra": 0.3}))
    runs = [("flow_grpo", 0, s, 128) for s in range(3)]
    runs += [("flow_grpo", b, s, 128) for b in (0.004, 0.04) for s in range(2)]
    runs += [(m, 0, s, fgc.METHODS[m].iterations) for m in PREF_SLOPE for s in range(3)]
    for method, beta, seed, n in runs:
        evaluations = [evaluation(i, pref_gold(method, beta, seed, i), list(range(12)) if i == n else
                                  list(range(0, 12, 2))) for i in range(8, n + 1, 8)]
        record = {"label": method, "seed": seed, "args": args | {"method": method, "beta": beta, "iterations": n},
                  "iterations": n, "evaluations": evaluations}
        (folder / f"{method}-beta{beta}-seed{seed}.json").write_text(json.dumps(record))
    return folder


def test_notebook_04_finds_the_kl_that_keeps_the_gold_and_the_methods_gains_as_worked_out_here(tmp_path, monkeypatch):
    """On records with known gold curves: each KL strength's peak and end gold gain, with Student's interval over the
    seeds and whether the end keeps 90% of the peak; each method's mean gold gain at its end; and each method's mean
    paired gold difference from Flow-GRPO at its end, on Flow-GRPO's pairs there."""
    import nbformat
    from nbclient import NotebookClient
    from scipy import stats

    monkeypatch.setenv("FGC_PREFERENCE", str(synthetic_preference(tmp_path / "preference")))
    nb = nbformat.read(HERE / "notebooks" / "04_over_optimisation.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if not {"exercise", "check"} & set(c.metadata.get("tags", []))]
    nb.cells = nb.cells[:next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Exercises"))]
    NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(HERE / "notebooks")}}
                   ).execute()
    text = (tmp_path / "preference.md").read_text()
    assert (tmp_path / "preference_overoptimisation.png").exists() and (tmp_path / "preference_methods.png").exists()
    # a gold that never rises above the base peaks at the base, iteration 0, a gain of 0: it has no end/peak share
    for beta, seeds, peak_at, keeps in [(0, 3, 32, "no"), (0.004, 2, 128, "yes"), (0.04, 2, 0, "no")]:
        peak, end = (np.array([pref_gold("flow_grpo", beta, s, i) if i else 0.0 for s in range(seeds)])
                     for i in (peak_at, 128))
        half = stats.t.ppf(0.975, seeds - 1) * end.std(ddof=1) / math.sqrt(seeds)
        share = f"{end.mean() / peak.mean():.2f}" if peak_at else "–"
        row = (f"| {beta} | {seeds} | {peak.mean():+.3f} ({peak_at}) | {end.mean():+.3f} (128) "
               f"[{end.mean() - half:+.3f}, {end.mean() + half:+.3f}] | {share} | {keeps} "
               f"| {128 / 64:.2f} | {0.001 * 128:+.3f} |")  # synthetic_preference's KL (i / 64)^2 and proxy
        assert row in text, row
    for method, slope in PREF_SLOPE.items():
        gold = slope + 0.02  # the mean of 0, 0.02 and 0.04
        assert f"| {method} | 3 | {0.001 * fgc.METHODS[method].iterations:+.3f} | {gold:+.3f} [" in text
        end = fgc.METHODS[method].iterations
        difference = np.mean([pref_gold(method, 0, s, end) - pref_gold("flow_grpo", 0, s, end) for s in range(3)])
        assert f"| {method} | 3 | {difference:+.3f} | 0.010 |" in text, method


# ----------------------------------------------------------------------------------------------------
# unreadable files: a run folder's is a one-line error that changes nothing, a base cache entry's is a miss, a model
# folder's is a one-line error naming the part

CUTS = {"empty": lambda n: 0, "a few bytes": lambda n: 8, "half": lambda n: n // 2,
        "all but 64 bytes": lambda n: n - 64, "the last 3 bytes lost": lambda n: n - 3}  # bytes kept of n


def files_of(folder: Path) -> dict:
    """Every file under `folder` and its bytes: what a failed start leaves as it was."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cut_short(file: Path, cut: str | None) -> None:
    """The file cut short as CUTS[cut] says, or gone (cut None)."""
    if cut is None:
        return file.unlink()
    data = file.read_bytes()
    file.write_bytes(data[:CUTS[cut](len(data))])


def fails_in_one_line(capfd, argv: list, folder: Path, *needles: str) -> str:
    """The CLI's main(argv) returns 2 with one line on stderr that holds every needle, and `folder` is byte-for-byte
    as it was: -> the line."""
    before = files_of(folder)
    capfd.readouterr()
    assert fgc.main(argv) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(needle in err for needle in needles), err
    assert files_of(folder) == before
    return err


@pytest.mark.parametrize("cut", ["empty", "a few bytes", "half", "all but 64 bytes"])
def test_a_resume_from_a_truncated_checkpoint_is_a_one_line_error_that_changes_nothing(tiny_run, tmp_path, capfd, cut):
    """A partial copy or a full disk: two more iterations of a finished run resume from its checkpoint, which is cut
    short; the error names the file and its folder and says what to do."""
    _, run, _ = tiny_run
    copy = shutil.copytree(run, tmp_path / run.name)
    cut_short(copy / "checkpoint.pt", cut)
    fails_in_one_line(capfd, ["--run", str(copy), "--iterations", "4"], copy, "checkpoint.pt", str(copy), "restore it")


@pytest.mark.parametrize("name", ["args.json", "record.json", "metrics.jsonl"])
def test_a_damaged_json_file_of_a_run_folder_is_a_one_line_error_that_changes_nothing(tiny_run, tmp_path, capfd, name):
    """Edited by hand or copied in part: --run FOLDER reads args.json, and the finished run's record.json and
    metrics.jsonl."""
    _, run, _ = tiny_run
    copy = shutil.copytree(run, tmp_path / run.name)
    cut_short(copy / name, "the last 3 bytes lost")
    fails_in_one_line(capfd, ["--run", str(copy)], copy, name, str(copy), "restore it")


EDITS = {"args.json: a value of another type": ("args.json", lambda saved: saved | {"lr": "fast"}, "lr is 'fast'"),
         "args.json: null": ("args.json", lambda saved: None, "args.json"),
         "record.json: a list": ("record.json", lambda saved: [saved], "not a run's record"),
         "record.json: no flags": ("record.json", lambda saved: {k: v for k, v in saved.items() if k != "args"},
                                   "no 'args'"),
         "record.json: a flag of another type": ("record.json", lambda saved: saved | {"args": {"seed": "0"}},
                                                 "seed is '0'")}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_run_folder_s_json_edited_by_hand_into_something_else_is_a_one_line_error_that_changes_nothing(
        tiny_run, tmp_path, capfd, edit):
    """Valid JSON, but not what the file holds: a flag of another type, another type of file."""
    _, run, _ = tiny_run
    name, change, needle = EDITS[edit]
    copy = shutil.copytree(run, tmp_path / run.name)
    (copy / name).write_text(json.dumps(change(json.loads((copy / name).read_text()))))
    fails_in_one_line(capfd, ["--run", str(copy)], copy, name, str(copy), needle, "restore it")


def save_other_dict(path: Path) -> None:
    torch.save({"iteration": 2, "wall": 0.0, "weights": torch.zeros(3)}, path)


@pytest.mark.parametrize("write, needle", [(lambda path: path.write_bytes(random.Random(0).randbytes(4096)),
                                            "UnpicklingError"), (save_other_dict, "does not fit")])
def test_a_checkpoint_that_is_not_one_is_a_one_line_error_without_torch_s_advice_to_unpickle_it(tiny_run, tmp_path,
                                                                                                capfd, write, needle):
    """Random bytes, or a torch file of something else. torch's unpickler answers any damage with "re-run with
    weights_only=False", which would run what the bytes say: not in the error."""
    _, run, _ = tiny_run
    copy = shutil.copytree(run, tmp_path / run.name)
    write(copy / "checkpoint.pt")
    err = fails_in_one_line(capfd, ["--run", str(copy), "--iterations", "4"], copy, "checkpoint.pt", str(copy), needle)
    assert "weights_only" not in err


def test_a_loader_s_error_is_cut_to_the_line_that_names_the_cause():
    assert fgc.first_line(ValueError("no file named x.json\nin folder y")) == "no file named x.json"
    mismatch = RuntimeError("Error(s) in loading state_dict for M:\n\tsize mismatch for w: [4, 8] and [2, 8].")
    assert fgc.first_line(mismatch) == "Error(s) in loading state_dict for M: size mismatch for w: [4, 8] and [2, 8]."
    assert fgc.first_line(KeyError()) == "KeyError"
    assert fgc.first_line(pickle.UnpicklingError("re-run with weights_only=False")) == "UnpicklingError"


def test_a_damaged_scores_file_stops_the_record_in_one_line_naming_it(tiny_run, tmp_path, capfd, monkeypatch):
    """Two more iterations train; the record then pairs every evaluation's scores, and one of them is cut short."""
    _, run, _ = tiny_run
    monkeypatch.setenv("TQDM_DISABLE", "1")
    copy = shutil.copytree(run, tmp_path / run.name)
    cut_short(copy / "scores_0000.pt", "half")
    capfd.readouterr()
    assert fgc.main(["--run", str(copy), "--iterations", "4"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scores_0000.pt" in err[0] and str(copy) in err[0], err


def test_a_cache_folder_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tiny_cache, tmp_path, capfd,
                                                                                 monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    in_the_way = tmp_path / "not_a_folder"
    in_the_way.write_text("")
    capfd.readouterr()
    fgc.train(tiny_args(tiny_cache, tmp_path, iterations=1, base_cache=True, cache_dir=str(in_the_way),
                        run=str(tmp_path / "run")))
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 1 and "not cached" in err[0] and (tmp_path / "run" / "record.json").exists()


def test_a_prompts_file_that_is_not_utf8_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("a red cat\nun caf\u00e9\n".encode("latin-1"))
    with pytest.raises(fgc.UsageError, match="prompts.txt in .* cannot be read .*UTF-8") as err:
        fgc.prompt_sets(fgc.Args(prompts=str(path)))
    assert "\n" not in str(err.value)


def test_a_resume_through_train_reads_a_damaged_args_json_as_a_one_line_error_that_changes_nothing(tiny_run, tmp_path):
    args, run, _ = tiny_run
    copy = shutil.copytree(run, tmp_path / run.name)
    cut_short(copy / "args.json", "half")
    before = files_of(copy)
    with pytest.raises(fgc.UsageError, match=re.escape(f"args.json in {copy}")) as err:
        fgc.train(dataclasses.replace(args, run=str(copy), iterations=4))
    assert "\n" not in str(err.value) and files_of(copy) == before


@pytest.fixture(scope="session")
def cached_base_run(tiny_cache, tmp_path_factory):
    """(args, record) of a finished 1-iteration toy run that evaluated its base into a cache of its own."""
    root = tmp_path_factory.mktemp("cached_base")
    args = tiny_args(tiny_cache, root, iterations=1, base_cache=True, cache_dir=str(root / "cache"),
                     run=str(root / "run"))
    fgc.train(args)
    return args, json.loads((root / "run" / "record.json").read_text())


def timeless(record: dict) -> dict:
    """A record but for its times and where it ran."""
    evaluations = [e | {"wall_s": None} for e in [record["base"], *record["evaluations"]]]
    args = {k: v for k, v in record["args"].items() if k not in fgc.NOT_SHAPING}
    return record | {"seconds": None, "args": args, "base": None, "evaluations": evaluations}


@pytest.mark.parametrize("cut", ["empty", "half"])
def test_an_unreadable_base_cache_entry_is_a_miss_evaluated_again_rewritten_and_the_record_is_a_clean_cache_s(
        cached_base_run, tmp_path, capfd, monkeypatch, cut):
    """A synced or half-copied cache: the run warns in one line, evaluates the base again, gives the record of a run
    from a clean cache, and leaves a readable entry for the next run."""
    args, clean = cached_base_run
    cache = shutil.copytree(args.cache_dir, tmp_path / "cache")
    entry, = (cache / "base_eval").glob("*.pt")
    cut_short(entry, cut)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    capfd.readouterr()
    fgc.train(dataclasses.replace(args, cache_dir=str(cache), run=str(tmp_path / "run")))
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and entry.name in err[0] and str(entry.parent) in err[0]
    assert timeless(json.loads((tmp_path / "run" / "record.json").read_text())) == timeless(clean)
    metrics, _, metas, scores = torch.load(entry, weights_only=True)
    first = torch.load(Path(args.cache_dir) / "base_eval" / entry.name, weights_only=True)
    assert (metrics, metas) == (first[0], first[2]) and all(torch.equal(v, first[3][k]) for k, v in scores.items())


TOY_DAMAGES = {"unet weights missing": ("unet/diffusion_pytorch_model.safetensors", None),
               "unet weights cut short": ("unet/diffusion_pytorch_model.safetensors", "half"),
               "text encoder config missing": ("text_encoder/config.json", None),
               "text encoder weights cut short": ("text_encoder/model.safetensors", "a few bytes"),
               "tokenizer config missing": ("tokenizer/tokenizer_config.json", None),
               "tokenizer cut short": ("tokenizer/tokenizer.json", "half")}


@pytest.mark.parametrize("damage", list(TOY_DAMAGES))
def test_a_toy_base_folder_missing_or_damaging_a_part_is_a_one_line_error_naming_it(tiny_cache, tmp_path, damage):
    """The script itself (the libraries' own log lines reach the terminal, not a test's capture): status 2, one line
    naming the folder and the part, the folder as it was, and no run folder made."""
    name, cut = TOY_DAMAGES[damage]
    folder = shutil.copytree(Path(tiny_cache) / "toy", tmp_path / "toy")
    cut_short(folder / name, cut)
    before = files_of(folder)
    argv = ["--toy-base", str(folder), "--out", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(folder) in proc.stderr and name.split("/")[0] in proc.stderr, proc.stderr
    assert files_of(folder) == before and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag,source,name", [("model", "sd3", "transformer/diffusion_pytorch_model.safetensors"),
                                              ("model", "sd3", "text_encoder/model.safetensors"),
                                              ("reward_model", "clip", "model.safetensors")])
@pytest.mark.parametrize("cut", [None, "half"])
def test_a_local_model_folder_missing_or_damaging_a_part_is_a_one_line_error_naming_it(tiny_real, tmp_path, flag,
                                                                                        source, name, cut):
    folder = shutil.copytree(tiny_real / source, tmp_path / "model")
    cut_short(folder / name, cut)
    with pytest.raises(fgc.UsageError) as err:
        fgc.train(real_args(tiny_real, tmp_path / "runs", **{flag: str(folder)}))
    assert "\n" not in str(err.value) and str(folder) in str(err.value) and name.split("/")[0] in str(err.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag,source,name", [("model", "sd3", "model_index.json"),
                                              ("model", "sd3", "transformer/config.json"),
                                              ("model", "sd3", "tokenizer_3/tokenizer.json"),
                                              ("reward_model", "clip", "config.json")])
def test_a_local_model_folder_with_a_json_file_cut_short_is_a_one_line_error_naming_the_file(tiny_real, tmp_path, flag,
                                                                                              source, name):
    """A config or tokenizer file that a library would read with a message of its own, or read around."""
    folder = shutil.copytree(tiny_real / source, tmp_path / "model")
    cut_short(folder / name, "half")
    with pytest.raises(fgc.UsageError) as err:
        fgc.train(real_args(tiny_real, tmp_path / "runs", **{flag: str(folder)}))
    assert "\n" not in str(err.value) and f"{Path(name).name} in {(folder / name).parent}" in str(err.value)
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------------
# benchmark.py --architecture: SD3.5-Medium and FLUX.1-dev at random weights from assets/architectures/


def printed_results(text: str) -> dict:
    """The benchmark's `key value` lines -> {key: float or str}."""
    pairs = (line.split(None, 1) for line in text.splitlines() if re.match(r"^[a-z_0-9]+ {2,}\S", line))
    return {k: float(v) if re.fullmatch(r"[-+.e0-9]+", v) else v.strip() for k, v in pairs}


def test_benchmark_architecture_builds_and_runs_both_pipelines_at_one_layer_on_the_cpu(capsys):
    """At --layers 1 and 32 px both architectures build, run a warm-up and a timed iteration of the recipe's
    code path, and print each phase's seconds and FLOPs, the TFLOP/s, the MFU (unknown on a CPU) and peak memory;
    SD3's real CFG makes twice FLUX's passes for the same images."""
    quick = ["--layers", "1", "--resolution", "32", "--repeat", "1", "--device", "cpu", "--method", "flow_grpo",
             "--group-size", "2", "--prompts-per-iter", "1", "--steps", "3", "--text-tokens", "8",
             "--inner-updates", "1"]
    found = {}
    for name, extra in (("sd3.5-medium", []), ("flux.1-dev", ["--low-memory"])):
        assert benchmark_module().main(["--architecture", name, *quick, *extra]) == 0
        found[name] = printed_results(capsys.readouterr().out)
    for name, result in found.items():
        phases = ("encode", "sample", "reward", "train")
        assert all(result[f"{p}_s"] > 0 and result[f"{p}_tflop"] > 0 for p in phases), (name, result)
        assert result["total_tflop"] == pytest.approx(sum(result[f"{p}_tflop"] for p in phases), rel=1e-3)
        assert result["tflop_per_s"] == pytest.approx(result["total_tflop"] / result["total_s"], rel=1e-3)
        assert result["images"] == 2 and result["peak_rss_gb"] > 0 and "peak-tflops" in result["mfu"]
    assert found["sd3.5-medium"]["passes"] == 2 * found["flux.1-dev"]["passes"], "SD3: a CFG pass for every pass"
    assert found["flux.1-dev"]["fits_24gb"] == "measured on CUDA only" and "fits_24gb" not in found["sd3.5-medium"]


def linear_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n  # (m, k) @ (k, n): a multiply and an add each


@pytest.mark.parametrize("name", ["sd3.5-medium", "flux.1-dev"])
def test_benchmark_counts_a_one_layer_transformer_forward_pass_as_its_shapes_say(name):
    """FlopCounterMode's count of one forward pass of the one-layer transformer equals 2 m k n summed over every
    linear layer (and the patch embedding) and every attention matmul, QK^T and AV: 2 x 2 B T^2 D over T tokens."""
    bench = benchmark_module()
    part = bench.architecture(name)["components"]["transformer"]
    c, net = part["config"], bench.build_module(part, layers=1, device="cpu")
    B, N, L = 2, 4, 8  # images, image tokens (2 x 2 patches of a 32 px image), text tokens
    D, C, J, P = c["num_attention_heads"] * c["attention_head_dim"], c["in_channels"], c["joint_attention_dim"], \
        c["pooled_projection_dim"]
    lin, attention = linear_flops, lambda t: 2 * 2 * B * t * t * D
    text, T = torch.randn(B, L, J), N + L
    if name == "sd3.5-medium":  # one layer: the last block, context pre-only, and in dual_attention_layers
        p = c["patch_size"]
        inputs = dict(hidden_states=torch.randn(B, C, 2 * p, 2 * p), timestep=torch.full((B,), 500.0))
        expected = (lin(B * N, C * p * p, D) + lin(B, 256, D) + lin(B, D, D) + lin(B, P, D) + lin(B, D, D)
                    + lin(B * L, J, c["caption_projection_dim"])  # patches, time and pooled text, context embedder
                    + lin(B, D, 9 * D) + lin(B, D, 2 * D)  # the image's AdaLN-Zero-X, the context's AdaLN
                    + 3 * lin(B * N, D, D) + 3 * lin(B * L, D, D) + attention(T) + lin(B * N, D, D)  # joint
                    + 4 * lin(B * N, D, D) + attention(N)  # the dual attention layer's image-only attention
                    + lin(B * N, D, 4 * D) + lin(B * N, 4 * D, D)  # the image's feed-forward (the context has none)
                    + lin(B, D, 2 * D) + lin(B * N, D, p * p * c["out_channels"]))  # output norm and projection
    else:  # one double-stream and one single-stream block
        inputs = dict(hidden_states=torch.randn(B, N, C), timestep=torch.full((B,), 0.5), guidance=torch.ones(B),
                      img_ids=torch.zeros(N, 3), txt_ids=torch.zeros(L, 3))
        expected = (lin(B * N, C, D) + 2 * (lin(B, 256, D) + lin(B, D, D)) + lin(B, P, D) + lin(B, D, D)
                    + lin(B * L, J, D)  # patches, time, guidance and pooled text, context embedder
                    + 2 * lin(B, D, 6 * D) + 4 * lin(B * T, D, D) + attention(T)  # double: q k v out of each stream
                    + lin(B * T, D, 4 * D) + lin(B * T, 4 * D, D)  # each stream's feed-forward on its tokens
                    + lin(B, D, 3 * D) + 3 * lin(B * T, D, D) + lin(B * T, D, 4 * D) + attention(T)  # single block
                    + lin(B * T, 5 * D, D) + lin(B, D, 2 * D) + lin(B * N, D, C))  # its out; output norm, projection
    counter = bench.flop_counter()
    with torch.no_grad(), counter:
        net(**inputs, encoder_hidden_states=text, pooled_projections=torch.randn(B, P))
    assert counter.get_total_flops() == expected


PUBLISHED = [  # (architecture, component, parameters published, to the last digit given)
    ("sd3.5-medium", "transformer", 2.5e9, 0.05e9),  # model card: MMDiT-X, 2.5 B (pos_embed is in the checkpoint)
    ("flux.1-dev", "transformer", 12e9, 0.5e9),  # model card: a 12 billion parameter rectified flow transformer
    ("sd3.5-medium", "text_encoder", 123.65e6, 0.005e6),  # OpenCLIP's docs/model_profile.csv, ViT-L-14 text
    ("sd3.5-medium", "text_encoder_2", 694.66e6, 0.005e6),  # the same table, ViT-bigG-14 text
    ("sd3.5-medium", "text_encoder_3", 4.76e9, 0.005e9),  # T5 v1.1 XXL's encoder
    ("pickscore", "model", 986.11e6, 0.005e6),  # the same table, ViT-H-14 (632.08 M image, 354.03 M text)
]


@pytest.mark.parametrize("name,component,published,within", PUBLISHED)
def test_benchmark_architecture_configs_have_the_published_parameter_counts(name, component, published, within):
    """Each config, built on the meta device (no memory), holds as many numbers in its state dict (what a checkpoint
    stores) as published; at --layers 1 fewer."""
    bench = benchmark_module()
    part = bench.architecture(name)["components"][component]
    def stored(module):  # the state dict's tensors, a tied one (T5's embedding) once
        tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}.values()
        assert all(t.is_meta for t in tensors)
        return sum(t.numel() for t in tensors)

    count = stored(bench.build_module(part))
    assert abs(count - published) <= within, f"{name} {component}: {count:,} parameters"
    assert stored(bench.build_module(part, layers=1)) < count


def test_a_loaders_error_is_quoted_to_its_first_line_break_or_named_by_its_type():
    """first_line keeps a message whole up to its first line break (the part it names may come after a full stop)
    and names an error without a message by its type, where splitlines()[0] raised IndexError."""
    named = OSError("Can't load it. Make sure /m/text_encoder holds model.safetensors.\nSee the docs.")
    assert fgc.first_line(named) == "Can't load it. Make sure /m/text_encoder holds model.safetensors."
    assert fgc.first_line(KeyError()) == "KeyError" and fgc.first_line(ValueError("")) == "ValueError"
