"""Tests that check meaning: equations, invariants of each method, exactness of the scorer, and a
measured improvement of a short real run. Run with `python -m pytest -q`."""
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flow_grpo_credit as fgc

os.environ["HF_HUB_OFFLINE"] = "1"  # no network: every model here is built and saved by the tests

HERE = Path(__file__).parent


# ----------------------------------------------------------------------------------------------------
# toy world


@pytest.mark.parametrize("name_colours", [False, True])
def test_scorer_is_exact_on_rendered_ground_truth(name_colours):
    rng = random.Random(0)
    metas = [fgc.make_prompt(tag, rng, name_colours) for tag in fgc.TAGS for _ in range(100)]
    verdict, dense = fgc.score_batch(fgc.render_batch(metas, rng), metas)
    assert verdict.min() == 1 and dense.min() == 1


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
    red_circle = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}], "prompt": "a red circle"}
    blue_circle = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "blue"}], "prompt": "a blue circle"}
    three = {"tag": "counting", "include": [{"class": "square", "count": 3}], "exclude": [{"class": "square", "count": 4}],
             "prompt": "three squares"}
    two = {"tag": "counting", "include": [{"class": "square", "count": 2}], "exclude": [{"class": "square", "count": 3}],
           "prompt": "two squares"}
    left = {"tag": "position", "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}],
            "prompt": "a circle left of a square"}
    right = {"tag": "position", "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["right of", 0]}],
             "prompt": "a circle right of a square"}
    for shown, asked in [(red_circle, blue_circle), (three, two), (two, three), (left, right)]:
        verdict, dense = fgc.score_batch(fgc.render_batch([shown] * 20, rng), [asked] * 20)
        assert verdict.max() == 0 and dense.max() < 1
    empty = torch.zeros(1, 3, fgc.RES, fgc.RES)
    assert fgc.score_batch(empty, [red_circle]) == (torch.tensor([0.0]), torch.tensor([0.0]))


def test_prompts_follow_geneval_schema():
    for m in fgc.eval_prompts(4):
        assert m["tag"] in fgc.TAGS and m["include"] and isinstance(m["prompt"], str)
        assert all(set(item) <= {"class", "count", "color", "position"} for item in m["include"])
        tokens = fgc.build_tokenizer()(m["prompt"]).input_ids
        assert 1 not in tokens, "every prompt word is in the vocabulary (1 = [UNK])"


# ----------------------------------------------------------------------------------------------------
# SDE step, log-prob, KL, grids


@pytest.mark.parametrize("kind", ["flow", "ddim"])
def test_sde_log_prob_is_normal_log_prob_mean_over_dims(kind):
    x, v = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    t, t_next = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.6, 0.4, 0.2])
    x_next, log_prob, mean, std = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7)
    expected = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(x_next).flatten(1).mean(1)
    assert log_prob.shape == (4,)
    torch.testing.assert_close(log_prob, expected)
    rescored = fgc.sde_step(x, v, t, t_next, kind=kind, noise_level=0.7, prev_sample=x_next)[1]
    torch.testing.assert_close(rescored, log_prob)


def test_euler_with_true_velocity_lands_on_data_and_zero_noise_sde_is_ode():
    x0, x1 = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    grid = fgc.time_grid(7, shift=3.0)
    x = x1
    for t, t_next in zip(grid[:-1], grid[1:]):
        x = fgc.ode_step(x, x1 - x0, t, t_next)
    torch.testing.assert_close(x, x0)
    v = torch.randn_like(x0)
    for kind in fgc.SDE_KINDS:
        sde = fgc.sde_step(x1, v, 0.6, 0.4, kind=kind, noise_level=0.0)[0]
        torch.testing.assert_close(sde, fgc.ode_step(x1, v, 0.6, 0.4))


def test_flow_sde_std_matches_the_sd35_reference_table():
    """METHODS Appendix B.1: transition stds of Flow-GRPO's SDE on the SD3.5 10-step grid (a = 0.7)."""
    stds = fgc.step_stds(fgc.time_grid(10, shift=3.0), fgc.Args(sde="flow", noise_level=0.7))
    table = [0.7000, 0.7430, 0.5362, 0.4459, 0.3918, 0.3528, 0.3191, 0.2820, 0.2254, 0.0063]
    np.testing.assert_allclose(stds.numpy(), table, atol=6e-4)
    ddim = fgc.step_stds(fgc.time_grid(10, shift=3.0), fgc.Args(sde="ddim", ddim_eta=1.0))
    np.testing.assert_allclose(ddim.numpy(), [0, .1824, .2525, .2982, .3238, .3258, .2932, .2034, .0076, 0], atol=6e-4)


def test_kl_is_exact_gaussian_kl_per_dimension():
    mean, mean_ref, std = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.tensor([0.3, 0.5, 0.9])
    p = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1))
    q = torch.distributions.Normal(mean_ref, std.view(-1, 1, 1, 1))
    expected = torch.distributions.kl_divergence(p, q).flatten(1).mean(1)
    torch.testing.assert_close(fgc.gaussian_kl(mean, mean_ref, std), expected)


# ----------------------------------------------------------------------------------------------------
# advantages and method identities on a tiny random policy (fast)


def ctx_for(method_args: dict, reward=None, b=2, seed=0):
    args = fgc.Args(steps=6, group_size=4, seeds=2, tweedie_substeps=2, **method_args)
    policy = random_policy()
    metas = fgc.eval_prompts(1)[:b]
    grid = fgc.time_grid(args.steps)
    reward = reward or (lambda images, metas: images.mean((1, 2, 3)))
    ctx = fgc.Context(policy, args, fgc.Meter(), fgc.generator("cpu", seed), metas,
                      policy.encode([m["prompt"] for m in metas]), grid, reward)
    if args.method == "chunk":
        ctx.chunk_sizes = fgc.parse_chunks(args.chunks, int(ctx.trainable().sum())) or [1] * int(ctx.trainable().sum())
    return ctx


_POLICY = {}


def random_policy():
    if "p" not in _POLICY:
        unet, text_encoder = fgc.build_toy_modules(seed=0)
        policy = fgc.ToyPolicy(unet.eval(), text_encoder.eval(), fgc.build_tokenizer())
        fgc.add_lora(policy, fgc.Args())
        with torch.no_grad():  # a non-zero adapter so that reference and policy differ
            for name, p in policy.net.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        _POLICY["p"] = policy
    return _POLICY["p"]


def test_group_advantages_are_standardised_and_zero_variance_groups_are_zero():
    ctx = ctx_for({})
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    adv = ctx.advantages(r, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert abs(adv[:4].mean()) < 1e-6 and abs(adv[:4].std(unbiased=False) - 1) < 1e-3
    assert torch.equal(adv[4:], torch.zeros(4)) and ctx.stats["zero_std"] == [False, True]


def test_stepwise_advantages_telescope_to_the_normalised_final_reward():
    """METHODS Appendix C.6: with shared initial noise (r[:, 0] equal in a group), each trajectory's
    jointly normalised gains sum to (r_final - group mean) / sigma_glob."""
    ctx = ctx_for({"method": "stepwise"})
    g, s = 4, 6
    r = torch.rand(2 * g, s + 1)
    r[:g, 0], r[g:, 0] = 0.3, 0.7
    prompt = fgc.repeat(torch.arange(2), g)
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


def test_stepwise_tweedie_estimate_is_the_ode_from_the_state_with_its_first_step_free():
    """x0_hat(x_k) by n sub-steps equals an n-step ODE rollout from x_k that computes every velocity,
    while costing n - 1 passes per state (the first velocity is the sampler's); the group's shared start
    is refined once per group. A stepwise iteration costs B*G*S + (n-1)*(B*G*(S-1) + B) passes."""
    ctx = ctx_for({"method": "stepwise"})
    b, g, s, n = 2, 4, 6, ctx.args.tweedie_substeps
    prompt = fgc.repeat(torch.arange(b), g)
    traj = ctx.rollout(prompt, ctx.noise(b * g), ctx.grid, [True] * s)
    x, v, t = traj.states[:, 2], traj.velocities[:, 2], traj.times[:, 2]
    before = ctx.meter.nfe
    x0_hat = fgc.tweedie_x0(ctx, prompt, x, v, t, n)
    assert ctx.meter.nfe - before == (n - 1) * b * g
    full = ctx.rollout(prompt, x, t[:, None] * torch.linspace(1, 0, n + 1), [False] * n).states[:, -1]
    torch.testing.assert_close(x0_hat, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fgc.tweedie_x0(ctx, prompt, x, v, t, 1), x - t[:, None, None, None] * v)
    ctx = ctx_for({"method": "stepwise"})
    fgc.stepwise(ctx)
    assert ctx.meter.nfe == b * g * s + (n - 1) * (b * g * (s - 1) + b)
    assert ctx.meter.reward_calls == b * g * s + b


def test_tempflow_weights_average_one_and_advantages_are_zero_mean_per_seed_and_step():
    ctx = ctx_for({"method": "tempflow", "branch_steps": 0})
    tr, _ = fgc.tempflow(ctx)
    steps = torch.unique(tr.step)
    weights = torch.stack([tr.weight[tr.step == k][0] for k in steps])
    assert abs(weights.mean() - 1) < 1e-6 and weights[0] > weights[-1]  # noisier steps weigh more
    blocks = tr.advantage.view(-1, ctx.args.group_size)  # G branches of one (prompt, seed, k)
    assert blocks.sum(1).abs().max() < 1e-3 * blocks.abs().max()
    x = tr.x.view(-1, ctx.args.group_size, *tr.x.shape[1:])
    assert (x - x[:, :1]).abs().max() == 0, "children of one (prompt, seed, k) start from the same ODE state"


def test_g2rpo_branches_share_the_ode_anchor_and_single_granularity_is_singular_sampling():
    ctx = ctx_for({"method": "g2rpo", "granularities": "1", "branch_steps": 0})
    tr, _ = fgc.g2rpo(ctx)
    noise = fgc.initial_noise(ctx.policy, 2, fgc.generator("cpu", 0))  # the same first draw as the method's
    anchor = fgc.rollout(ctx.policy, ctx.cond, noise, ctx.grid, [False] * 6, ctx.args, fgc.Meter())
    for k in torch.unique(tr.step).tolist():
        expected = anchor.states[:, k].repeat_interleave(ctx.args.group_size, 0)  # (B*G, C, H, W)
        torch.testing.assert_close(tr[tr.step == k].x, expected)
    assert sorted(torch.unique(tr.step).tolist()) == [0, 1, 2]  # first half of the 6 steps
    for k in range(5):  # lambda = 1 continues on the base grid: singular stochastic sampling
        torch.testing.assert_close(fgc.continuation_grid(ctx.grid, k + 1, 1), ctx.grid[k + 1:])


@pytest.mark.parametrize("k,lam", [(k, lam) for k in range(8) for lam in (1, 2, 3)])
def test_g2rpo_continuations_end_at_zero_and_keep_the_first_base_step(k, lam):
    grid = fgc.time_grid(16, shift=3.0)
    coarse = fgc.continuation_grid(grid, k + 1, lam)
    assert coarse[-1] == 0 and coarse[0] == grid[k + 1] and coarse[1] == grid[k + 2]
    assert torch.all(coarse[1:] < coarse[:-1])


def test_chunk_ratio_is_step_ratio_for_size_one_and_sequence_ratio_for_one_chunk():
    log_new, log_old = torch.randn(6) * 1e-3, torch.randn(6) * 1e-3
    per_step = fgc.chunk_log_ratios(log_new, log_old, torch.arange(6))
    torch.testing.assert_close(per_step, log_new - log_old)
    one = fgc.chunk_log_ratios(log_new, log_old, torch.zeros(6, dtype=torch.long))
    torch.testing.assert_close(one, (log_new - log_old).mean()[None])
    two = fgc.chunk_log_ratios(log_new, log_old, torch.tensor([0, 0, 1, 1, 1, 0]))
    torch.testing.assert_close(two, torch.stack([(log_new - log_old)[[0, 1, 5]].mean(), (log_new - log_old)[2:5].mean()]))


def test_chunk_method_assigns_chunk_ids_by_sizes_and_samples_a_fraction():
    ctx = ctx_for({"method": "chunk", "chunks": "2,3"})
    tr, _ = fgc.chunk(ctx)
    first = tr.chunk[: 5]  # trajectory 0, steps 0..4
    assert first[0] == first[1] != first[2] == first[3] == first[4]
    ctx = ctx_for({"method": "chunk", "chunks": "1,1,3", "chunk_fraction": 0.34, "weighted_chunks": True})
    tr, _ = fgc.chunk(ctx)
    per_traj = [len(torch.unique(tr.chunk[tr.chunk // 3 == i])) for i in range(8)]
    assert per_traj == [1] * 8


def test_auto_chunks_cover_the_trained_steps_with_small_chunks_where_dynamics_change_fast():
    profile = torch.tensor([0.9, 0.5, 0.3, 0.2, 0.15, 0.12, 0.11, 0.105, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    sizes = fgc.chunks_from_profile(profile, 4)
    assert sum(sizes) == 16 and len(sizes) == 4 and min(sizes) >= 1 and sizes[0] < sizes[-1]


@pytest.mark.parametrize("method", fgc.METHOD_NAMES)
def test_first_inner_step_is_on_policy_for_every_method(method):
    ctx = ctx_for({"method": method, "beta": 0.01, "branch_steps": 2})
    tr, rewards = fgc.METHODS[method](ctx)
    assert len(tr) > 0 and torch.isfinite(tr.advantage).all() and torch.isfinite(rewards).all()
    params = [p for p in ctx.policy.net.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    stats = fgc.update(ctx.policy, opt, ctx.cond, tr, ctx.args, fgc.generator("cpu", 1))
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    assert abs(stats["ratio_first"] - 1) < 1e-5 and stats["clipfrac_first"] == 0
    assert stats["kl"] > 0, "the adapter is non-zero, so the reference differs"


def test_nfe_counts_every_forward_pass():
    ctx = ctx_for({"method": "g2rpo", "granularities": "1,2", "branch_steps": 0})
    fgc.g2rpo(ctx)
    # anchor 6 steps x 2 prompts; k in {0,1,2}: 8 branches x (1 SDE step + (5-k) + coarse lambda=2 steps)
    coarse = sum(len(fgc.continuation_grid(ctx.grid, k + 1, 2)) - 1 for k in range(3))
    assert ctx.meter.nfe == 12 + 8 * (3 + (5 + 4 + 3) + coarse)
    assert ctx.meter.reward_calls == 8 * 3 * 2


# ----------------------------------------------------------------------------------------------------
# CLI: bad input is one line and exit status 2, with nothing written


@pytest.mark.parametrize("argv,needle", [
    (["--method", "ppo"], "flow_grpo, stepwise, tempflow, g2rpo, chunk"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--iterations", "-1"], "--iterations must be >= 0"),
    (["--method", "chunk", "--chunks", "2,2"], "summing to the 9 trained steps"),
    (["--method", "g2rpo", "--granularities", "1,0"], "--granularities"),
    (["--sde", "euler"], "flow, ddim"),
    (["--pretrain-detailed", "1.5"], "--pretrain-detailed must be in [0, 1]"),
    (["--method", "all", "--jobs", "0"], "--jobs must be >= 1"),
    (["--device", "cuda"], "no CUDA"),
    (["--out", "/proc/forbidden"], "cannot create"),
])
def test_bad_input_is_a_one_line_error_with_status_2(argv, needle, tmp_path):
    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is present")
    out = ["--out", str(tmp_path / "runs")] if "--out" not in argv else []
    proc = subprocess.run([sys.executable, str(HERE / "flow_grpo_credit.py"), *argv, *out],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_weight_average_is_the_exponential_moving_average_and_restores_the_live_weights():
    p = torch.nn.Parameter(torch.zeros(3))
    average = fgc.WeightAverage([p], decay=0.9)
    with torch.no_grad():
        p.fill_(1.0)
    for _ in range(5):
        average.update()
    expected = 1 - 0.9**5  # the shadow started at 0 and moved 10% of the way to 1 five times
    torch.testing.assert_close(average.shadow[0], torch.full((3,), expected))
    with average.applied():
        torch.testing.assert_close(p.detach(), torch.full((3,), expected))
    torch.testing.assert_close(p.detach(), torch.ones(3))  # the live weights are back for training


def test_every_method_has_a_default_run_length():
    """--iterations 0 (the default) picks the method's ~10-minute run length; a method without one would
    fail only when a user runs it."""
    assert fgc.Args().iterations == 0 and fgc.DEFAULT_ITERATIONS.keys() == fgc.METHODS.keys()
    assert all(n >= 1 for n in fgc.DEFAULT_ITERATIONS.values())


# ----------------------------------------------------------------------------------------------------
# end to end on a briefly pretrained toy model: determinism, resume, non-finite guard, LoRA files


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def tiny_args(cache, out, **kw):
    base = dict(iterations=3, prompts_per_iter=2, group_size=2, steps=4, eval_steps=2, eval_per_tag=1,
                eval_every=2, pretrain_steps=30, cache_dir=cache, out=str(out), checkpoint_every=1)
    return fgc.Args(**{**base, **kw})


def strip_time(history):
    return [{k: v for k, v in h.items() if k != "wall_s"} for h in history]


def test_same_seed_gives_the_same_metrics(tiny_cache, tmp_path):
    a = fgc.train(tiny_args(tiny_cache, tmp_path / "a"))
    b = fgc.train(tiny_args(tiny_cache, tmp_path / "b"))
    assert strip_time(a) == strip_time(b)
    c = fgc.train(tiny_args(tiny_cache, tmp_path / "c", seed=1))
    assert strip_time(a) != strip_time(c)


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tiny_cache, tmp_path, monkeypatch):
    full = fgc.train(tiny_args(tiny_cache, tmp_path / "full", iterations=4))
    calls = {"n": 0}
    real = fgc.METHODS["flow_grpo"]

    def dies_in_iteration_3(ctx):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(ctx)

    monkeypatch.setitem(fgc.METHODS, "flow_grpo", dies_in_iteration_3)
    with pytest.raises(KeyboardInterrupt):
        fgc.train(tiny_args(tiny_cache, tmp_path / "killed", iterations=4))
    monkeypatch.setitem(fgc.METHODS, "flow_grpo", real)
    run = next((tmp_path / "killed").iterdir())
    assert torch.load(run / "checkpoint.pt", weights_only=False)["iteration"] == 2
    args, resume = fgc.parse_args(["--resume", str(run)])
    assert args.iterations == 4 and resume == str(run)
    resumed = fgc.train(args, resume)
    assert strip_time(resumed) == strip_time(full)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert strip_time(lines) == strip_time(full)
    full_run = next((tmp_path / "full").iterdir())
    a = torch.load(full_run / "checkpoint.pt", weights_only=False)["lora"]
    b = torch.load(run / "checkpoint.pt", weights_only=False)["lora"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chunk_boundaries_come_from_the_base_model_also_when_a_run_resumes(tiny_cache, tmp_path, monkeypatch):
    adapter_is_zero, real = [], fgc.auto_chunk_sizes

    def spy(policy, *rest):  # LoRA starts with B = 0: a zero adapter is the base model
        adapter_is_zero.append(all(not p.any() for n, p in policy.net.named_parameters() if "lora_B" in n))
        return real(policy, *rest)

    monkeypatch.setattr(fgc, "auto_chunk_sizes", spy)
    first = fgc.train(tiny_args(tiny_cache, tmp_path, method="chunk", num_chunks=2, iterations=2, lr=1e-2))
    run = next(tmp_path.iterdir())
    args, resume = fgc.parse_args(["--resume", str(run), "--iterations", "3"])
    fgc.train(args, resume)
    assert adapter_is_zero == [True, True]  # the resumed run's trained adapter did not move the boundaries
    assert first[0]["chunk_sizes"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["chunk_sizes"]


def test_non_finite_rewards_skip_updates_and_then_stop(tiny_cache, tmp_path, monkeypatch):
    real = fgc.toy_reward
    calls = {"n": 0}

    def nan_in_iteration_2(images, metas):  # calls: the evaluation at 0, iteration 1, iteration 2, ...
        calls["n"] += 1
        r = real(images, metas)
        return r * float("nan") if calls["n"] == 3 else r

    monkeypatch.setattr(fgc, "toy_reward", nan_in_iteration_2)
    history = fgc.train(tiny_args(tiny_cache, tmp_path / "once"))
    skipped = [h for h in history if h.get("skipped")]
    assert [h["iteration"] for h in skipped] == [2] and history[-1].get("eval_overall") is not None

    monkeypatch.setattr(fgc, "toy_reward", lambda images, metas: torch.full((len(images),), float("nan")))
    with pytest.raises(fgc.RunError, match="3 iterations in a row"):
        fgc.train(tiny_args(tiny_cache, tmp_path / "always", iterations=5))
    run = next((tmp_path / "always").iterdir())
    assert not (run / "checkpoint.pt").exists(), "no checkpoint from a poisoned state"


def test_saved_lora_loads_into_a_fresh_unet_with_diffusers(tiny_cache, tmp_path):
    args = tiny_args(tiny_cache, tmp_path, iterations=2, lr=1e-2)
    fgc.train(args)
    run = next(tmp_path.iterdir())
    assert (run / "lora" / "pytorch_lora_weights.safetensors").exists()
    assert (run / "reward_curve.png").exists() and (run / "samples_0002.png").exists()
    trained = fgc.load_toy(args, torch.device("cpu"))
    with torch.no_grad():  # what is saved is the moving average of the adapter weights, as Flow-GRPO saves its EMA
        for p, avg in zip(fgc.add_lora(trained, args), torch.load(run / "checkpoint.pt", weights_only=False)["ema"]):
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


def test_torchrun_with_two_cpu_ranks_keeps_their_weights_identical(tiny_cache, tmp_path):
    """2 processes, gloo backend, group size 2: each group has one member on each rank, so only the
    all-gathered rewards give it a spread (zero_std_frac < 1) and a non-zero advantage; gradients are
    averaged, so both ranks end with the same adapter; rank 0 alone writes the run folder; its metrics
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
args = fgc.Args(iterations=2, prompts_per_iter=2, group_size=2, steps=4, eval_steps=2, eval_per_tag=1, eval_every=2,
                pretrain_steps=30, cache_dir={tiny_cache!r}, out={str(tmp_path / 'runs')!r}, device="cpu", lr=1e-2)
fgc.train(args)
torch.save({{"trained": [p.detach() for p in params], "init": init}}, {str(tmp_path)!r} + f"/rank{{os.environ['RANK']}}.pt")
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
                           str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(a["trained"]) == len(b["trained"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["trained"], b["trained"])), "both ranks hold the same weights"
    assert any(not torch.equal(x, y) for x, y in zip(a["trained"], a["init"])), "and training moved them"
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, "only rank 0 writes a run folder"
    lines = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    first = next(h for h in lines if h["iteration"] == 1 and "reward_mean" in h)
    assert first["reward_calls"] == 2 * 2, "both ranks' images (2 prompts x 1 member each) are counted"
    train_lines = [h for h in lines if "reward_mean" in h]
    assert min(h["zero_std_frac"] for h in train_lines) < 1, "groups spanning ranks were normalised as a whole"


def test_group_advantages_under_torchrun_equal_the_single_process_ones(tmp_path):
    """Rewards are all-gathered before group normalisation: two ranks holding halves of every group get
    exactly the advantages one process computes for the whole batch, each its own half."""
    script = tmp_path / "ddp_adv.py"
    script.write_text(f"""import os, sys, torch
sys.path.insert(0, {str(HERE)!r})
import flow_grpo_credit as fgc
dist = fgc.Dist.setup(torch.device("cpu"))
r = torch.arange(8.0) ** 2 + dist.rank * 5  # rank 0: members 0-7, rank 1: members 8-15
group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # every group has 2 members here and 2 on the other rank
ctx = fgc.Context(None, fgc.Args(), fgc.Meter(), fgc.generator("cpu", 0), [], {{}}, torch.zeros(2), None, dist=dist)
torch.save({{"adv": ctx.advantages(r, group), "zero_std": ctx.stats["zero_std"]}}, {str(tmp_path)!r} + f"/adv{{dist.rank}}.pt")
torch.distributed.destroy_process_group()  # gloo aborts at exit without it, now and then
""")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534",
                           str(script)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [torch.load(tmp_path / f"adv{rank}.pt") for rank in (0, 1)]
    r = torch.cat([torch.arange(8.0) ** 2, torch.arange(8.0) ** 2 + 5])
    whole = fgc.Context(None, fgc.Args(), fgc.Meter(), fgc.generator("cpu", 0), [], {}, torch.zeros(2), None)
    expected = whole.advantages(r, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3] * 2))
    torch.testing.assert_close(torch.cat([g["adv"] for g in got]), expected)
    assert got[0]["zero_std"] == got[1]["zero_std"] == whole.stats["zero_std"] == [False] * 4

def test_benchmark_counts_flops_per_forward_pass_consistently_with_nfe(tiny_cache):
    """--benchmark counts FLOPs for a whole iteration and divides by the nfe it counted: that must be
    the FLOPs of one single-image forward pass of the same adapted model, measured on its own."""
    from torch.utils.flop_counter import FlopCounterMode

    args = tiny_args(tiny_cache, "unused", benchmark=1, group_size=3, device="cpu")
    result = fgc.benchmark(args)
    policy = fgc.load_policy(args, torch.device("cpu"))
    fgc.add_lora(policy, args)
    cond, counter = policy.encode(["a red circle"]), FlopCounterMode(display=False)
    with counter, torch.no_grad():
        policy.velocity(torch.randn(1, 3, fgc.RES, fgc.RES), torch.tensor([0.5]), cond)
    assert counter.get_total_flops() > 0
    assert result["flops_per_pass"] == pytest.approx(counter.get_total_flops(), rel=1e-6)
    assert result["images"] == 2 * 3 and result["passes"] == 2 * 3 * 4, "2 prompts x group 3, 4 SDE steps"
    assert result["flops_per_transition"] > 2 * result["flops_per_pass"], "forward + backward (+ reference pass)"
    assert result["mfu_sampling"] is None, "no known peak on a CPU"


def test_random_sd35_medium_builds_the_real_shapes_with_the_real_classes(monkeypatch):
    """The GPU benchmark's model: SD3.5-M's configs with random weights. Shrunk here to run on a CPU;
    the prompt embeddings keep SD3.5's layout (77 CLIP + 256 T5 tokens, pooled = both CLIP widths)."""
    monkeypatch.setattr(fgc, "SD35_MEDIUM", {
        "transformer": dict(fgc.SD35_MEDIUM["transformer"], sample_size=8, num_layers=2, attention_head_dim=8,
                            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                            pooled_projection_dim=16, pos_embed_max_size=16, dual_attention_layers=(0,)),
        "vae": dict(fgc.SD35_MEDIUM["vae"], block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1),
        "clip_widths": (8, 8), "shift": 3.0})
    monkeypatch.setattr(fgc, "PICKSCORE_ARCH", {
        "text_config": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        "vision_config": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              patch_size=14, image_size=224), "projection_dim": 8})
    args = fgc.Args(model=fgc.RANDOM_SD35M, reward_model="random", resolution=64, steps=4, group_size=2,
                    prompts_per_iter=1, benchmark=1, device="cpu")
    result = fgc.benchmark(args)
    assert result["images"] == 2 and result["passes"] == 2 * 4 * 2, "real CFG: two forward passes a step"
    policy = fgc.random_sd35_medium(args, torch.device("cpu"))
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    assert isinstance(policy.pipe, StableDiffusion3Pipeline) and isinstance(policy.net, SD3Transformer2DModel)
    cond = policy.encode(["a red circle"])
    assert cond["encoder_hidden_states"].shape == (1, 77 + 256, 32) and cond["pooled_projections"].shape == (1, 16)
    torch.testing.assert_close(policy.time_grid(4), fgc.time_grid(4, shift=3.0))


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
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel,
                           SD3Transformer2DModel, StableDiffusion3Pipeline)
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTextModel,
                              CLIPTextModelWithProjection, T5Config, T5EncoderModel, T5TokenizerFast)

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
    StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                          caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=32),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae(),
        text_encoder=CLIPTextModelWithProjection(tiny_text_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(tiny_text_config()), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_model, tokenizer_3=t5_tok).save_pretrained(root / "sd3")
    t5_model, t5_tok = t5()
    FluxPipeline(
        transformer=FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                           pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4)),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        vae=vae(), text_encoder=CLIPTextModel(tiny_text_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=t5_model, tokenizer_2=t5_tok).save_pretrained(root / "flux")
    CLIPModel(CLIPConfig(text_config=tiny_text_config().to_dict(),
                         vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                            image_size=32, patch_size=8, projection_dim=32),
                         projection_dim=32)).save_pretrained(root / "clip")
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=clip_tokenizer()).save_pretrained(root / "clip")
    (root / "prompts.txt").write_text("".join(f"a photo of {w}\n" for w in
                                              ["a cat", "a dog", "two cups", "a red car", "a house", "a tree",
                                               "a bird", "a boat", "a lamp", "a clock", "a chair", "a ball"]))
    return root


def real_args(root, out, model="sd3", **kw):
    base = dict(model=str(root / model), reward="pickscore", reward_model=str(root / "clip"), prompts=str(root / "prompts.txt"),
                resolution=32, iterations=1, prompts_per_iter=2, group_size=2, steps=4, eval_steps=2, eval_every=1,
                out=str(out), guidance=0.0, branch_steps=1, tweedie_substeps=1, chunks="1,2")
    return fgc.Args(**{**base, **kw})


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_every_method_trains_a_real_pipeline_and_its_lora_loads_into_diffusers(tiny_real, tmp_path, model):
    from diffusers import DiffusionPipeline

    for method in fgc.METHOD_NAMES:
        history = fgc.train(real_args(tiny_real, tmp_path / method, model, method=method))
        steps = [h for h in history if "reward_mean" in h]
        assert len(steps) == 1 and all(np.isfinite(h["loss"]) and abs(h["ratio_first"] - 1) < 1e-5 for h in steps)
        assert [h["iteration"] for h in history if "eval_overall" in h] == [0, 1]
    run = next((tmp_path / "flow_grpo").iterdir())
    args = real_args(tiny_real, tmp_path, model)
    trained = fgc.load_pipeline(args, torch.device("cpu"))
    with torch.no_grad():  # the saved LoRA is the moving average of the adapter weights
        for p, avg in zip(fgc.add_lora(trained, args), torch.load(run / "checkpoint.pt", weights_only=False)["ema"]):
            p.copy_(avg)
    pipe = DiffusionPipeline.from_pretrained(tiny_real / model)
    pipe.load_lora_weights(run / "lora")  # diffusers' own loader reads the saved file
    fresh = fgc.PipelinePolicy(pipe, args, torch.device("cpu"))
    base = fgc.load_pipeline(args, torch.device("cpu"))
    x = torch.randn(trained.latent_shape(2))
    t, cond = torch.tensor([0.9, 0.4]), trained.encode(["a photo of a cat", "a house"])
    fresh.encode(["a photo of a cat", "a house"])  # fills its embedding cache (the negative branch reads it)
    base.encode(["a photo of a cat", "a house"])
    with torch.no_grad():
        v_trained, v_fresh, v_base = (p.velocity(x, t, cond) for p in (trained, fresh, base))
    torch.testing.assert_close(v_fresh, v_trained, atol=1e-5, rtol=1e-4)
    assert (v_trained - v_base).abs().max() > 1e-6, "training changed the adapter"


def test_real_time_grids_come_from_the_pipelines_schedulers(tiny_real):
    sd3 = fgc.load_pipeline(real_args(tiny_real, "x"), torch.device("cpu"))
    shift = 3.0  # SD3's static shift: sigma' = s*sigma / (1 + (s-1)*sigma) of the linear grid, up to the
    lin = fgc.time_grid(10)[:-1]  # scheduler's sigma_min (the last step moves by < 6e-3)
    torch.testing.assert_close(sd3.time_grid(10)[:-1], shift * lin / (1 + (shift - 1) * lin), atol=6e-3, rtol=0)
    flux = fgc.load_pipeline(real_args(tiny_real, "x", "flux"), torch.device("cpu"))
    grid = flux.time_grid(10)
    assert grid[0] == 1 and grid[-1] == 0 and (grid[1:] < grid[:-1]).all() and not torch.allclose(grid, fgc.time_grid(10))


def test_clip_rewards_follow_their_formulas_and_weighted_sums_add(tiny_real):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    images = (torch.rand(3, 3, 32, 32) * 255).round() / 255
    metas = [{"prompt": p} for p in ["a cat", "two cups", "a red car"]]
    args = real_args(tiny_real, "x")
    pick = fgc.build_reward(args, "cpu")(images, metas)
    clip = fgc.build_reward(dataclasses.replace(args, reward="clip"), "cpu")(images, metas)
    model, proc = CLIPModel.from_pretrained(tiny_real / "clip"), CLIPProcessor.from_pretrained(tiny_real / "clip")
    pil = [Image.fromarray((im.permute(1, 2, 0) * 255).byte().numpy()) for im in images]
    inputs = proc(text=[m["prompt"] for m in metas], images=pil, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)
    torch.testing.assert_close(pick, model.logit_scale.exp().detach() * cos / 26, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(clip, 2.5 * cos.clamp_min(0), atol=1e-4, rtol=1e-4)
    both = fgc.build_reward(dataclasses.replace(args, reward="pickscore:0.7,clip:0.3",
                                                reward_model=f"pickscore={tiny_real / 'clip'},clip={tiny_real / 'clip'}"), "cpu")
    torch.testing.assert_close(both(images, metas), 0.7 * pick + 0.3 * clip)


def test_bad_real_inputs_are_one_line_errors(tiny_real, tmp_path):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
    from transformers import CLIPTextModel

    DDPMPipeline(UNet2DModel(block_out_channels=(8, 8), norm_num_groups=4, sample_size=8,
                             down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2),
                 DDPMScheduler()).save_pretrained(tmp_path / "ddpm")
    CLIPTextModel(tiny_text_config()).save_pretrained(tmp_path / "text_only")
    cases = [(dict(model=str(tmp_path / "missing")), "no such folder"),
             (dict(model=str(tmp_path / "ddpm")), "expected a StableDiffusion3Pipeline or FluxPipeline"),
             (dict(reward="pickscore:heavy"), "weights must be numbers"),
             (dict(reward="aesthetic"), "unknown reward 'aesthetic'"),
             (dict(reward_model=str(tmp_path / "text_only")), "needs a CLIP model"),
             (dict(reward="toy"), "--reward toy scores the built-in toy prompts"),
             (dict(prompts=str(tmp_path / "none.txt")), "--prompts"),
             (dict(dtype="fp8"), "--dtype must be")]
    for overrides, needle in cases:
        with pytest.raises(fgc.UsageError, match=re.escape(needle)) as err:
            fgc.train(real_args(tiny_real, tmp_path / "runs", **overrides))
        assert "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "nothing half-written"


# ----------------------------------------------------------------------------------------------------
# a measured improvement with the real pretrained toy model (pretrained once, ~5 min, then cached)


def test_a_short_grpo_run_raises_the_reward_of_its_prompts():
    """Flow-GRPO for 12 iterations on two prompts raises their deterministic (ODE, fixed-noise) reward:
    the whole pipeline learns, measured, not just runs. The reward is a smooth one, how red the image
    is, so the margin does not hang on the pretrained weights, which differ slightly between CPUs
    (toy-GenEval gains are measured by the README's benchmark runs instead)."""
    args = fgc.Args(prompts_per_iter=2, group_size=8, inner_updates=4, lr=2e-3)  # a short run learns faster at 2e-3
    policy = fgc.load_toy(args, torch.device("cpu"))
    opt = torch.optim.AdamW(fgc.add_lora(policy, args), lr=args.lr, weight_decay=args.weight_decay)
    metas = fgc.eval_prompts(1)[:2]
    cond, grid = policy.encode([m["prompt"] for m in metas]), fgc.time_grid(args.steps)

    def redness(images, metas):  # (N, 3, H, W) -> (N,): red channel minus the mean of the others
        return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))

    def ode_reward(n=16):
        prompt = torch.arange(len(metas)).repeat_interleave(n)
        x = fgc.initial_noise(policy, len(prompt), fgc.generator("cpu", "held-out noise"))
        traj = fgc.rollout(policy, {k: v[prompt] for k, v in cond.items()}, x, grid, [False] * args.steps, args, fgc.Meter())
        return redness(policy.decode(traj.states[:, -1]), None).mean().item()

    before = ode_reward()
    for it in range(12):
        ctx = fgc.Context(policy, args, fgc.Meter(), fgc.generator("cpu", "test-rollout", it), metas, cond, grid, redness)
        transitions, _ = fgc.flow_grpo(ctx)
        fgc.update(policy, opt, cond, transitions, args, ctx.gen)
    after = ode_reward()
    print(f"redness of the trained prompts' ODE samples: {before:.3f} -> {after:.3f}")
    assert after > before + 0.04

def test_method_all_writes_a_table_scored_within_equal_budgets(tiny_cache, tmp_path):
    args = tiny_args(tiny_cache, tmp_path, method="flow_grpo,stepwise", iterations=2, eval_every=1, compare_seeds="0,1",
                     tweedie_substeps=1)  # two methods keep the suite short; `all` is the same code with five
    folder = fgc.compare(args)
    table = (folder / "comparison.md").read_text()
    assert all(f"| {m} |" in table for m in ("flow_grpo", "stepwise")) and (folder / "comparison.png").exists()
    run_dirs = sorted(run for run in folder.iterdir() if run.is_dir())
    runs = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in run_dirs]
    assert len(runs) == 4
    evals = [[h for h in run if "eval_overall" in h] for run in runs]
    nfe_budget = min(e[-1]["nfe"] for e in evals)
    assert f"{nfe_budget:.3g} forward passes" in table
    stepwise_runs = [e for run, e in zip(run_dirs, evals) if run.name.startswith("stepwise")]
    assert len(stepwise_runs) == 2
    within = [[x for x in e if x["nfe"] <= nfe_budget][-1]["eval_overall"] for e in stepwise_runs]
    row = next(line for line in table.splitlines() if line.startswith("| stepwise |"))
    assert row.split("|")[5].strip() == f"{np.mean(within):.3f} ± {np.std(within):.3f}"


def test_parallel_comparison_repeats_each_run_exactly_and_resumes_to_more_iterations(tiny_cache, tmp_path):
    args = tiny_args(tiny_cache, tmp_path / "runs", compare_seeds="0,1", iterations=2, eval_every=1, jobs=2)
    folder = fgc.compare(args)  # two runs at once, in two processes
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))  # the worker's share: the thread count changes float sums
    try:
        alone = fgc.train(dataclasses.replace(args, seed=1, out=str(tmp_path / "alone")))
    finally:
        torch.set_num_threads(threads)
    runs = sorted(run for run in folder.iterdir() if run.is_dir())

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    before = {run.name: records(run) for run in runs}
    assert strip_time(before[runs[1].name]) == strip_time(alone) and runs[1].name.startswith("flow_grpo-seed1")
    assert fgc.main(["--resume", str(folder), "--iterations", "3"]) == 0
    assert sorted(run for run in folder.iterdir() if run.is_dir()) == runs  # continued in place, none restarted
    for run in runs:
        after = records(run)
        assert after[: len(before[run.name])] == before[run.name] and after[-1]["iteration"] == 3
    assert "3 iterations each" in (folder / "comparison.md").read_text()
    assert fgc.main(["--resume", str(runs[0]), "--iterations", "4"]) == 0  # one run of it resumes alone
    assert [records(run)[-1]["iteration"] for run in runs] == [4, 3] and not any(p.is_dir() for p in runs[0].iterdir() if p.name != "lora")


def test_train_fraction_and_branch_steps_subsample_what_is_trained(monkeypatch):
    ctx = ctx_for({"train_fraction": 0.5, "inner_updates": 2})
    tr, _ = fgc.flow_grpo(ctx)
    seen, real = [], fgc.grpo_loss
    monkeypatch.setattr(fgc, "grpo_loss", lambda policy, cond, mb, args: (seen.append(len(mb)), real(policy, cond, mb, args))[1])
    params = [p for p in ctx.policy.net.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    fgc.update(ctx.policy, torch.optim.SGD(params, lr=0.0), ctx.cond, tr, ctx.args, fgc.generator("cpu", 2))
    assert len(seen) == 2 and sum(seen) == round(len(tr) * 0.5)
    assert all(torch.equal(p, s) for p, s in zip(params, saved))
    tr, _ = fgc.tempflow(ctx_for({"method": "tempflow", "branch_steps": 2}))
    assert len(torch.unique(tr.step)) == 2


# ----------------------------------------------------------------------------------------------------
# notebooks: each runs top to bottom as shipped, and its exercise checks can both fail and pass

NOTEBOOKS = ["01_flow_grpo_walkthrough.ipynb", "02_credit_assignment_side_by_side.ipynb"]

NOTEBOOK_SOLUTIONS = {  # reference solutions of the exercise cells, by the cell's "exercise" metadata
    "01_flow_grpo_walkthrough.ipynb": {
        "group_advantages": '''
def group_advantages(r, group):
    out = torch.empty_like(r)
    for g in torch.unique(group):
        rg = r[group == g]
        out[group == g] = (rg - rg.mean()) / (rg.std(unbiased=False) + 1e-4)
    return out
''',
        "kl_per_transition": '''
def kl_per_transition(tr):
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * tr.std**2)
''',
    },
    "02_credit_assignment_side_by_side.ipynb": {
        "per_step_advantages": '''
def per_step_advantages(ctx, r, prompt):
    gains = r[:, 1:] - r[:, :-1]  # (B*G, S)
    s = gains.shape[1]
    group = prompt[:, None] * s + torch.arange(s)  # one group per (prompt, step)
    return ctx.advantages(gains.flatten(), group.flatten()).view_as(gains)
''',
        "tempflow_weights": '''
def tempflow_weights(grid, args):
    stds = fgc.step_stds(grid, args)
    return stds / stds[fgc.trainable_steps(grid, args)].mean()
''',
        "chunk_ids": '''
def step_chunks(tr):
    return torch.arange(len(tr))


def sequence_chunks(tr):
    return torch.arange(len(tr)) // n_trained
''',
    },
}


def run_notebook(name: str) -> tuple[list[str], list[str]]:
    """Execute notebooks/<name> top to bottom as shipped (a cell error raises CellExecutionError),
    then, in the same kernel, every cell from its first exercise to the end again with the reference
    solutions in place of the exercise cells. Returns what each check cell printed, as shipped and solved."""
    import nbformat
    from nbclient import NotebookClient

    folder = HERE / "notebooks"
    nb = nbformat.read(folder / name, as_version=4)
    exercises = [i for i, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", [])]
    checks = [i for i, c in enumerate(nb.cells) if "check" in c.metadata.get("tags", [])]
    solutions = NOTEBOOK_SOLUTIONS[name]
    assert checks and {nb.cells[i].metadata["exercise"] for i in exercises} == set(solutions)

    def printed():
        return ["".join(o.get("text", "") for o in nb.cells[i].outputs) for i in checks]

    client = NotebookClient(nb, kernel_name="python3", timeout=900, resources={"metadata": {"path": str(folder)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        shipped = printed()
        for i in range(exercises[0], len(nb.cells)):
            if i in exercises:
                nb.cells[i].source = solutions[nb.cells[i].metadata["exercise"]]
            client.execute_cell(nb.cells[i], i)
        solved = printed()
    return shipped, solved


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_exercise_checks_fail_as_shipped_and_pass_when_solved(name):
    shipped, solved = run_notebook(name)
    assert all("✗" in out and "✓" not in out for out in shipped), shipped
    assert all("✓" in out and "✗" not in out for out in solved), solved


def test_notebooks_are_committed_executed_and_small():
    import nbformat

    for name in NOTEBOOKS:
        path = HERE / "notebooks" / name
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), f"{name}: commit it executed, so that GitHub shows the outputs"
        assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
        assert path.stat().st_size < 1.5e6
