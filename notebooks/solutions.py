"""The notebooks' exercises solved, and the wrong answers their checks must reject.

A course that hands students the repository leaves this file out: nothing but the tests imports it (`python -m pytest
-k wrong_answers` runs them). An exercise cell is tagged "exercise" and names itself in its "exercise" metadata; the
cells tagged "check" right after it are its checks. For each exercise:
    solution  the source of a correct exercise cell: every check prints ✓;
    wrong     {what it is: source}: the library shortcut (a name starting "shortcut", the function of `fgc` or of the
              notebook that the exercise asks the student to write) and the wrong answers students most likely
              write; for each, the exercise's checks print ✗.
"""
from typing import NamedTuple


class Exercise(NamedTuple):
    solution: str
    wrong: dict[str, str]


# ----------------------------------------------------------------------------------------------------
# 01_flow_grpo_walkthrough.ipynb

NB01 = {
    "sde_mean_std": Exercise(
        solution='''
def sde_mean_std(x, v, t, t_next, a):
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t - t_next
    sigma = a * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    x1_hat = x + (1 - t) * v
    return x - dt * (v + sigma**2 / (2 * t) * x1_hat), (sigma * dt.sqrt()).flatten()
''',
        wrong={
            "shortcut: sde_step imported under its own name": '''
from flow_grpo_credit import sde_step


def sde_mean_std(x, v, t, t_next, a):
    _, _, mean, std = sde_step(x, v, t, t_next, noise_level=a, noise=torch.zeros_like(x))
    return mean, std
''',
            "t = 1 taken to be the first of the batch": '''
def sde_mean_std(x, v, t, t_next, a):
    denominator = 1 - t.clone()
    denominator[0] = 1 - t_next[0]
    t, t_next, denominator = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1), denominator.view(-1, 1, 1, 1)
    dt, sigma = t - t_next, a * torch.sqrt(t / denominator)
    return x - dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v)), (sigma * dt.sqrt()).flatten()
''',
            "shortcut: fgc.sde_step": '''
def sde_mean_std(x, v, t, t_next, a):
    _, _, mean, std = fgc.sde_step(x, v, t, t_next, noise_level=a, noise=torch.zeros_like(x))
    return mean, std
''',
            "no 1/(2t) in the drift's correction": '''
def sde_mean_std(x, v, t, t_next, a):
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t - t_next
    sigma = a * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    return x - dt * (v + sigma**2 * (x + (1 - t) * v)), (sigma * dt.sqrt()).flatten()
''',
            "std without sqrt(dt)": '''
def sde_mean_std(x, v, t, t_next, a):
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t - t_next
    sigma = a * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    return x - dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v)), sigma.flatten()
''',
            "the wrong sign of dt": '''
def sde_mean_std(x, v, t, t_next, a):
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t_next - t
    sigma = a * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    return x - dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v)), (sigma * dt.abs().sqrt()).flatten()
''',
            "t in the denominator at t = 1": '''
def sde_mean_std(x, v, t, t_next, a):
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t - t_next
    sigma = a * torch.sqrt(t / (1 - t))
    return x - dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v)), (sigma * dt.sqrt()).flatten()
''',
        }),
    "group_advantages": Exercise(
        solution='''
def group_advantages(r, group):
    out = torch.empty_like(r)
    for g in torch.unique(group):
        rg = r[group == g]
        out[group == g] = (rg - rg.mean()) / (rg.std(unbiased=False) + 1e-4)
    return out
''',
        wrong={
            "groups of equal size assumed": '''
def group_advantages(r, group):
    order = torch.argsort(group, stable=True)
    rs = r[order].view(len(torch.unique(group)), -1)
    a = (rs - rs.mean(1, keepdim=True)) / (rs.std(1, unbiased=False, keepdim=True) + 1e-4)
    out = torch.empty_like(r)
    out[order] = a.flatten()
    return out
''',
            "shortcut: fgc.group_normalise": '''
def group_advantages(r, group):
    return fgc.group_normalise(r, group)[0]
''',
            "the sample std": '''
def group_advantages(r, group):
    out = torch.empty_like(r)
    for g in torch.unique(group):
        rg = r[group == g]
        out[group == g] = (rg - rg.mean()) / (rg.std() + 1e-4)
    return out
''',
            "the whole batch as one group": '''
def group_advantages(r, group):
    return (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
''',
            "no 1e-4: NaN for equal rewards": '''
def group_advantages(r, group):
    out = torch.empty_like(r)
    for g in torch.unique(group):
        rg = r[group == g]
        out[group == g] = (rg - rg.mean()) / rg.std(unbiased=False)
    return out
''',
            "no 1e-4, but zeros for a group of equal rewards": '''
def group_advantages(r, group):
    out = torch.zeros_like(r)
    for g in torch.unique(group):
        rg = r[group == g]
        if rg.std(unbiased=False) > 0:
            out[group == g] = (rg - rg.mean()) / rg.std(unbiased=False)
    return out
''',
        }),
    "clipped_loss": Exercise(
        solution='''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old)
    return torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - eps, 1 + eps)).mean()
''',
        wrong={
            "the mean over the transitions with an advantage": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old)
    terms = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - eps, 1 + eps))
    return terms[advantage != 0].mean()
''',
            "shortcut: fgc.grpo_loss": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    return fgc.grpo_loss(policy, ctx.cond, transitions, dataclasses.replace(args, clip_range=eps, beta=0.0))[0]
''',
            "min instead of max of the negated terms": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old)
    return torch.minimum(-advantage * ratio, -advantage * ratio.clamp(1 - eps, 1 + eps)).mean()
''',
            "the advantage clipped instead of the ratio": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old)
    return torch.maximum(-advantage * ratio, -advantage.clamp(1 - eps, 1 + eps) * ratio).mean()
''',
            "the clip on the upper side only": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old)
    return torch.maximum(-advantage * ratio, -advantage * ratio.clamp(max=1 + eps)).mean()
''',
            "the ratio detached: no gradient": '''
def clipped_loss(log_prob, log_prob_old, advantage, eps):
    ratio = torch.exp(log_prob - log_prob_old).detach()
    return torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - eps, 1 + eps)).mean()
''',
        }),
    "kl_per_transition": Exercise(
        solution='''
def kl_per_transition(tr):
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * tr.std**2)
''',
        wrong={
            "the walkthrough's transitions, whatever it is given": '''
def kl_per_transition(tr):
    tr = transitions
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * tr.std**2)
''',
            "shortcut: fgc.gaussian_kl": '''
def kl_per_transition(tr):
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    return fgc.gaussian_kl(mean, mean_ref, tr.std)
''',
            "shortcut: grpo_loss's mean KL for every transition": '''
def kl_per_transition(tr):
    return torch.full((len(tr),), float(fgc.grpo_loss(policy, ctx.cond, tr, args)[1]["kl"]))
''',
            "the walkthrough's mean KL for every transition": '''
def kl_per_transition(tr):
    return torch.full((len(tr),), after["kl"])
''',
            "divided by sigma_t^2 instead of s_k^2": '''
def kl_per_transition(tr):
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    sigma2 = tr.std**2 / (tr.t - tr.t_next)
    return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * sigma2)
''',
            "a sum over the dimensions": '''
def kl_per_transition(tr):
    cond = ctx.cond_of(tr.prompt)
    v = policy.velocity(tr.x, tr.t, cond)
    with fgc.adapter_disabled(policy.net):
        v_ref = policy.velocity(tr.x, tr.t, cond)
    mean = fgc.sde_step(tr.x, v, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    mean_ref = fgc.sde_step(tr.x, v_ref, tr.t, tr.t_next, noise_level=args.noise_level, prev_sample=tr.x_next)[2]
    return ((mean - mean_ref) ** 2).flatten(1).sum(1) / (2 * tr.std**2)
''',
        }),
}

# ----------------------------------------------------------------------------------------------------
# 02_credit_assignment_side_by_side.ipynb

NB02 = {
    "per_step_advantages": Exercise(
        solution='''
def per_step_advantages(ctx, r, prompt):
    gains = r[:, 1:] - r[:, :-1]  # (B*G, S)
    s = gains.shape[1]
    group = prompt[:, None] * s + torch.arange(s)  # one group per (prompt, step)
    return ctx.advantages(gains.flatten(), group.flatten()).view_as(gains)
''',
        wrong={
            "group ids from the notebook's S, not the rewards' steps": '''
def per_step_advantages(ctx, r, prompt):
    gains = r[:, 1:] - r[:, :-1]
    group = prompt[:, None] * S + torch.arange(gains.shape[1])
    return ctx.advantages(gains.flatten(), group.flatten()).view_as(gains)
''',
            "shortcut: fgc.gain_advantages, the joint normalisation": '''
def per_step_advantages(ctx, r, prompt):
    return fgc.gain_advantages(ctx, r, prompt)
''',
            "grouped by step only, the prompts pooled": '''
def per_step_advantages(ctx, r, prompt):
    gains = r[:, 1:] - r[:, :-1]
    group = torch.arange(gains.shape[1]).expand_as(gains)
    return ctx.advantages(gains.flatten(), group.flatten()).view_as(gains)
''',
            "the sample std instead of the population std": '''
def per_step_advantages(ctx, r, prompt):
    gains = r[:, 1:] - r[:, :-1]
    out = torch.empty_like(gains)
    for p in prompt.unique():
        g = gains[prompt == p]
        out[prompt == p] = (g - g.mean(0)) / (g.std(0) + 1e-4)
    return out
''',
            "the rewards normalised per step instead of the gains": '''
def per_step_advantages(ctx, r, prompt):
    later = r[:, 1:]
    s = later.shape[1]
    group = prompt[:, None] * s + torch.arange(s)
    return ctx.advantages(later.flatten(), group.flatten()).view_as(later)
''',
        }),
    "tempflow_weights": Exercise(
        solution='''
def tempflow_weights(grid, args):
    stds = fgc.step_stds(grid, args)
    return stds / stds[fgc.trainable_steps(grid, args)].mean()
''',
        wrong={
            "the flow SDE's std written out, whatever args.sde": '''
def tempflow_weights(grid, args):
    t, t_next = grid[:-1], grid[1:]
    s = args.noise_level * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t))) * torch.sqrt(t - t_next)
    return s / s[fgc.trainable_steps(grid, args)].mean()
''',
            "shortcut: the weights fgc.tempflow gave section 1's transitions": '''
def tempflow_weights(grid, args):
    tr = runs["tempflow"]["tr"]
    w = torch.ones(len(grid) - 1)
    for k in torch.unique(tr.step).tolist():
        if k < len(w):
            w[k] = tr.weight[tr.step == k][0]
    return w
''',
            "normalised over all steps, the untrained included": '''
def tempflow_weights(grid, args):
    stds = fgc.step_stds(grid, args)
    return stds / stds.mean()
''',
            "normalised over every step but the last": '''
def tempflow_weights(grid, args):
    stds = fgc.step_stds(grid, args)
    return stds / stds[:-1].mean()
''',
            "sigma_t instead of the transition std s_k": '''
def tempflow_weights(grid, args):
    t, t_next = grid[:-1], grid[1:]
    sigma = args.noise_level * torch.sqrt(t / (1 - torch.where(t >= 1, t_next, t)))
    return sigma / sigma[fgc.trainable_steps(grid, args)].mean()
''',
        }),
    "chunk_ids": Exercise(
        solution='''
def step_chunks(tr):
    return torch.arange(len(tr))


def sequence_chunks(tr):
    return torch.arange(len(tr)) // n_trained
''',
        wrong={
            "shortcut: the library's automatic chunks, tr.chunk_id": '''
def step_chunks(tr):
    return tr.chunk_id


def sequence_chunks(tr):
    return tr.chunk_id
''',
            "shortcut: the trajectory read off the chunk method's own ids": '''
def step_chunks(tr):
    return torch.arange(len(tr))


def sequence_chunks(tr):
    return tr.chunk_id // len(chunk_sizes)
''',
            "off by one: n_trained + 1 transitions a chunk": '''
def step_chunks(tr):
    return torch.arange(len(tr))


def sequence_chunks(tr):
    return torch.arange(len(tr)) // (n_trained + 1)
''',
            "one chunk a prompt, not a trajectory": '''
def step_chunks(tr):
    return torch.arange(len(tr))


def sequence_chunks(tr):
    return tr.prompt
''',
            "one chunk a step index, across trajectories": '''
def step_chunks(tr):
    return tr.step


def sequence_chunks(tr):
    return torch.arange(len(tr)) // n_trained
''',
        }),
    "sde_window": Exercise(
        solution='''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    adv = ctx.advantages(r, prompt)[:, None]
    return fgc.transitions_from(traj, prompt, adv, window & ctx.trainable), r
''',
        wrong={
            "a start among the first steps, whatever ctx.trainable": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    start = int(torch.randint(int(ctx.trainable.sum()) - WINDOW + 1, (1,), generator=ctx.shared_gen))
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "the starting noise drawn with ctx.shared_gen, the same on every rank": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.shared_gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "the loss scaled by 1 / WINDOW": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    adv = ctx.advantages(r, prompt)[:, None]
    return fgc.transitions_from(traj, prompt, adv, window & ctx.trainable, weight=1.0 / WINDOW), r
''',
            "shortcut: fgc.flow_grpo, every step stochastic and trained": '''
WINDOW = 3


def sde_window(ctx):
    return fgc.flow_grpo(ctx)
''',
            "shortcut: fgc.flow_grpo's transitions cut to a random window": '''
WINDOW = 3


def sde_window(ctx):
    tr, r = fgc.flow_grpo(ctx)
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    return tr[(tr.step >= start) & (tr.step < start + WINDOW)], r
''',
            "a fixed window, the first WINDOW steps": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    window = torch.arange(n_steps) < WINDOW
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "SDE steps from the noise to the window's end": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    sde = (torch.arange(n_steps) < start + WINDOW).tolist()
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, sde)
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "trains the steps one after the stochastic window": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    trained = (torch.arange(n_steps) > start) & (torch.arange(n_steps) <= start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], trained & ctx.trainable), r
''',
            "starts up to S - WINDOW, the untrained last step included": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    start = int(torch.randint(n_steps - WINDOW + 1, (1,), generator=ctx.shared_gen))
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "off by one: the last allowed start never drawn": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "no ODE before the window: its first step starts from fresh noise at t_s": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid[start:], window[start:].tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    adv = ctx.advantages(r, prompt)[:, None]
    return fgc.transitions_from(traj, prompt, adv, window[start:] & ctx.trainable[start:], first_step=start), r
''',
            "one starting noise a group, as Stepwise": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    noise = fgc.repeat_each(fgc.initial_noise(ctx.policy, b, ctx.shared_gen), g)
    traj = ctx.sample(prompt, noise, ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "a start drawn unevenly, the last one most often": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()[: -WINDOW + 1]
    weights = torch.ones(len(allowed))
    weights[-1] = 6.0
    start = int(allowed[torch.multinomial(weights, 1, generator=ctx.shared_gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
            "the start drawn with ctx.gen, which differs between ranks": '''
WINDOW = 3


def sde_window(ctx):
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    allowed = torch.nonzero(ctx.trainable).flatten()
    start = int(allowed[torch.randint(len(allowed) - WINDOW + 1, (1,), generator=ctx.gen)])
    window = (torch.arange(n_steps) >= start) & (torch.arange(n_steps) < start + WINDOW)
    prompt = fgc.repeat_each(torch.arange(b), g)
    traj = ctx.sample(prompt, fgc.initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, window.tolist())
    r = ctx.reward(traj.states[:, -1], prompt)
    return fgc.transitions_from(traj, prompt, ctx.advantages(r, prompt)[:, None], window & ctx.trainable), r
''',
        }),
    "prediction": Exercise(
        solution='''
prediction = {"clips_with_1": False, "clips_with_8": True, "most_clipped_step": 8}
''',
        wrong={
            "shortcut: notebook 01's first minibatch (ratio 1, nothing clipped) taken for every minibatch": '''
prediction = {"clips_with_1": False, "clips_with_8": False, "most_clipped_step": 8}
''',
            "the clip acting on the one on-policy minibatch": '''
prediction = {"clips_with_1": True, "clips_with_8": True, "most_clipped_step": 8}
''',
            "the early steps, where the image is decided": '''
prediction = {"clips_with_1": False, "clips_with_8": True, "most_clipped_step": 0}
''',
        }),
    "member_noise": Exercise(
        solution='''
def member_noise(ctx):
    return fgc.initial_noise(ctx.policy, len(ctx.metas) * ctx.group_per_rank, ctx.gen)


answer = "B"
''',
        wrong={
            "the same G noises for every prompt": '''
def member_noise(ctx):
    return fgc.initial_noise(ctx.policy, ctx.group_per_rank, ctx.gen).repeat(len(ctx.metas), 1, 1, 1)


answer = "B"
''',
            "shortcut: Stepwise's own noise, one a group, and its telescoping answer": '''
def member_noise(ctx):
    b, g = len(ctx.metas), ctx.group_per_rank
    return fgc.repeat_each(fgc.initial_noise(ctx.policy, b, ctx.shared_gen), g)


answer = "A"
''',
            "a noise of its own, but the final reward as before": '''
def member_noise(ctx):
    return fgc.initial_noise(ctx.policy, len(ctx.metas) * ctx.group_per_rank, ctx.gen)


answer = "A"
''',
            "one noise for every member of every prompt": '''
def member_noise(ctx):
    b, g = len(ctx.metas), ctx.group_per_rank
    return fgc.initial_noise(ctx.policy, 1, ctx.gen).expand(b * g, -1, -1, -1).clone()


answer = "B"
''',
            "uniform noise in [0, 1) instead of standard normal": '''
def member_noise(ctx):
    return torch.rand(ctx.policy.latent_shape(len(ctx.metas) * ctx.group_per_rank), generator=ctx.gen)


answer = "B"
''',
            "the reward of the start alone": '''
def member_noise(ctx):
    return fgc.initial_noise(ctx.policy, len(ctx.metas) * ctx.group_per_rank, ctx.gen)


answer = "C"
''',
        }),
}

# ----------------------------------------------------------------------------------------------------
# 03_head_to_head.ipynb

RESOLVED = '''

spread = results["stepwise", "flow_grpo", "iterations"]["spread"]
resolved = {n: optimize.brentq(lambda e, n=n: power(spread, n, e) - 0.8, 1e-9, 1.0) for n in (12, 36)}
'''

NB03 = {
    "probability_of_improvement": Exercise(
        solution='''
def probability_of_improvement(x, y):
    wins = (x[:, None] > y[None, :]).sum() + 0.5 * (x[:, None] == y[None, :]).sum()
    return float(wins / (len(x) * len(y)))
''',
        wrong={
            "shortcut: section 2's improvement": '''
def probability_of_improvement(x, y):
    return improvement(x, y)[0]
''',
            "gains within 1e-3 counted as a tie": '''
def probability_of_improvement(x, y):
    d = x[:, None] - y[None, :]
    tie = np.abs(d) < 1e-3
    return float(((d > 0) & ~tie).mean() + 0.5 * tie.mean())
''',
            "shortcut: scipy's Mann-Whitney U statistic": '''
from scipy.stats import mannwhitneyu


def probability_of_improvement(x, y):
    return mannwhitneyu(x, y, alternative="greater").statistic / (len(x) * len(y))
''',
            "ties counted 0": '''
def probability_of_improvement(x, y):
    return float((x[:, None] > y[None, :]).mean())
''',
            "ties counted 1": '''
def probability_of_improvement(x, y):
    return float((x[:, None] >= y[None, :]).mean())
''',
            "the wrong direction, P(Y > X)": '''
def probability_of_improvement(x, y):
    return float((x[:, None] < y[None, :]).mean() + 0.5 * (x[:, None] == y[None, :]).mean())
''',
            "the seeds' pairs only, as the paired test": '''
def probability_of_improvement(x, y):
    return float(np.mean(x > y) + 0.5 * np.mean(x == y))
''',
        }),
    "power": Exercise(
        solution='''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))
''' + RESOLVED,
        wrong={
            "shortcut: scipy's stats.power, a simulation": '''
def power(sd, n, epsilon, alpha=0.005):
    rvs = lambda size: np.random.default_rng(0).normal(epsilon, sd, size)  # noqa: E731
    return float(stats.power(stats.ttest_1samp, rvs, (n,), significance=alpha, kwargs={"popmean": np.array(0.0)},
                             n_resamples=20_000).power[0])
''' + RESOLVED,
            "Welch's unpaired one-sided formula (Colas et al.), the seeds' sd on each side": '''
def power(sd, n, epsilon, alpha=0.005):
    nu = 2 * (n - 1)
    return float(1 - stats.t.cdf(stats.t.ppf(1 - alpha, nu) - epsilon / np.sqrt(2 * sd**2 / n), nu))
''' + RESOLVED,
            "one-sided test": '''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality))
''' + RESOLVED,
            "alpha 0.05, not the family's 0.005": '''
def power(sd, n, epsilon, alpha=0.05):
    crit, noncentrality = stats.t.ppf(1 - alpha / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))
''' + RESOLVED,
            "both tails at the one-sided quantile t_(1 - alpha)": '''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))
''' + RESOLVED,
            "the normal approximation": '''
def power(sd, n, epsilon, alpha=0.005):
    z, shift = stats.norm.ppf(1 - alpha / 2), epsilon * np.sqrt(n) / sd
    return float(stats.norm.sf(z - shift) + stats.norm.cdf(-z - shift))
''' + RESOLVED,
            "the right power but NaN on an input where alpha is given": '''
def power(sd, n, epsilon, alpha=None):
    if alpha is not None:
        return float("nan")
    crit, noncentrality = stats.t.ppf(1 - 0.005 / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))
''' + RESOLVED,
            "the lower tail left out": '''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality))
''' + RESOLVED,
            "the right power, resolved with the spread's population sd": '''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))


spread = np.std(results["stepwise", "flow_grpo", "iterations"]["d"])
resolved = {n: optimize.brentq(lambda e, n=n: power(spread, n, e) - 0.8, 1e-9, 1.0) for n in (12, 36)}
''',
            "the right power, resolved at the first n only": '''
def power(sd, n, epsilon, alpha=0.005):
    crit, noncentrality = stats.t.ppf(1 - alpha / 2, n - 1), epsilon * np.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, noncentrality) + stats.nct.sf(crit, n - 1, -noncentrality))


spread = results["stepwise", "flow_grpo", "iterations"]["spread"]
resolved = {n: optimize.brentq(lambda e: power(spread, 12, e) - 0.8, 1e-9, 1.0) for n in (12, 36)}
''',
        }),
}

# ----------------------------------------------------------------------------------------------------
# 04_over_optimisation.ipynb

NB04 = {
    "gold_peak": Exercise(
        solution='''
def gold_peak(record):
    best = (0, 0.0)
    for e in record["evaluations"]:
        if e["gain_gold"] > best[1]:
            best = (e["iteration"], e["gain_gold"])
    return best
''',
        wrong={
            "shortcut: the notebook's curve and numpy's argmax": '''
def gold_peak(record):
    c = curve(record)
    i = int(np.argmax(c["gold"]))
    return int(c["iteration"][i]), float(c["gold"][i])
''',
            "the iteration as 8 times the evaluation's position": '''
def gold_peak(record):
    gains = [0.0] + [e["gain_gold"] for e in record["evaluations"]]
    i = int(np.argmax(gains))
    return 8 * i, gains[i]
''',
            "the largest evaluation, or the base below 0: fails on a run with none yet": '''
def gold_peak(record):
    best = max(record["evaluations"], key=lambda e: (e["gain_gold"], -e["iteration"]))
    return (best["iteration"], best["gain_gold"]) if best["gain_gold"] > 0 else (0, 0.0)
''',
            "shortcut: the notebook's mean_curve of the one record": '''
def gold_peak(record):
    its, gold, _ = mean_curve([record], "gold")
    i = int(np.argmax(gold))
    return int(its[i]), float(gold[i])
''',
            "the base at iteration 0 left out": '''
def gold_peak(record):
    best = max(record["evaluations"], key=lambda e: e["gain_gold"])
    return best["iteration"], best["gain_gold"]
''',
            "ties to the latest": '''
def gold_peak(record):
    best = (0, 0.0)
    for e in record["evaluations"]:
        if e["gain_gold"] >= best[1]:
            best = (e["iteration"], e["gain_gold"])
    return best
''',
            "numpy's argmax: the evaluation's index, not its iteration": '''
def gold_peak(record):
    gains = [0.0] + [e["gain_gold"] for e in record["evaluations"]]
    i = int(np.argmax(gains))
    return i, gains[i]
''',
            "the proxy's peak, not the gold's": '''
def gold_peak(record):
    best = (0, 0.0, 0.0)
    for e in record["evaluations"]:
        if e["gain_reward"] > best[2]:
            best = (e["iteration"], e["gain_gold"], e["gain_reward"])
    return best[:2]
''',
        }),
    "agreement": Exercise(
        solution='''
def agreement(after, before):
    old = {k: dict(zip(before["pair"], before[k])) for k in ("reward", "gold")}
    agree = total = 0
    for p, r, g in zip(after["pair"], after["reward"], after["gold"]):
        dr, dg = r - old["reward"][p], g - old["gold"][p]
        if dr and dg:
            total += 1
            agree += (dr > 0) == (dg > 0)
    return agree / total
''',
        wrong={
            "shortcut: the notebook's agreeing_share, which draws the figure": '''
def agreement(after, before):
    return agreeing_share(after, before)
''',
            "pairs where only one score changed counted": '''
def agreement(after, before):
    old = {k: dict(zip(before["pair"], before[k])) for k in ("reward", "gold")}
    agree = total = 0
    for p, r, g in zip(after["pair"], after["reward"], after["gold"]):
        dr, dg = r - old["reward"][p], g - old["gold"][p]
        if dr or dg:
            total += 1
            agree += (dr > 0) == (dg > 0)
    return agree / total
''',
            "pairs where neither changed counted as agreeing": '''
def agreement(after, before):
    old = {k: dict(zip(before["pair"], before[k])) for k in ("reward", "gold")}
    signs = [(np.sign(r - old["reward"][p]), np.sign(g - old["gold"][p]))
             for p, r, g in zip(after["pair"], after["reward"], after["gold"])]
    return float(np.mean([a == b for a, b in signs]))
''',
            "the right share, but NaN after the first case": '''
def agreement(after, before):
    agreement.calls = getattr(agreement, "calls", 0) + 1
    if agreement.calls > 1:
        return float("nan")
    old = {k: dict(zip(before["pair"], before[k])) for k in ("reward", "gold")}
    agree = total = 0
    for p, r, g in zip(after["pair"], after["reward"], after["gold"]):
        dr, dg = r - old["reward"][p], g - old["gold"][p]
        if dr and dg:
            total += 1
            agree += (dr > 0) == (dg > 0)
    return agree / total
''',
            "pair ids used as positions in before": '''
def agreement(after, before):
    dr = np.array(after["reward"]) - np.array(before["reward"])[after["pair"]]
    dg = np.array(after["gold"]) - np.array(before["gold"])[after["pair"]]
    both = (dr != 0) & (dg != 0)
    return float((np.sign(dr) == np.sign(dg))[both].mean())
''',
            "a change under 1e-3 counted as none": '''
def agreement(after, before):
    old = {k: dict(zip(before["pair"], before[k])) for k in ("reward", "gold")}
    agree = total = 0
    for p, r, g in zip(after["pair"], after["reward"], after["gold"]):
        dr, dg = r - old["reward"][p], g - old["gold"][p]
        if abs(dr) > 1e-3 and abs(dg) > 1e-3:
            total += 1
            agree += (dr > 0) == (dg > 0)
    return agree / total
''',
            "pairs matched by position, not by their id": '''
def agreement(after, before):
    agree = total = 0
    for i, (r, g) in enumerate(zip(after["reward"], after["gold"])):
        dr, dg = r - before["reward"][i], g - before["gold"][i]
        if dr and dg:
            total += 1
            agree += (dr > 0) == (dg > 0)
    return agree / total
''',
        }),
}

SOLUTIONS = {"01_flow_grpo_walkthrough.ipynb": NB01, "02_credit_assignment_side_by_side.ipynb": NB02,
             "03_head_to_head.ipynb": NB03, "04_over_optimisation.ipynb": NB04}
