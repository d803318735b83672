"""flow_grpo_credit: credit assignment for GRPO on flow-matching text-to-image models, in one file.

Five ways to credit the denoising steps, a short function each beside one shared rollout and GRPO loss, to be read
next to the papers. Sections: 0 helpers and Dist (torchrun), 1 Args, 2 toy world, 3 models, 4 rewards, 5 SDE step,
6 rollout, 7 credit assignment, 8 GRPO loss and update, 9 train loop, 10 run folder, 11 evaluation and plots, 12 CLI.

    flow_grpo  Flow-GRPO           arXiv 2505.05470  SDE at every step, one advantage for all steps
    stepwise   Stepwise-Flow-GRPO  arXiv 2603.28718  Tweedie reward of every state, credit = reward gain
    tempflow   TempFlow-GRPO       arXiv 2508.04324  ODE, one SDE step, ODE; noise-aware step weights
    g2rpo      G2RPO               arXiv 2510.01982  one SDE step from a shared anchor, multi-granularity
    chunk      Chunk-GRPO          arXiv 2510.21583  one importance ratio per chunk of steps

Reading path: the calls of one Flow-GRPO iteration of `train` (9) in the order made, each at its first call (section
in brackets at first mention). A line is called by the last name one indent up; "a -> b": a calls b; "a, b": a, then
b, from the same caller; "a: text" a note. Left out, one-liners: _as_column, stable_seed, generator, segment_mean,
repeat_each, Dist.reduce, Policy.device, Policy.passes, ToyPolicy.forward, ToyPolicy.latent_shape, Transitions.__len__.
    iteration_context (9)
        train_prompts (2) -> make_prompt (2), ToyPolicy.encode (3)
        Context.__post_init__ (6) -> trainable_steps (5) -> step_stds (5) -> sde_step (5)
    flow_grpo (7): METHODS["flow_grpo"].assign
        initial_noise (6), Context.sample (6)
            Context.cond_of (6), rollout (6)
                Policy.velocity (3), sde_step: at each step
        Context.reward (6)
            ToyPolicy.decode (3), toy_strict_reward (4) -> score_batch (2) -> score_image (2) -> detect (2)
        Context.advantages (6)
            Dist.gather (0), group_normalise (6)
        transitions_from (6)
    all_finite (9), update (8)
        Transitions.__getitem__ (6): drops the advantage-0 transitions, units (8) -> first_of_each (8)
        accumulate_gradients (8): one a minibatch
            units -> first_of_each, Transitions.__getitem__, grpo_loss (8): one a piece
                transition_log_probs (8)
                    first_of_each, Policy.velocity: the one pass with a gradient, sde_step: at the stored x[k+1]
                chunk_log_ratios (8)
            loss.backward
        clip_grad_norm_, opt.step: AdamW's
    ema.step: the moving average's, RunFolder.log (10)
        Dist.gather, RunFolder.append_metrics (10)
    RunFolder.evaluate_if_due (10)
        parse_ints (0), curve_pairs (11), ema_applied (10), evaluate (11)
            resolved (1), prompt_sets (9) -> eval_prompts (2) -> make_prompt, initial_noise
            ToyPolicy.time_grid (3) -> shifted_grid (5), ToyPolicy.encode, rollout
                Policy.velocity, ode_step (5)
            ToyPolicy.decode, toy_strict_reward -> score_batch -> score_image -> detect
            score_batch -> score_image -> detect, colour_cleanliness (2), toy_gold (2), by_category (11)
        paired_gains (11) -> by_category, RunFolder.append_metrics, save_grid (11)
    RunFolder.checkpoint (10)

Paper symbols and their names here. x_t = (1 - t) x0 + t x1, x0 the image, x1 the noise: t = 1 is noise, t = 0 data; the
model predicts v = x1 - x0. The states of a trajectory are x[k] (`states[:, k]`), k = 0..S along the time grid
1 = t_0 > ... > t_S = 0: x[0] is the noise, x[S] the image.
    k, its direction  transition k: x[k] -> x[k+1], t_k -> t_{k+1}, counting UP from the noise; the papers count DOWN
                      to their image (their x_0, r_0): Stepwise's g_t = r_{t-1} - r_t is gain[:, k]
    Delta_k           dt = t_k - t_{k+1} > 0 (Flow-GRPO's code: sigma_prev - sigma < 0, the same step)
    sigma_t           the flow SDE's a sqrt(t / (1 - t)), with a = `noise_level` (eta of ddim and cps): sde_step
    s_k               `std`, the transition's std: sigma_t sqrt(Delta_k) under the flow SDE (step_stds)
    x0_hat, x1_hat    Tweedie's x_t - t v and x_t + (1 - t) v: sde_step; Stepwise's `x0_estimate` adds ODE sub-steps
    A_i (A_i^k)       `advantage`: group_normalise of rewards r (or gains), per image (or per step)
    rho               `ratio` in grpo_loss; `r` is a reward (Stepwise: also a gain)
    B, G, S           `b` prompts, `g` images per group (or branches), `n_steps` steps; N transitions, K chunks
A step's log-prob is a MEAN over the D = C*H*W dimensions, as in every official code: rho is the D-th root of the
likelihood ratio (grpo_loss). Ids, masks and counters live on the CPU, what meets the model on `policy.device`.
Noise is drawn on CPU generators: a seed draws the same noise on every device (the arithmetic then differs).

Deviations from the papers and official codes: the README's numbered list, cited in the code as "Deviation n".
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import json
import math
import os
import pickle
import random
import re
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

# ----------------------------------------------------------------------------------------------------
# 0 Conventions and helpers

class UsageError(ValueError):
    """A bad input from the user: the CLI prints it on one line and exits with status 2."""

class RunError(RuntimeError):
    """A run that cannot go on (e.g. non-finite rewards again and again): one line, exit status 1."""

def stable_seed(*keys) -> int:
    """A seed from any printable keys that is the same on every machine and Python run."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, keys)).encode()).digest()[:4], "little")

def generator(*keys) -> torch.Generator:
    """A CPU generator seeded from `keys`: its draws are the same whatever device they move to."""
    return torch.Generator().manual_seed(stable_seed(*keys))

def parse_ints(text: str, flag: str, example: str = "1,2,3") -> list[int]:
    """'1,2,3' -> [1, 2, 3] ('' -> []), or a UsageError naming the flag."""
    try:
        return [int(item) for item in text.split(",")] if text else []
    except ValueError:
        raise UsageError(f"{flag} must be integers like {example}, got {text!r}") from None

def json_file(path: Path):
    return json.loads(path.read_text())

def read_file(path: Path, load=json_file,
              fix="restore it, or move the run folder away to start the run over", **options):
    """load(path, **options), or the one-line UsageError: the file, its folder, what is wrong, and what to do."""
    try:
        return load(path, **options)
    except Exception as e:  # cut short, copied in part, edited by hand: whichever reader fails, the file is unusable
        raise UsageError(f"{path.name} in {path.parent} cannot be read ({first_line(e)}); {fix}") from None

def first_line(error: Exception) -> str:
    """A loader's error message, whole to its first line break (where it names the missing part), or its type: torch's
    unpickler, whatever the damage, advises weights_only=False, which is no cure for a damaged file."""
    lines = [] if isinstance(error, pickle.UnpicklingError) else [line.strip() for line in str(error).splitlines()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "Error(s) in loading state_dict for X:" names the cause below
        return f"{lines[0]} {lines[1]}"
    return (lines or [type(error).__name__])[0]

def segment_mean(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-id means of values (N,) -> (means (K,) in sorted id order, inverse (N,)); means[inverse] is each value's."""
    uniq, inverse = torch.unique(ids.cpu(), return_inverse=True)
    inverse = inverse.to(values.device)
    return values.new_zeros(len(uniq)).scatter_reduce(0, inverse, values, "mean", include_self=False), inverse

@dataclass(frozen=True)
class Dist:
    """Where this process stands under torchrun (rank 0 of 1 without it); collectives run on `device`."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @staticmethod
    def join(device: torch.device) -> "Dist":
        """Join the process group torchrun describes: gloo on CPU, nccl with one GPU a rank."""
        world, cuda = int(os.environ.get("WORLD_SIZE", "1")), device.type == "cuda"
        if world == 1:
            return Dist(device=device)
        if cuda:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        if not torch.distributed.is_initialized():  # 2 h: rank 0 alone loads and evaluates; the others wait
            torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2),
                                                 device_id=device if cuda else None)
        return Dist(torch.distributed.get_rank(), world, device)

    def reduce(self, value, op: str = "sum") -> torch.Tensor:
        """A number summed (or min, max) over ranks, as a float64 tensor on this Dist's device."""
        x = torch.as_tensor(value, dtype=torch.float64).to(self.device)
        if self.world > 1:
            torch.distributed.all_reduce(x, getattr(torch.distributed.ReduceOp, op.upper()))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) on each rank -> (world*N, ...) in rank order."""
        if self.world == 1:
            return x
        per_rank = [torch.empty_like(x) for _ in range(self.world)]
        torch.distributed.all_gather(per_rank, x.contiguous())
        return torch.cat(per_rank)


# ----------------------------------------------------------------------------------------------------
# 1 Args

SDE_LEVELS = {"flow": 1.0, "ddim": 1.0, "cps": 0.8}  # each SDE and its default noise level

@dataclass
class Args:
    """Every tunable number of a run. The comment after each field is its --help text."""

    method: str = "flow_grpo"  # flow_grpo, stepwise, tempflow, g2rpo or chunk
    model: str = "toy"  # 'toy' (the embedded shapes world), or a diffusers folder / hub id of SD3, SD3.5, FLUX.1
    reward: str = "auto"  # toy-strict, toy, toy-pref, pickscore, clip or a sum a:1,b:0.5 (auto: toy-strict/pickscore)
    reward_model: str = ""  # CLIP model of pickscore/clip, a path or hub id; name=path,... for a sum
    extra_penalty: float = 0.5  # toy-strict: reward lost per object beyond, or missing from, those the prompt asks for
    prompts: str = ""  # a text file, one prompt a line, every 10th held out (default: the toy prompts)
    resolution: int = 512  # image size of a real model (the toy world is 16 px)
    dtype: str = "auto"  # fp32 or bf16 weights of a real model (auto: bf16 on CUDA); the SDE math stays fp32
    low_memory: bool = False  # real models, the 24 GB recipe: gradient checkpointing, text encoders on the CPU
    micro_batch: int = 0  # samples a pass in sampling, training, reward, evaluation (0: toy 128, real models 4)
    iterations: int = 0  # GRPO iterations (sample, score, update) (0: the method's, METHODS)
    prompts_per_iter: int = 8  # prompts sampled per iteration
    group_size: int = 8  # images (or branches) that share one advantage normalisation
    steps: int = 10  # sampling steps during training (Flow-GRPO: 10, fewer than its 40 eval steps)
    eval_steps: int = 10  # ODE steps of the deterministic evaluation
    eval_every: int = 8  # evaluate every N iterations (and at the start and end)
    eval_per_tag: int = 256  # held-out evaluation prompts (each with its own noise) per GenEval category
    curve_per_tag: int = 32  # of these, those evaluated between the start and the end (the curves' points)
    full_evals: str = ""  # iterations also evaluated on every held-out pair, like 32,40 (comparison points)
    full_eval_nfe: str = ""  # forward-pass budgets like 64000: every pair at the first iteration that reaches one
    out: str = "runs"  # folder that receives one sub-folder per run
    run: str = ""  # the run's folder: new, resumed with its flags, or finished (default: OUT/METHOD-seedN-TIME)
    seed: int = 0  # seed of the whole run (prompts, noise, LoRA init)
    device: str = "auto"  # auto, cpu or cuda
    toy_base: str = ""  # the toy model's folder (default: the shipped assets/toy_base, notebooks/toy_base.py's output)
    cache_dir: str = ""  # where the base's evaluations are cached (default: $XDG_CACHE_HOME/flow_grpo_credit)
    base_cache: bool = True  # reuse this machine's evaluation of the base, kept in the cache folder
    tune: bool = False  # evaluate on tuning prompts and noise, never the held-out set's: for choosing flags
    eval_kl: bool = False  # each evaluation also measures the policy's KL to the base along its ODE paths (kl_to_base)

    # GRPO and optimisation (Deviation 4)
    lr: float = 0.0  # AdamW learning rate of the LoRA parameters (0: the method's, 1e-3; g2rpo 3e-4)
    weight_decay: float = 1e-4  # AdamW weight decay
    max_grad_norm: float = 1.0  # global gradient-norm clip
    ema_decay: float = 0.9  # decay of the adapter's moving average (one update an iteration), evaluated, saved; 0: off
    inner_updates: int = 8  # optimizer steps per iteration (the samples are split into this many minibatches)
    train_fraction: float = 1.0  # fraction of the transitions (chunks) trained on, drawn at random (DanceGRPO)
    clip_range: float = 1e-3  # PPO clip epsilon of the per-dimension ratio: exp(D eps), 2.2, on the toy's image
    adv_clip: float = 5.0  # advantages are clamped to [-adv_clip, adv_clip]
    beta: float = 0.0  # weight of the per-step Gaussian KL to the base (LoRA disabled); 0: no pass of the base
    guidance: float = 0.0  # CFG scale on toy and SD3 (1: no negative branch), distilled on FLUX (0: 1, 4.5, 3.5)
    lora_rank: int = 0  # LoRA rank (0: toy 16, real models 32 as Flow-GRPO)
    lora_alpha: float = 0.0  # LoRA alpha, scale = alpha / rank (0: toy 16, real models 64 as Flow-GRPO)

    # SDE (section 5)
    sde: str = "flow"  # SDE of the stochastic steps: flow (Flow-GRPO), ddim (Stepwise), cps (Flow-GRPO's CPS)
    noise_level: float = 0.0  # a of the flow SDE, eta of ddim and cps (0: the SDE's, 1.0, 1.0, 0.8; g2rpo 0.7)
    min_std_ratio: float = 0.1  # a step trains only if its SDE std is at least this fraction of the median step's

    tweedie_substeps: int = 5  # stepwise: ODE sub-steps from each state to t=0 for its reward (1: plain Tweedie)
    noises_per_prompt: int = 2  # tempflow: initial noises a prompt; a noise and branch point hold group_size branches
    branch_steps: int = 3  # tempflow: branch points used per iteration, drawn at random (0: all)
    granularities: str = "1,2"  # g2rpo: granularities Lambda, t_{k+2}, then every lambda-th node (paper: 1,2,3)
    chunks: str = "auto"  # chunk: sizes like 2,3,4, auto (from the relative-L1 profile) or paper (2,3,4,7 of 16 steps)
    num_chunks: int = 4  # chunk: number of chunks of the automatic segmentation
    weighted_chunks: bool = False  # chunk: draw trained chunks with probability proportional to their relative L1
    chunk_fraction: float = 1.0  # chunk: fraction of chunks trained per trajectory

    checkpoint_every: int = 10  # write checkpoint.pt every N iterations (and at the end); --run FOLDER resumes it
    max_nonfinite: int = 3  # stop after this many iterations in a row with non-finite rewards, advantages or gradient


CHOICES = {"sde": SDE_LEVELS, "dtype": ("auto", "fp32", "bf16"), "device": ("auto", "cpu", "cuda")}  # and METHODS
RULES = {  # what a valid value of each flag is, and how to tell
    ">= 2": (["group_size"], lambda v: v >= 2),
    ">= 3": (["steps"], lambda v: v >= 3),
    "> 0": (["clip_range", "max_grad_norm", "resolution"], lambda v: v > 0),
    ">= 0": (["micro_batch", "noise_level", "min_std_ratio", "extra_penalty", "beta", "lora_rank", "lora_alpha",
              "branch_steps", "iterations", "lr"], lambda v: v >= 0),
    ">= 1": (["prompts_per_iter", "eval_steps", "eval_every", "eval_per_tag", "curve_per_tag", "inner_updates",
              "tweedie_substeps", "noises_per_prompt", "num_chunks", "checkpoint_every", "max_nonfinite"],
             lambda v: v >= 1),
    "0 or >= 1": (["guidance"], lambda v: v == 0 or v >= 1),
    "in [0, 1)": (["ema_decay"], lambda v: 0 <= v < 1),
    "in (0, 1]": (["train_fraction", "chunk_fraction"], lambda v: 0 < v <= 1),
}

def validate(args: Args) -> Args:
    """Every bad input becomes one UsageError naming the flag and what is valid; -> `resolved(args)`."""
    for name, options in {"method": METHODS, **CHOICES}.items():
        if getattr(args, name) not in options:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(args, name)!r}; choose {', '.join(options)}")
    for valid, (names, ok) in RULES.items():
        for name in names:
            if not ok(getattr(args, name)):
                raise UsageError(f"--{name.replace('_', '-')} must be {valid}, got {getattr(args, name)!r}")
    args = resolved(args)
    if args.sde != "flow" and args.noise_level > 1:
        raise UsageError(f"--noise-level of the {args.sde} SDE must be in (0, 1], got {args.noise_level!r}")
    if args.model != "toy" and args.model.startswith((".", "/", "~")) and not Path(args.model).expanduser().exists():
        raise UsageError(f"--model {args.model}: no such folder (a diffusers pipeline folder or a hub id is expected)")
    if any(n.startswith("toy") for n, _ in parse_reward(args.reward)) and (args.model != "toy" or args.prompts):
        raise UsageError("--reward toy scores the built-in toy prompts on the toy model; use pickscore or clip here")
    if args.prompts and not Path(args.prompts).is_file():
        raise UsageError(f"--prompts {args.prompts}: no such file (one prompt a line is expected)")
    trainable = trainable_steps(shifted_grid(args.steps), args)
    if not (trainable & (torch.arange(args.steps) < args.steps // 2 if args.method == "g2rpo" else True)).any():
        raise UsageError(f"--method {args.method} with --sde {args.sde} and --steps {args.steps} has no step to train "
                         "(nor the last or a near-deterministic one; g2rpo trains the first half); use more --steps")
    parse_chunks(args.chunks, int(trainable.sum()))
    parse_ints(args.full_evals, "--full-evals"), parse_ints(args.full_eval_nfe, "--full-eval-nfe")
    lams = parse_ints(args.granularities, "--granularities")
    if min(lams, default=0) < 1 or len(set(lams)) < len(lams):  # a repeated lambda would count its advantage twice
        raise UsageError(f"--granularities must be distinct positive integers like 1,2,3, got {args.granularities!r}")
    return args

def args_of(saved: dict) -> Args:
    """The Args of a saved args.json or record's "args" of any version: gone fields dropped, FORMER_NAMES renamed."""
    saved = {FORMER_NAMES.get(k, k): v for k, v in saved.items()}
    fields = {f.name: f.type for f in dataclasses.fields(Args) if f.name in saved}
    if wrong := [k for k, kind in fields.items() if not isinstance(saved[k], JSON_TYPES[kind])]:  # edited by hand
        raise ValueError(f"{wrong[0]} is {saved[wrong[0]]!r}, not a {fields[wrong[0]]}")
    return Args(**{k: saved[k] for k in fields})

def read_args(path: Path) -> Args:
    """A run folder's args.json as Args, or read_file's one-line error."""
    return read_file(path, lambda p: args_of(json_file(p)))

FORMER_NAMES = {"ema": "ema_decay", "min_std": "min_std_ratio", "seeds": "noises_per_prompt"}  # former -> now
JSON_TYPES = {"bool": bool, "int": int, "float": (int, float), "str": str}  # Args' field types, as JSON holds them

def resolved(args: Args) -> Args:
    """`args` with each 0 (and reward auto) that leaves a value to the method, the SDE or the model filled in (a real
    model's guidance: the pipeline's), so that a run's args.json holds what ran."""
    method = METHODS[args.method]
    own_level = method.noise_level if args.sde == "flow" else None  # a method's noise level is its flow SDE's a
    model = ToyPolicy.defaults if args.model == "toy" else PipelinePolicy.defaults
    reward = args.reward if args.reward != "auto" else "toy-strict" if args.model == "toy" else "pickscore"
    return dataclasses.replace(args, iterations=args.iterations or method.iterations, lr=args.lr or method.lr,
                               noise_level=args.noise_level or own_level or SDE_LEVELS[args.sde], reward=reward,
                               **{k: getattr(args, k) or v for k, v in model.items()})

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


# ----------------------------------------------------------------------------------------------------
# 2 Toy world: GenEval-style prompts and an exact scorer
#
# Prompts are GenEval metadata: {"tag", "include": [{"class", "count", "color"?, "position"?: [relation, index]}],
# "exclude"?: [...], "prompt"}. Classes are shapes in a four-colour palette, images RES x RES RGB in [0, 1] on black.

RES = 16
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
CLASSES = ("circle", "square", "triangle")
COLORS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
RELATIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {2: "two", 3: "three"}
PALETTE = np.array([(0.0, 0.0, 0.0), *COLORS.values()])  # (5, 3), the black background first

def make_prompt(tag: str, rng: random.Random, name_colours: bool = False) -> dict:
    """One random prompt of a GenEval category; `name_colours` names its free colours too (the toy's pretraining)."""
    (a, b), (ca, cb) = rng.sample(CLASSES, 2), rng.sample(list(COLORS), 2)
    obj_a, obj_b, word_a, word_b = {"class": a, "count": 1}, {"class": b, "count": 1}, a, b
    if name_colours or tag in ("colors", "color_attr"):
        obj_a, obj_b, word_a, word_b = {**obj_a, "color": ca}, {**obj_b, "color": cb}, f"{ca} {a}", f"{cb} {b}"
    if tag in ("single_object", "colors"):
        return {"tag": tag, "include": [obj_a], "prompt": f"a {word_a}"}
    if tag in ("two_object", "color_attr"):
        return {"tag": tag, "include": [obj_a, obj_b], "prompt": f"a {word_a} and a {word_b}"}
    if tag == "counting":
        n = rng.choice(list(NUMBER_WORDS))
        return {"tag": tag, "include": [{"class": a, "count": n}], "exclude": [{"class": a, "count": n + 1}],
                "prompt": f"{NUMBER_WORDS[n]} {a}s"}
    rel = rng.choice(RELATIONS)  # position: "a A right of a B": B is include[0], A must stand right of it
    return {"tag": tag, "include": [obj_b, {**obj_a, "position": [rel, 0]}], "prompt": f"a {word_a} {rel} a {word_b}"}

PROMPT_SEEDS = {"held-out": 1234, "tuning": 4321, "chunk-profile": 99}  # the fixed prompt sets' random.Random seeds

def eval_prompts(per_tag: int, seed: int = PROMPT_SEEDS["held-out"]) -> list[dict]:
    """The fixed evaluation set: `per_tag` prompts of each category."""
    rng = random.Random(seed)
    return [make_prompt(tag, rng) for tag in TAGS for _ in range(per_tag)]

def train_prompts(n: int, rng: random.Random, detailed: float = 0.0) -> list[dict]:
    """Random categories, then random prompts of them; a `detailed` fraction names every colour."""
    return [make_prompt(rng.choice(TAGS), rng, detailed > 0 and rng.random() < detailed) for _ in range(n)]

def relations(a: tuple, b: tuple) -> set:
    """GenEval's relative-position rule between objects a and b, each ((x, y) centre, size)."""
    offset = np.array(a[0], dtype=float) - np.array(b[0], dtype=float)
    revised = np.maximum(np.abs(offset) - 0.1 * (np.array(a[1]) + np.array(b[1])), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {rel for rel, holds in zip(RELATIONS, (dx < -0.5, dx > 0.5, dy < -0.5, dy > 0.5)) if holds}

Detection = collections.namedtuple("Detection", "cls color centre size")  # cls None: a blob of no known shape

def detect(img: np.ndarray, min_area: int = 6) -> list[Detection]:
    """The toy object detector: nearest palette colour per pixel, 4-connected components, shape rule, exact on the
    toy base's shapes: a square fills its box, a circle misses its corners (fill 21/25), a triangle is bottom-heavy."""
    from scipy import ndimage
    nearest = ((img[:, :, None, :] - PALETTE) ** 2).sum(-1).argmin(-1)  # (RES, RES), 0 the background
    found = []
    for colour in range(1, len(PALETTE)):
        components, n = ndimage.label(nearest == colour)  # 4-connected: scipy's default structure
        for ys, xs in (np.nonzero(components == i) for i in range(1, n + 1)):  # each in raster order
            if len(ys) < min_area:
                continue
            h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
            top, bottom = (ys < ys.min() + h // 2).sum(), (ys >= ys.max() + 1 - h // 2).sum()
            if not (3 <= h <= 7 and 3 <= w <= 7):
                cls = None
            elif top < 0.7 * bottom:
                cls = "triangle"
            else:
                cls = "square" if len(ys) / (h * w) >= 0.92 else "circle"
            centre = (float(xs.min() + xs.max() + 1) / 2, float(ys.min() + ys.max() + 1) / 2)  # box centre, as GenEval
            found.append((ys[0] * RES + xs[0], Detection(cls, list(COLORS)[colour - 1], centre, (int(w), int(h)))))
    return [d for _, d in sorted(found)]  # in the raster order of each object's first pixel

def score_image(img: np.ndarray, meta: dict) -> dict:
    """The scores of one image against its prompt:
    geneval  GenEval's verdict (0/1): each include item needs >= count objects of its class (and colour, and relation
             to include[index]); each exclude item needs < count objects of its class.
    dense    per include item, the mean of min(found, count) / count for its class and for its class in its colour (a
             position item: that, averaged with its relation), shrunk where an exclude is broken; mean of items.
    strict   GenEval's verdict and nothing else: no more objects than the prompt asks for.
    extra    objects found beyond those asked for (any blob counts, a known shape or not).
    missing  asked objects not drawn: per include item, its count minus the objects of its class found."""
    dets = detect(img)
    by_class = {c: [d for d in dets if d.cls == c] for c in CLASSES}
    ok, credits = True, []
    for item in meta["include"]:
        n, of_class = item["count"], by_class[item["class"]]
        matching = [d for d in of_class if item.get("color") in (None, d.color)]
        ok &= len(matching) >= n
        credit = 0.5 * min(len(of_class), n) / n + 0.5 * min(len(matching), n) / n
        if item.get("position"):
            rel, anchors = item["position"][0], by_class[meta["include"][item["position"][1]]["class"]]
            related = any(rel in relations((d.centre, d.size), (a.centre, a.size)) for d in matching for a in anchors)
            ok &= related
            credit = 0.5 * credit + 0.5 * related
        credits.append(credit)
    for item in meta.get("exclude", []):
        n_found = len(by_class[item["class"]])
        ok &= n_found < item["count"]
        if n_found >= item["count"]:  # too many: shrink every include item's credit
            credits = [c * (item["count"] - 1) / n_found for c in credits]
    extra = max(0, len(dets) - sum(item["count"] for item in meta["include"]))
    missing = sum(max(0, item["count"] - len(by_class[item["class"]])) for item in meta["include"])
    return {"geneval": float(ok), "dense": float(np.mean(credits)), "strict": float(ok and not extra), "extra": extra,
            "missing": missing}

def score_batch(images: torch.Tensor, metas: list[dict]) -> dict[str, torch.Tensor]:
    """(N, 3, RES, RES) images in [0, 1] -> score_image's five scores by name, (N,) each, on the CPU."""
    arr = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    scores = [score_image(img, meta) for img, meta in zip(arr, metas)]
    return {k: torch.tensor([float(s[k]) for s in scores]) for k in scores[0]}

def colour_cleanliness(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, RES, RES) in [0, 1] -> (N,): 1 - the mean distance of a pixel to its nearest palette colour, over
    sqrt(5)/2, the farthest any RGB colour lies from the palette (at (0.5, 1, 1) and its like). 1: every pixel clean."""
    pixels = images.detach().double().clamp(0, 1).permute(0, 2, 3, 1).cpu()  # (N, RES, RES, 3)
    distance = (pixels[..., None, :] - torch.from_numpy(PALETTE)).norm(dim=-1).amin(-1)  # (N, RES, RES)
    return (1 - distance.mean((1, 2)) / (5**0.5 / 2)).float()

def toy_gold(scores: dict, taste: torch.Tensor, charge: float = 0.5) -> torch.Tensor:
    """The preference world's gold, what its rater wants, from score_batch's scores and the images' taste term
    (colour_cleanliness), (N,) each -> (N,). dense / 2 makes a near miss beat a wide miss; taste is what base samples
    vary on and the exact scorer (it rounds each pixel to the palette) does not see."""
    return scores["strict"] + scores["dense"] / 2 - charge * (scores["extra"] + scores["missing"]) + taste


# ----------------------------------------------------------------------------------------------------
# 3 Models: the toy text-to-image flow, and SD3 / SD3.5 / FLUX.1 through diffusers

class Policy:
    """What the methods sample and train through. A subclass sets `net` (the denoiser that carries the LoRA
    adapter), `denoiser` (`net` or its DDP wrapper), `cfg` (real CFG scale, 1 = none), `empty` (the "" prompt),
    and defines encode, forward, latent_shape, time_grid and decode."""

    @property
    def device(self):
        return next(self.net.parameters()).device

    @property
    def passes(self) -> int:
        return 1 if self.cfg == 1.0 else 2

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v(x_t, t, c), t (N,) in [0, 1]; the CFG branch runs without gradient, as Flow-GRPO's does."""
        v = self.forward(x, t, cond)
        if self.cfg == 1.0:
            return v
        with torch.no_grad():
            v_uncond = self.forward(x, t, {k: e.expand(len(x), *e.shape[1:]) for k, e in self.empty.items()})
        return v_uncond + self.cfg * (v - v_uncond)

    def save_lora(self, folder: Path) -> None:
        """`pytorch_lora_weights.safetensors`, which pipelines' `load_lora_weights` and a UNet's `load_lora_adapter`
        read: peft's keys (diffusers' conversion renames only the UNet's attention layers, a mix its own loader
        rejects), alpha/r folded into lora_B for loaders that assume alpha = r."""
        from diffusers.loaders import StableDiffusionLoraLoaderMixin  # the toy's saver, no pipeline import
        from peft.utils import get_peft_model_state_dict
        scale = self.net.peft_config["default"].lora_alpha / self.net.peft_config["default"].r
        layers = {k: v * scale if "lora_B" in k else v for k, v in get_peft_model_state_dict(self.net).items()}
        getattr(self, "pipe", StableDiffusionLoraLoaderMixin).save_lora_weights(folder, layers)

class ToyPolicy(Policy):
    """A diffusers UNet2DConditionModel in pixel space ('latents' are pixels in [-1, 1]) and a CLIP text encoder."""

    defaults = dict(micro_batch=128, guidance=1.0, lora_rank=16, lora_alpha=16.0)  # 128: on a CPU faster than more

    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                    "conv1", "conv2"]  # attention, feed-forward and the resnets' convolutions

    def __init__(self, unet, text_encoder, tokenizer, guidance: float = 1.0):
        self.net = self.denoiser = unet
        self.text_encoder, self.tokenizer = text_encoder.requires_grad_(False), tokenizer
        self.cfg = guidance
        self.empty = self.encode([""])

    def encode(self, prompts: list[str], device=None) -> dict:
        ids = self.tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt").input_ids
        out = self.text_encoder(ids.to(self.device)).last_hidden_state  # (B, L, 64)
        return {"encoder_hidden_states": out.to(device or self.device)}

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return self.denoiser(x, t * 1000, **cond).sample

    def latent_shape(self, n: int) -> tuple:
        return (n, 3, RES, RES)

    def time_grid(self, steps: int) -> torch.Tensor:
        """SD3.5's grid, shift 3: six of ten steps above t = 0.7, where a 5 x 5 shape is decided (notebook 02)."""
        return shifted_grid(steps, shift=3.0)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() + 1) / 2).clamp(0, 1)  # (N, 3, RES, RES) in [0, 1]

TOY_BASE = Path(__file__).resolve().parent / "assets" / "toy_base"  # the shipped base: notebooks/toy_base.py's output
TOY_PARTS = ("unet/config.json", "unet/diffusion_pytorch_model.safetensors", "text_encoder/config.json",
             "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")

def load_toy(args: Args, device) -> ToyPolicy:
    """The toy model: the shipped base, or --toy-base FOLDER (unet, text_encoder, tokenizer, saved by diffusers)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, PreTrainedTokenizerFast
    args = resolved(args)  # the toy's guidance
    folder = Path(args.toy_base or TOY_BASE)
    if missing := [part for part in ("", *TOY_PARTS) if not (folder / part).exists()]:  # "": the folder itself
        raise UsageError(f"--toy-base {folder}: no {missing[0] or 'such folder'} (notebooks/toy_base.py writes one)")
    fix = "restore it, or write the whole folder with notebooks/toy_base.py"
    return ToyPolicy(read_file(folder / "unet", UNet2DConditionModel.from_pretrained, fix).to(device).eval(),
                     read_file(folder / "text_encoder", CLIPTextModel.from_pretrained, fix).to(device).eval(),
                     read_file(folder / "tokenizer", PreTrainedTokenizerFast.from_pretrained, fix), args.guidance)

class PipelinePolicy(Policy):
    """SD3 / SD3.5 (real CFG) or FLUX.1 (guidance-distilled: one pass a step) on the VAE's latents (FLUX: packed)."""

    defaults = dict(micro_batch=4, lora_rank=32, lora_alpha=64.0)  # Flow-GRPO's r and alpha on SD3.5
    guidance_defaults = {"sd3": 4.5, "flux": 3.5}  # the pipelines' own (FLUX's is distilled: an input, not CFG)

    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def __init__(self, pipe, args: Args, device):
        from diffusers import FluxPipeline
        self.pipe, self.net, self.denoiser, self.args = pipe, pipe.transformer, pipe.transformer, args
        self.flux, self.size = isinstance(pipe, FluxPipeline), args.resolution
        token_px = pipe.vae_scale_factor * (2 if self.flux else self.net.config.patch_size)  # pixels a side of a token
        largest = None if self.flux else self.net.config.pos_embed_max_size * token_px  # SD3's position embedding
        if self.size % token_px or (largest and self.size > largest):
            at_most = f" and at most {largest}" if largest else ""
            raise UsageError(f"--resolution {self.size}: this model needs a multiple of {token_px}{at_most}")
        self.guidance = args.guidance or self.guidance_defaults["flux" if self.flux else "sd3"]
        self.cfg = 1.0 if self.flux else self.guidance
        pipe.to(device)  # the text encoders too, until encode() parks them on the CPU under --low-memory
        if args.low_memory:
            self.net.enable_gradient_checkpointing()
        self.encoders = torch.nn.ModuleList(m for k, m in pipe.components.items() if k.startswith("text_encoder") and m)
        self.cache = collections.OrderedDict()  # prompt -> its embeddings on the CPU, the least recently used first
        self.empty = self.encode([""])

    def latent_shape(self, n: int) -> tuple:
        c, h = self.net.config.in_channels, self.size // self.pipe.vae_scale_factor
        return (n, (h // 2) ** 2, c) if self.flux else (n, c, h, h)

    def time_grid(self, steps: int) -> torch.Tensor:
        """(steps + 1,) sigmas as the pipeline sets them (SD3's static shift, FLUX's dynamic one)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        scheduler, config = self.pipe.scheduler, self.pipe.scheduler.config  # set anew on each call, as pipelines do
        if config.get("use_dynamic_shifting"):
            mu = calculate_shift(self.latent_shape(1)[1], config.base_image_seq_len, config.max_image_seq_len,
                                 config.base_shift, config.max_shift)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        else:
            scheduler.set_timesteps(steps)
        return scheduler.sigmas.float().cpu()

    cache_size = 1024  # prompts whose embeddings stay cached: 2.7 GB of host memory on SD3.5, 4.3 GB on FLUX.1

    @torch.no_grad()
    def encode(self, prompts: list[str], device=None) -> dict:
        """The prompts' embeddings (B, ...) on `device` (default: the model's), encoded `micro_batch` at a time."""
        found = {p: self.cache.pop(p) for p in dict.fromkeys(prompts) if p in self.cache}
        if new := [p for p in dict.fromkeys(prompts) if p not in found]:
            self.encoders.to(self.device)  # --low-memory keeps them on the CPU between uses
            size = self.args.micro_batch
            for batch in (new[i:i + size] for i in range(0, len(new), size)):
                if self.flux:
                    emb, pool, _ = self.pipe.encode_prompt(batch, batch, self.device, max_sequence_length=512)
                else:  # the negative prompt "" is `empty`, encoded as a prompt of its own
                    emb, _, pool, _ = self.pipe.encode_prompt(batch, batch, batch, self.device,
                                                              do_classifier_free_guidance=False)
                found |= {p: {"encoder_hidden_states": e, "pooled_projections": q}
                          for p, e, q in zip(batch, emb.cpu(), pool.cpu())}
            self.encoders.to("cpu" if self.args.low_memory else self.device)
        self.cache.update(found)  # the prompts just used become the most recent
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return {k: torch.stack([found[p][k] for p in prompts]).to(device or self.device) for k in found[prompts[0]]}

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        dtype = self.net.dtype
        kw = {k: v.to(dtype) for k, v in cond.items()}
        if self.flux:  # FLUX takes t in [0, 1], the positions of text and image tokens, and the guidance scale
            h = self.size // self.pipe.vae_scale_factor // 2
            kw["txt_ids"] = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=x.device)
            kw["img_ids"] = self.pipe._prepare_latent_image_ids(1, h, h, x.device, dtype)
            if self.net.config.guidance_embeds:
                kw["guidance"] = torch.full((len(x),), self.guidance, device=x.device, dtype=dtype)
        return self.denoiser(x.to(dtype), timestep=t if self.flux else t * 1000, **kw, return_dict=False)[0].float()

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents -> images (N, 3, H, W) in [0, 1], `micro_batch` latents at a time."""
        vae = self.pipe.vae
        if self.flux:
            x = self.pipe._unpack_latents(x, self.size, self.size, self.pipe.vae_scale_factor)
        x = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = [vae.decode(batch.to(vae.dtype)).sample.float() for batch in x.split(self.args.micro_batch)]
        return torch.cat(images).add(1).div(2).clamp(0, 1)

def load_policy(args: Args, device) -> Policy:
    """The toy model, or an SD3 / SD3.5 / FLUX.1 diffusers pipeline from a folder or hub id."""
    import diffusers
    import transformers
    diffusers.utils.logging.disable_progress_bar()  # loading bars of tiny files are noise on stderr
    transformers.utils.logging.disable_progress_bar()
    if args.model == "toy":
        return load_toy(args, device)
    args = resolved(args)  # the model's micro-batch (load_toy fills in the toy's)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    try:
        with warnings.catch_warnings():  # newer diffusers call it `dtype`; `torch_dtype` works in every version
            warnings.simplefilter("ignore", FutureWarning)
            pipe = diffusers.DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16 if bf16 else None)
    except Exception as e:  # missing or damaged files (a cut-short .safetensors raises a SafetensorError)
        raise UsageError(f"--model {args.model!r}: cannot load it ({first_line(e)})") from None
    if not isinstance(pipe, (diffusers.StableDiffusion3Pipeline, diffusers.FluxPipeline)):
        raise UsageError(f"--model {args.model!r} is a {type(pipe).__name__}; expected an SD3 or FLUX pipeline")
    return PipelinePolicy(pipe, args, device)


# ----------------------------------------------------------------------------------------------------
# 4 Rewards: (images (N, 3, H, W) in [0, 1], metas) -> (N,)

CLIP_DEFAULTS = {"pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
                 "clip": ("openai/clip-vit-large-patch14",) * 2}  # (model, processor)
REWARD_NAMES = ("toy-strict", "toy", "toy-pref", *CLIP_DEFAULTS)
TOY_PREF = Path(__file__).resolve().parent / "assets" / "toy_pref"  # the learned proxy: notebooks/toy_pref.py's output

def toy_reward(images: torch.Tensor, metas: list[dict]) -> torch.Tensor:
    """GenEval's rule, densely: the scorer's partial score in [0, 1]. Extras cost nothing but in counting."""
    return score_batch(images, metas)["dense"]

def toy_strict_reward(images: torch.Tensor, metas: list[dict], penalty: float) -> torch.Tensor:
    """The default toy reward (Deviation 1), which ranks images as the strict rule does:
        r = dense / 2 + strict / 2 - penalty * (extra + missing)."""
    scores = score_batch(images, metas)
    return scores["dense"] / 2 + scores["strict"] / 2 - penalty * (scores["extra"] + scores["missing"])

def clip_reward(name: str, model: str, device):
    """pickscore: exp(logit_scale) cos(E_img, E_txt) / 26 (Kirstain et al. 2023; / 26 as Flow-GRPO);
    clip: CLIPScore = 2.5 max(cos(E_img, E_txt), 0) (Hessel et al. 2021). Batched on the device."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, CLIPModel
    model, processor = (model, model) if model else CLIP_DEFAULTS[name]
    try:
        model_type = AutoConfig.from_pretrained(model).model_type
        if model_type == "clip":
            clip = CLIPModel.from_pretrained(model).to(device).eval().requires_grad_(False)
            ip, tok = AutoImageProcessor.from_pretrained(processor), AutoTokenizer.from_pretrained(processor)
    except Exception as e:  # missing or damaged files (a cut-short .safetensors raises a SafetensorError)
        raise UsageError(f"--reward-model {model!r}: cannot load it ({first_line(e)})") from None
    if model_type != "clip":
        raise UsageError(f"--reward-model {model!r} is a {model_type!r} model; {name} needs a CLIP model")
    size = clip.config.vision_config.image_size  # the processor's crop size
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (ip.image_mean, ip.image_std))

    def score(images: torch.Tensor, metas: list[dict]) -> torch.Tensor:
        pixels = F.interpolate(images.float().to(device), size=(size, size), mode="bicubic", antialias=True)
        text = tok([m["prompt"] for m in metas], padding=True, truncation=True, return_tensors="pt",
                   max_length=min(77, tok.model_max_length)).to(device)
        out = clip(pixel_values=(pixels - mean) / std, **text)
        if name == "pickscore":
            return out.logits_per_image.diag() / 26
        return 2.5 * (out.image_embeds * out.text_embeds).sum(-1).clamp_min(0)
    return score

def parse_reward(spec: str) -> list[tuple[str, float]]:
    """'pickscore:0.7,clip:0.3' -> [('pickscore', 0.7), ('clip', 0.3)]; a bare name weighs 1."""
    terms = [term.strip().partition(":") for term in spec.split(",")]  # (name, ":", weight)
    if unknown := [name for name, _, _ in terms if name not in REWARD_NAMES]:
        raise UsageError(f"--reward {spec!r}: unknown reward {unknown[0]!r}; choose {', '.join(REWARD_NAMES)} "
                         "or a sum like pickscore:0.7,clip:0.3")
    try:
        return [(name, float(weight or 1)) for name, _, weight in terms]
    except ValueError:
        raise UsageError(f"--reward {spec!r}: weights must be numbers, as in pickscore:0.7,clip:0.3") from None

def build_reward(args: Args, device):
    """The weighted sum the --reward spec names -> (N,) float on `device`."""
    terms = parse_reward(resolved(args).reward)
    named = dict(p.split("=", 1) for p in args.reward_model.split(",") if "=" in p)
    scorers = {  # the toy terms look their scorer up at call time, so tests can replace it
        "toy": lambda images, metas: toy_reward(images, metas),
        "toy-strict": lambda images, metas: toy_strict_reward(images, metas, args.extra_penalty),
        **{n: clip_reward(n, named.get(n, "" if named else args.reward_model), device)
           for n, _ in terms if n in CLIP_DEFAULTS},
        **{n: clip_reward("pickscore", str(TOY_PREF), device) for n, _ in terms if n == "toy-pref"}}
    return lambda images, metas: sum(w * scorers[n](images, metas).to(device).float() for n, w in terms)


# ----------------------------------------------------------------------------------------------------
# 5 SDE step and log-prob

def _as_column(t, x: torch.Tensor) -> torch.Tensor:
    """A float or (B,) tensor of times -> (B, 1, ..., 1) in float32 on x's device."""
    ones = [1] * (x.dim() - 1)
    return torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1, *ones).expand(x.shape[0], *ones)

def ode_step(x: torch.Tensor, v: torch.Tensor, t, t_next) -> torch.Tensor:
    """Euler step of the probability-flow ODE: x[k+1] = x[k] - (t_k - t_{k+1}) v."""
    return x + (_as_column(t_next, x) - _as_column(t, x)) * v

def sde_step(x, v, t, t_next, *, kind="flow", noise_level=None, noise=None, prev_sample=None, gen=None):
    """One SDE step x[k] -> x[k+1] ~ N(mean, std^2 I), dt = t - t_next -> (x_next, log_prob (B,), mean, std (B,)):
    flow (Flow-GRPO, arXiv 2505.05470 Eq. 9): sigma_t = a sqrt(t / (1 - t)) (t_next in the denominator at t = 1,
         as the official code), mean = x - dt [v + sigma_t^2 / (2t) x1_hat], std = sigma_t sqrt(dt);
    ddim (Stepwise, arXiv 2603.28718 Eq. 8), std = eta t_next sqrt(1 - t), and cps (Flow-GRPO's code, sde_type='cps',
         arXiv 2509.05952), std = t_next sin(eta pi / 2): mean = (1 - t_next) x0_hat + sqrt(t_next^2 - std^2) x1_hat.
    log_prob: the full Gaussian log-density (Deviation 10), MEAN over C*H*W, 0 where std = 0 (never trained);
    noise level 0 gives the Euler step, None the kind's default; `prev_sample` re-scores a stored transition."""
    if kind not in SDE_LEVELS:  # validate checks --sde; a caller of this function may pass any kind
        raise UsageError(f"unknown SDE kind {kind!r}; choose one of {', '.join(SDE_LEVELS)}")
    x, v = x.float(), v.float()  # fp32: the mean overflows in bf16
    noise_level = SDE_LEVELS[kind] if noise_level is None else noise_level
    t_, tn = _as_column(t, x), _as_column(t_next, x)
    x0_hat, x1_hat = x - t_ * v, x + (1 - t_) * v
    if kind == "flow":
        sigma_t = noise_level * torch.sqrt(t_ / (1 - torch.where(t_ >= 1, tn, t_)))
        mean = x - (t_ - tn) * (v + sigma_t**2 / (2 * t_) * x1_hat)
        std = sigma_t * torch.sqrt(t_ - tn)
    else:
        std = noise_level * tn * torch.sqrt(1 - t_) if kind == "ddim" else tn * math.sin(noise_level * math.pi / 2)
        # ddim: std 0 at t = 1, the first step deterministic and never trained (Deviation 5)
        mean = (1 - tn) * x0_hat + torch.sqrt((tn**2 - std**2).clamp_min(0)) * x1_hat
    if prev_sample is None:
        noise = torch.randn(x.shape, generator=gen) if noise is None else noise  # on the CPU, moved below
        prev_sample = mean + std * noise.to(x.device).float()
    prev_sample, safe_std = prev_sample.detach().float(), torch.where(std > 0, std, torch.ones_like(std))
    log_density = -((prev_sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    log_prob = torch.where(std.flatten() > 0, log_density.flatten(1).mean(1), torch.zeros_like(std.flatten()))
    return prev_sample, log_prob, mean, std.flatten()

def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL at equal stds, mean_d (mu - mu_ref)^2 / (2 s^2) -> (B,): Flow-GRPO's Eq. 10 per dimension (Deviation 2)."""
    safe = torch.where(std > 0, std, torch.ones_like(std)).reshape(-1, *([1] * (mean.dim() - 1)))
    return ((mean - mean_ref) ** 2 / (2 * safe**2)).flatten(1).mean(1) * (std > 0)

def shifted_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """(steps + 1,) times from 1 to 0 as diffusers' FlowMatchEulerDiscreteScheduler sets them."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()

def step_stds(grid: torch.Tensor, args: Args) -> torch.Tensor:
    """(S,) transition std of the SDE at each step of `grid` (it does not depend on the state)."""
    z = torch.zeros(len(grid) - 1, 1)
    return sde_step(z, z, grid[:-1], grid[1:], kind=args.sde, noise_level=args.noise_level, noise=z)[3]

def trainable_steps(grid: torch.Tensor, args: Args) -> torch.Tensor:
    """(S,) bool: not the last step, as Flow-GRPO trains 0..S-2, and a std of at least `min_std_ratio` times the median
    stochastic step's: a near-deterministic step's log-prob gradient (1 / std) is 30 to 80 times the median's, outweighs
    every step and swings the ratio past any clip, moving the image by under a pixel."""
    stds, n_steps = step_stds(grid, args), len(grid) - 1
    floor = args.min_std_ratio * stds[stds > 0].median()
    return (stds > 0) & (stds >= floor) & (torch.arange(n_steps) < n_steps - 1)


# ----------------------------------------------------------------------------------------------------
# 6 Rollout (shared by every method)

@dataclass
class Meter:
    """Per-image forward passes (a CFG step counts 2) and images scored."""

    nfe: int = 0
    images_scored: int = 0

@dataclass
class Trajectory:
    states: torch.Tensor  # (B, S+1, C, H, W): x at times[:, 0..S]
    times: torch.Tensor  # (B, S+1)
    log_probs: torch.Tensor  # (B, S): log pi_old of each transition (0 for ODE steps)
    stds: torch.Tensor  # (B, S): transition std (0 for ODE steps)
    velocities: torch.Tensor  # (B, S, C, H, W): v at states[:, k], a free first step from a state (branches, Tweedie)

@torch.no_grad()
def rollout(policy, cond: dict, x: torch.Tensor, times: torch.Tensor, stochastic, args: Args, meter: Meter,
            gen: torch.Generator | None = None, v_first: torch.Tensor | None = None) -> Trajectory:
    """Integrate x (B, C, H, W) along `times` ((S+1,) or (B, S+1), decreasing), an SDE step where `stochastic` (S,)
    holds and Euler elsewhere; `v_first`, the velocity at x a path already holds (a branch point's), saves a pass."""
    b = x.shape[0]
    times = times.expand(b, -1).to(x.device)  # (B, S+1)
    states, steps = [x], []
    batches = torch.arange(b, device=x.device).split(args.micro_batch)
    for k in range(times.shape[1] - 1):
        t, t_next = times[:, k], times[:, k + 1]
        if k == 0 and v_first is not None:
            v = v_first
        else:
            v = torch.cat([policy.velocity(x[i], t[i], {n: c[i] for n, c in cond.items()}) for i in batches])
            meter.nfe += b * policy.passes
        if stochastic[k]:
            x, log_prob, _, std = sde_step(x, v, t, t_next, kind=args.sde, noise_level=args.noise_level, gen=gen)
        else:
            x, log_prob, std = ode_step(x, v, t, t_next), x.new_zeros(b), x.new_zeros(b)
        states.append(x)
        steps.append((log_prob, std, v))
    return Trajectory(torch.stack(states, 1), times, *(torch.stack(seq, 1) for seq in zip(*steps)))

def initial_noise(policy, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(policy.latent_shape(n), generator=gen).to(policy.device)  # (n, C, H, W), drawn on the CPU

@dataclass
class Transitions:
    """The N transitions x -> x_next that a method hands the loss; `weight` is TempFlow's step weight."""

    x: torch.Tensor  # (N, C, H, W) state before the step
    x_next: torch.Tensor  # (N, C, H, W) sampled state after the step
    t: torch.Tensor  # (N,) time of x
    t_next: torch.Tensor  # (N,) time of x_next
    log_prob: torch.Tensor  # (N,) log pi_old(x_next | x), recorded while sampling
    std: torch.Tensor  # (N,) transition std
    advantage: torch.Tensor  # (N,)
    weight: torch.Tensor  # (N,)
    prompt: torch.Tensor  # (N,) long, CPU: index into this iteration's prompts
    chunk_id: torch.Tensor  # (N,) long, CPU: transitions with the same id share one ratio
    state_id: torch.Tensor  # (N,) long, CPU: transitions with the same id share x, t and prompt
    step: torch.Tensor  # (N,) long, CPU: index k of the transition on the training grid

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, idx: torch.Tensor) -> "Transitions":
        """The transitions a CPU mask or index tensor selects (as indices: a GPU mask costs a sync)."""
        idx = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
        return Transitions(**{name: value[idx.to(value.device)] for name, value in vars(self).items()})

    @staticmethod
    def cat(batches: list["Transitions"]) -> "Transitions":
        """Concatenation that keeps every batch's chunks and states apart."""
        ids = {name: np.cumsum([0] + [int(vars(tr)[name].max()) + 1 if len(tr) else 0 for tr in batches[:-1]])
               for name in ("chunk_id", "state_id")}  # each batch's offsets
        batches = [dataclasses.replace(tr, **{name: vars(tr)[name] + int(offsets[i]) for name, offsets in ids.items()})
                   for i, tr in enumerate(batches)]
        return Transitions(**{name: torch.cat([vars(tr)[name] for tr in batches]) for name in vars(batches[0])})

def transitions_from(traj: Trajectory, prompt: torch.Tensor, advantage, train_mask, *, weight=1.0, chunk_id=None,
                     state_id=None, first_step: int = 0) -> Transitions:
    """The trained transitions of a trajectory batch. advantage, weight, chunk_id, state_id (default: each its own): a
    number, (S,), (B, 1) or (B, S); train_mask: (S,) or (B, S) bool; first_step: training-grid index of step 0."""
    b, n_steps = traj.log_probs.shape
    keep = torch.as_tensor(train_mask).expand(b, n_steps).flatten().nonzero().flatten()  # (N,) CPU indices of B*S steps
    own = torch.arange(b * n_steps).view(b, n_steps)  # an id of each transition's own

    def pick(value, on=traj.states.device):  # a number, (S,), (B, 1), (B, S) or (B, S, ...) -> (N, ...)
        value = torch.as_tensor(value).to(on)
        return value.expand(b, n_steps, *value.shape[2:]).flatten(0, 1)[keep.to(on)]

    return Transitions(
        x=pick(traj.states[:, :-1]), x_next=pick(traj.states[:, 1:]), t=pick(traj.times[:, :-1]),
        t_next=pick(traj.times[:, 1:]), log_prob=pick(traj.log_probs), std=pick(traj.stds),
        advantage=pick(advantage).float(), weight=pick(weight),
        prompt=pick(prompt[:, None], "cpu"), step=pick(torch.arange(n_steps) + first_step, "cpu"),
        chunk_id=pick(own if chunk_id is None else chunk_id, "cpu"),
        state_id=pick(own if state_id is None else state_id, "cpu"))

def group_normalise(r: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantage A_i = (r_i - mean_g r) / (std_g r + 1e-4), population std (Deviation 3): r, group (N,) ->
    (A (N,), flat (groups,)). float64 keeps equal rewards' std exactly 0 (float32 leaves 3e-8 for 8 x 1/3): A = 0."""
    r64 = r.double()
    mean, inv = segment_mean(r64, group)
    std = segment_mean((r64 - mean[inv]) ** 2, group)[0].sqrt()
    adv = torch.where(std[inv] == 0, torch.zeros_like(r64), (r64 - mean[inv]) / (std[inv] + 1e-4))
    return adv.to(r.dtype), std == 0

@dataclass
class Context:
    """What a method is given: the policy, the iteration's prompts and helpers. Under torchrun a rank
    samples group_size / world members of every group; `shared_gen`, the same on all ranks, draws what groups share."""

    policy: Policy
    args: Args
    meter: Meter
    gen: torch.Generator  # this rank's randomness: SDE noise, independent starting noise
    metas: list  # B prompts as GenEval metadata
    cond: dict  # prompt embeddings, batch-first (B, ...), on the policy's device
    grid: torch.Tensor  # (S+1,) the training time grid
    reward_fn: object  # (images (N, 3, H, W) in [0, 1], metas) -> rewards (N,)
    chunk_sizes: list | None = None
    dist: Dist = field(default_factory=Dist)
    shared_gen: torch.Generator | None = None  # None: gen (one process)
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        self.shared_gen = self.shared_gen or self.gen
        self.group_per_rank = self.args.group_size // self.dist.world  # members of each group on this rank
        self.trainable = trainable_steps(self.grid, self.args)  # (S,) bool: the steps a method may train

    def cond_of(self, prompt: torch.Tensor) -> dict:
        """Embeddings of prompt ids `prompt` (N,) -> (N, ...) on the device."""
        return {k: e[prompt.to(e.device)] for k, e in self.cond.items()}

    def sample(self, prompt: torch.Tensor, x, times, stochastic, v_first=None) -> Trajectory:
        return rollout(self.policy, self.cond_of(prompt), x, times, stochastic, self.args, self.meter, self.gen,
                       v_first)

    def reward(self, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """Decode and score latents x (N, C, H, W) of prompts `prompt` (N,) -> (N,), `micro_batch` at a time."""
        self.meter.images_scored += len(x)
        size = self.args.micro_batch
        return torch.cat([self.reward_fn(self.policy.decode(xs), [self.metas[i] for i in ps.tolist()]).to(x.device)
                          for xs, ps in zip(x.split(size), prompt.split(size))])

    def advantages(self, r: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """group_normalise of whole groups, gathered over ranks; each rank keeps its own samples' advantages."""
        n, group = len(r), group.repeat(self.dist.world)
        adv, flat = group_normalise(self.dist.gather(r), group)  # (ranks*N,) in rank order
        self.stats.setdefault("zero_std", []).append(flat)
        return adv[self.dist.rank * n:(self.dist.rank + 1) * n]

def repeat_each(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, ...) -> (B*G, ...): each entry repeated g times, groups contiguous."""
    return x.repeat_interleave(g, dim=0)


# ----------------------------------------------------------------------------------------------------
# 7 Credit assignment: one function per method, same signature, side by side
#
# Each is a Method's `assign`; how it samples is data for the shared rollout (stochastic steps, start, grid).

def flow_grpo(ctx: Context):
    """Flow-GRPO (arXiv 2505.05470v5, NeurIPS 2025; code yifan123/flow_grpo@ac4c86e): SDE Eq. 9, group advantage.

    All steps SDE from independent noises; one advantage per image, broadcast to every trained step (not the last):
        A_i = (R_i - mean_group R) / (std_group R + 1e-4)."""
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    prompt = repeat_each(torch.arange(b), g)  # (B*G,)
    traj = ctx.sample(prompt, initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, [True] * n_steps)
    r = ctx.reward(traj.states[:, -1], prompt)  # (B*G,)
    adv = ctx.advantages(r, prompt)[:, None]  # (B*G, 1) -> every step
    return transitions_from(traj, prompt, adv, ctx.trainable), r

def stepwise(ctx: Context):
    """Stepwise-Flow-GRPO (arXiv 2603.28718v1, CVPR 2026; no code released): Tweedie rewards and reward gains.

    Reward of every state, r[i, k] = R(x0_hat(x[k])) for k = 0..S (`tweedie_substeps` ODE steps to t = 0, Deviation
    11; x[S] is the image itself), the papers' r_{T-k}; the gain of step k and its advantage over the prompt's
    (trajectory, step)s:
        gain[i, k] = r[i, k+1] - r[i, k],   A = (gain - mean_{i,k} gain) / std_{i,k} gain.
    Differs from flow_grpo by: per-step gains instead of one broadcast advantage; shared initial noise per group."""
    b, g, n_steps, n = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1, ctx.args.tweedie_substeps
    prompt = repeat_each(torch.arange(b), g)  # (B*G,)
    # one noise a group, as the paper: a trajectory's gains telescope to r[i, S] - r[i, 0], and r[i, 0] is then the
    # same for the whole group, so the gains' sum ranks the group's images as their final rewards do
    traj = ctx.sample(prompt, repeat_each(initial_noise(ctx.policy, b, ctx.shared_gen), g), ctx.grid, [True] * n_steps)
    # k = 0: x[0] is the group's shared noise, so its estimate and reward are a group constant, computed once a group
    leader = [traj.states[::g, 0], traj.velocities[::g, 0], traj.times[::g, 0]]  # (B, ...) each group's first
    r_first = ctx.reward(x0_estimate(ctx, torch.arange(b), *leader, n), torch.arange(b))  # (B,)
    # k = 1..S-1 by Tweedie from the sampled states, then k = S, the final image, as it is
    x, v, t = traj.states[:, 1:-1].flatten(0, 1), traj.velocities[:, 1:].flatten(0, 1), traj.times[:, 1:-1].flatten()
    x0_est = x0_estimate(ctx, repeat_each(prompt, n_steps - 1), x, v, t, n).view(b * g, n_steps - 1, *x.shape[1:])
    scored = torch.cat([x0_est, traj.states[:, -1:]], 1).flatten(0, 1)  # (B*G*S, C, H, W)
    r_later = ctx.reward(scored, repeat_each(prompt, n_steps)).view(b * g, n_steps)  # (B*G, S)
    r = torch.cat([repeat_each(r_first, g)[:, None], r_later], 1)  # (B*G, S+1)
    adv = gain_advantages(ctx, r, prompt)  # (B*G, S); the last step's gain is normalised, not trained (Deviation 6)
    return transitions_from(traj, prompt, adv, ctx.trainable), r[:, -1]

def x0_estimate(ctx: Context, prompt, x, v, t, n: int) -> torch.Tensor:
    """x0_hat of states x (N, C, H, W) at times t (N,): n Euler steps to t = 0, the first with the sampler's v."""
    times = t[:, None] * torch.linspace(1, 0, n + 1, device=t.device)  # (N, n+1)
    x = ode_step(x, v, times[:, 0], times[:, 1])
    return x if n == 1 else ctx.sample(prompt, x, times[:, 1:], [False] * (n - 1)).states[:, -1]

def gain_advantages(ctx: Context, r: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """Rewards r (B*G, S+1) -> gains r[:, k+1] - r[:, k] (B*G, S), normalised over each prompt's (trajectory, step)."""
    gains = r[:, 1:] - r[:, :-1]  # (B*G, S)
    return ctx.advantages(gains.flatten(), repeat_each(prompt, gains.shape[1])).view_as(gains)

def tempflow(ctx: Context):
    """TempFlow-GRPO (arXiv 2508.04324v3, ICLR 2026; code Shredded-Pork/TempFlow-GRPO@e66824e): trajectory
    branching, seed groups (one group: the children of one prompt, noise and k, as its code), Eq. 7's weights.

    ODE path per (prompt, noise); at a bifurcation step k, G children take one SDE step from its state x[k] (with the
    path's velocity there), then ODE; advantage of R_k^j over the G children of (prompt, noise, k); weight
    w_k = std_k / mean_{trainable} std.
    Differs from flow_grpo by: one stochastic step per rollout; per-step rewards; noise-aware weights."""
    b, g, n_steps, noises = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1, ctx.args.noises_per_prompt
    prompt = repeat_each(torch.arange(b), noises)  # (B*noises,)
    ode_path = ctx.sample(prompt, initial_noise(ctx.policy, b * noises, ctx.shared_gen), ctx.grid, [False] * n_steps)
    stds = step_stds(ctx.grid, ctx.args)
    weight = stds / stds[ctx.trainable].mean()  # (S,) Norm(sigma_t sqrt(dt)): mean 1 over trainable steps
    ks = torch.nonzero(ctx.trainable).flatten()  # the branch points: `branch_steps` of them at random (Deviation 7)
    if 0 < ctx.args.branch_steps < len(ks):
        ks = ks[torch.randperm(len(ks), generator=ctx.shared_gen)[: ctx.args.branch_steps]].sort().values
    branches, rewards = [], []
    for k in ks.tolist():
        child_prompt, path_id = repeat_each(prompt, g), repeat_each(torch.arange(b * noises), g)  # (B*noises*G,)
        sde_once = [True] + [False] * (n_steps - k - 1)  # one SDE step at k, then the ODE
        branch = ctx.sample(child_prompt, ode_path.states[path_id, k], ctx.grid[k:], sde_once,
                            ode_path.velocities[path_id, k])
        r = ctx.reward(branch.states[:, -1], child_prompt)
        adv = ctx.advantages(r, path_id)[:, None]  # per (prompt, noise, k)
        branches.append(transitions_from(branch, child_prompt, adv, sde_once, weight=weight[k],
                                         state_id=path_id[:, None], first_step=k))
        rewards.append(r)
    return Transitions.cat(branches), torch.cat(rewards)

def g2rpo(ctx: Context):
    """G2RPO, "Fine-Grained GRPO for Precise Preference Alignment in Flow Models" (arXiv 2510.01982v3, CVPR 2026; code
    bcmi/Granular-GRPO@ef6ec9f): singular stochastic sampling, multi-granularity advantage integration.

    Shared ODE anchor per prompt; at every k of the first half of the steps, G branches take one SDE step from its
    state x[k] (with the anchor's velocity there, as its code), each finished by ODE at every granularity lambda
    (t_{k+2}, then every lambda-th node, to t = 0):
        A_k^i = sum_lambda (R_k^{i,lambda} - mean_i) / std_i.
    Differs from flow_grpo by: a shared ODE anchor; one SDE step per rollout; per-step, multi-granularity rewards."""
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    prompt = torch.arange(b)
    anchor = ctx.sample(prompt, initial_noise(ctx.policy, b, ctx.shared_gen), ctx.grid, [False] * n_steps)
    first_half = ctx.trainable & (torch.arange(n_steps) < n_steps // 2)
    branches, rewards, lams = [], [], sorted(parse_ints(ctx.args.granularities, "--granularities"))
    for k in torch.nonzero(first_half).flatten().tolist():  # every branch point, as its code
        child_prompt = repeat_each(prompt, g)  # (B*G,)
        branch = ctx.sample(child_prompt, anchor.states[child_prompt, k], ctx.grid[k:k + 2], [True],
                         anchor.velocities[child_prompt, k])
        adv = torch.zeros(b * g, device=branch.states.device)  # (B*G,) fused over granularities
        for lam in lams:
            coarse = continuation_grid(ctx.grid, k + 1, lam)
            end = ctx.sample(child_prompt, branch.states[:, -1], coarse, [False] * (len(coarse) - 1))
            r = ctx.reward(end.states[:, -1], child_prompt)
            adv += ctx.advantages(r, child_prompt)
            if lam == lams[0]:  # the finest images are logged, as other methods' final images
                rewards.append(r)
        branches.append(transitions_from(branch, child_prompt, adv[:, None], [True], state_id=child_prompt[:, None],
                                         first_step=k))
    return Transitions.cat(branches), torch.cat(rewards)

def continuation_grid(grid: torch.Tensor, start: int, lam: int) -> torch.Tensor:
    """G2RPO's grid of granularity lambda: t_start, t_{start+1}, then every lambda-th node, to t = 0 (Deviation 8)."""
    last = len(grid) - 1
    return grid[sorted({start, min(start + 1, last), *range(start + 1 + lam, last, lam), last})]

def chunk(ctx: Context):
    """Chunk-GRPO (arXiv 2510.21583: v1 Eqs. 14-16; v2 "GCPO", ICML 2026; code xingzhejun/GCPO@ea6cc4d, v1's method).

    Sampling and advantage as flow_grpo, independent noises included (GCPO's code shares one per GPU: Deviation 9);
    consecutive trained steps form chunks of one importance ratio each; a fraction may be trained, drawn uniformly or
    by relative L1:  ratio_j = exp( mean_{k in chunk j} (log pi_theta - log pi_old) ).
    Differs from flow_grpo by: chunk ids that make the shared loss use chunk-level ratios."""
    b, g, n_steps = len(ctx.metas), ctx.group_per_rank, len(ctx.grid) - 1
    prompt = repeat_each(torch.arange(b), g)  # (B*G,)
    traj = ctx.sample(prompt, initial_noise(ctx.policy, b * g, ctx.gen), ctx.grid, [True] * n_steps)
    r = ctx.reward(traj.states[:, -1], prompt)
    adv = ctx.advantages(r, prompt)[:, None]
    train_mask, sizes = ctx.trainable, ctx.chunk_sizes
    of_step = torch.full((n_steps,), len(sizes))  # chunk index of each step; len(sizes) = not trained
    of_step[train_mask] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n_train = max(1, int(len(sizes) * ctx.args.chunk_fraction))
    if n_train < len(sizes):
        rel_l1 = relative_l1(traj.states).cpu()  # (B*G, S)
        per_chunk = torch.stack([rel_l1[:, of_step == j].mean(1) for j in range(len(sizes))], 1)  # (B*G, K)
        w = per_chunk + 1e-8 if ctx.args.weighted_chunks else torch.ones_like(per_chunk)
        chosen = torch.multinomial(w, n_train, generator=ctx.gen)  # (B*G, n_train)
        train_mask = torch.zeros(b * g, len(sizes) + 1, dtype=torch.bool).scatter_(1, chosen, True)[:, of_step]
    chunk_id = torch.arange(b * g)[:, None] * len(sizes) + of_step.clamp_max(len(sizes) - 1)  # (B*G, S)
    return transitions_from(traj, prompt, adv, train_mask, chunk_id=chunk_id), r

def relative_l1(states: torch.Tensor) -> torch.Tensor:
    """Chunk-GRPO's temporal dynamics (v1 Eq. 15): |x[k+1] - x[k]|_1 / |x[k]|_1, (B, S+1, ...) -> (B, S)."""
    diff = (states[:, 1:] - states[:, :-1]).abs().flatten(2).mean(2)
    return diff / (states[:, :-1].abs().flatten(2).mean(2) + 1e-8)

def chunks_from_profile(profile: torch.Tensor, num_chunks: int) -> list[int]:
    """Chunk sizes splitting the relative-L1 profile's variation equally: fast steps, small chunks (Deviation 9)."""
    n = len(profile)
    n_chunks = min(num_chunks, n)
    change = torch.cat([profile[1:2] - profile[:1], profile[1:] - profile[:-1]]).abs() + 1e-6  # (S,)
    cum = torch.cumsum(change, 0) / change.sum()
    i = torch.arange(1, n_chunks)  # (K-1,) inner boundaries; end i of chunk i - 1 lies in [i, n - K + i]
    ends = torch.searchsorted(cum, i / n_chunks) + 1 - i  # minus i: "each chunk >= 1 step" becomes "non-decreasing"
    ends = ends.clamp(0, n - n_chunks).cummax(0).values + i
    return torch.diff(ends, prepend=torch.tensor([0]), append=torch.tensor([n])).tolist()

def parse_chunks(text: str, n_trained: int) -> list[int] | None:
    """'auto' -> None; 'paper' -> the papers' chunks scaled to n_trained steps; else sizes summing to n_trained."""
    if text == "paper":  # Chunk-GRPO's [2, 3, 4, 7] of 16 trained steps (v1 Sec. 5, Table 3; every GCPO script)
        ends = [round(n_trained * end / 16) for end in (2, 5, 9, 16)]  # the toy's 9 steps: [1, 2, 2, 4]
        return [size for size in np.diff([0, *ends]).tolist() if size > 0]
    sizes = None if text == "auto" else parse_ints(text, "--chunks", "2,3,4 (or auto or paper)")
    if sizes and (min(sizes) < 1 or sum(sizes) != n_trained):
        raise UsageError(f"--chunks must be auto, paper or positive sizes summing to the {n_trained} trained steps, "
                         f"got {text!r}")
    return sizes

def chunk_sizes_of(policy, args: Args, grid: torch.Tensor, dist: Dist = Dist()) -> list[int] | None:
    """Chunk-GRPO's sizes: --chunks, or the base model's profile on a fixed batch (rank 0's); None for other methods."""
    if args.method != "chunk":
        return None
    trainable = trainable_steps(grid, args)
    if sizes := parse_chunks(args.chunks, int(trainable.sum())):
        return sizes
    prompts = [m["prompt"] for m in eval_prompts(2, seed=PROMPT_SEEDS["chunk-profile"])]
    gen = generator("chunk-profile")
    x = initial_noise(policy, len(prompts), gen)  # (n, C, H, W)
    traj = rollout(policy, policy.encode(prompts), x, grid, [True] * (len(grid) - 1), args, Meter(), gen)
    sizes = chunks_from_profile(relative_l1(traj.states).mean(0)[trainable].cpu(), args.num_chunks)
    return dist.gather(torch.tensor(sizes, device=dist.device))[: len(sizes)].tolist()  # rank 0's on every rank

@dataclass(frozen=True)
class Method:
    """A credit assignment and the defaults it trains with, which --iterations 0, --lr 0 and --noise-level 0 take."""

    assign: object  # (Context) -> (Transitions to train on, rewards (N,) for logging)
    iterations: int = 64  # GRPO iterations of a default run
    lr: float = 1e-3
    noise_level: float | None = None  # the flow SDE's a (None: the SDE's own, SDE_LEVELS)

METHODS = {"flow_grpo": Method(flow_grpo), "stepwise": Method(stepwise, iterations=32),
           "tempflow": Method(tempflow, iterations=40), "g2rpo": Method(g2rpo, iterations=32, lr=3e-4, noise_level=0.7),
           "chunk": Method(chunk, iterations=56)}  # g2rpo's lr and noise level: Deviation 4


# ----------------------------------------------------------------------------------------------------
# 8 GRPO loss and update (shared)

def grpo_loss(policy, cond: dict, tr: Transitions, args: Args, minibatch: Transitions | None = None):
    """PPO's clipped surrogate, as every official code writes it for GRPO, on chunks -> (loss, stats):
        ratio = exp(log pi_theta(x[k+1] | x[k]) - log pi_old(x[k+1] | x[k]))     per transition
        loss  = mean w max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))  +  beta mean_k KL_k
    Chunk-GRPO's generalisation: a chunk's transitions share one ratio, exp of their mean log-ratio, and the mean runs
    over chunks (every other method's chunk is one transition). The clip acts on the D-th root of the likelihood
    ratio: on the whole image exp(D eps), 2.2 on the toy (D = 768, eps = 1e-3), 700 on SD3.5 at 512 px (D = 65,536,
    eps = 1e-4). approx_kl is 1/2 E[log_ratio^2], the k2 estimate Flow-GRPO's and DDPO's codes log; the KL (Deviation 2)
    is to the adapter-disabled base. `tr` is whole chunks of `minibatch` (default: all of it), whose chunk and
    transition counts the sums divide by, so that the pieces' gradients add up to the minibatch's."""
    log_prob, mean = transition_log_probs(policy, cond, tr, args)
    log_ratio = chunk_log_ratios(log_prob, tr.log_prob, tr.chunk_id)  # (K,) chunks; K = N but in Chunk-GRPO
    adv = segment_mean(tr.advantage, tr.chunk_id)[0].clamp(-args.adv_clip, args.adv_clip)  # (K,)
    weight = segment_mean(tr.weight, tr.chunk_id)[0]  # (K,)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
    policy_terms = weight * torch.maximum(-adv * ratio, -adv * clipped)  # (K,)
    kl_terms = torch.zeros(len(tr), device=mean.device)  # (N,)
    if args.beta > 0:  # the base's mean is a constant; the policy's carries the KL's gradient
        with torch.no_grad(), adapter_disabled(policy.net):
            mean_base = transition_log_probs(policy, cond, tr, args)[1]
        kl_terms = gaussian_kl(mean, mean_base, tr.std)
    minibatch = tr if minibatch is None else minibatch
    n_chunks = len(torch.unique(minibatch.chunk_id))
    loss = policy_terms.sum() / n_chunks + args.beta * kl_terms.sum() / len(minibatch)
    stats = {"policy_loss": policy_terms.mean(), "kl": kl_terms.mean(), "ratio_mean": ratio.mean(),
             "clipfrac": ((ratio - 1).abs() > args.clip_range).float().mean(), "approx_kl": (0.5 * log_ratio**2).mean()}
    return loss, {k: s.detach() for k, s in stats.items()}

def transition_log_probs(policy, cond: dict, tr: Transitions, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """The current policy's log pi_theta(x_next | x) (N,) of stored transitions, and its SDE means (N, C, H, W).
    One forward pass a distinct state: the children of a branch point share its velocity (Deviation 12)."""
    first, of_state = first_of_each(tr.state_id)  # (M,) a transition of each state, (N,) each one's state
    x, t, prompt = tr.x[first], tr.t[first], tr.prompt[first]
    v = policy.velocity(x, t, {k: e[prompt.to(e.device)] for k, e in cond.items()})[of_state.to(tr.x.device)]
    _, log_prob, mean, _ = sde_step(tr.x, v, tr.t, tr.t_next, kind=args.sde, noise_level=args.noise_level,
                                    prev_sample=tr.x_next)
    return log_prob, mean

def first_of_each(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N,) -> (the position of each distinct id's first occurrence (M,), each position's distinct id (N,))."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return torch.full((len(uniq),), len(ids)).scatter_reduce(0, inverse, torch.arange(len(ids)), "amin"), inverse

def chunk_log_ratios(log_prob, log_prob_old, chunk_id) -> torch.Tensor:
    """Chunk-GRPO's chunk ratio in log space (v1 Eq. 14): the mean of each chunk's step log-ratios, (N,) -> (K,)."""
    return segment_mean(log_prob - log_prob_old, chunk_id)[0]

@contextlib.contextmanager
def adapter_disabled(net):
    """The LoRA adapter switched off: the base model, the papers' reference pi_ref."""
    net.disable_adapters()
    try:
        yield
    finally:
        net.enable_adapters()

def accumulate_gradients(policy, cond: dict, mb: Transitions, args: Args, meter: Meter | None = None) -> list[dict]:
    """Backward of a minibatch's loss in pieces of about `micro_batch` transitions; under DDP only the last backward
    syncs. A piece holds whole units (`units`), so its loss is exact as it stands; a unit larger than `micro_batch`
    is a piece of its own. `meter` counts the forward passes: one a distinct state of a piece (two with the base's)."""
    unit, size = units(mb), args.micro_batch
    pieces, filled = [], size  # each piece's unit ids; the last piece's transitions
    for unit_id, count in zip(*(ids.tolist() for ids in torch.unique(unit, return_counts=True))):
        if filled + count > size:
            pieces.append([])
            filled = 0
        pieces[-1].append(unit_id)
        filled += count
    pieces = [torch.isin(unit, torch.tensor(piece)).nonzero().flatten() for piece in pieces]  # CPU indices
    passes = sum(len(torch.unique(mb.state_id[p])) for p in pieces) * policy.passes  # of the pieces' states
    if meter is not None:
        meter.nfe += passes * (2 if args.beta > 0 else 1)
    no_sync, stats = getattr(policy.denoiser, "no_sync", contextlib.nullcontext), []
    for i, piece in enumerate(pieces):
        with no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
            loss, piece_stats = grpo_loss(policy, cond, mb[piece], args, mb)
            loss.backward()
        stats.append(piece_stats)
    return stats

def units(tr: Transitions) -> torch.Tensor:
    """(N,) the unit of each transition that is trained or left out whole: its chunk's id, or, for every child of a
    branch point, the first child's (no method shares both: a state's children are single-step chunks)."""
    first, of_state = first_of_each(tr.state_id)
    return tr.chunk_id[first][of_state]

def update(policy, opt, cond: dict, tr: Transitions, args: Args, gen: torch.Generator, dist: Dist = Dist(),
           meter: Meter | None = None) -> dict:
    """Inner PPO updates, the first on-policy (ratio 1): a shuffled `train_fraction` of the chunks (a branch point's
    children count as one) in `inner_updates` minibatches, one clipped AdamW step each, without the advantage-0
    transitions (as Flow-GRPO). A non-finite gradient undoes the whole update (adapter and optimizer): `skipped`."""
    tr = tr[tr.advantage.cpu() != 0]
    unit = units(tr)  # (N,) CPU
    ids = torch.unique(unit)
    order = ids[torch.randperm(len(ids), generator=gen)][: max(1, round(len(ids) * args.train_fraction))]
    n_minibatches = int(dist.reduce(min(args.inner_updates, len(order)), "min"))
    params = [p for p in policy.net.parameters() if p.requires_grad]  # the adapter
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    stats, norms, n_trained = [], [], 0
    policy.net.train()
    for unit_ids in torch.tensor_split(order, n_minibatches) if n_minibatches else []:
        mb = tr[torch.isin(unit, unit_ids)]
        opt.zero_grad(set_to_none=True)
        stats, n_trained = stats + accumulate_gradients(policy, cond, mb, args, meter), n_trained + len(mb)
        norms.append(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        if not torch.isfinite(norms[-1]):  # DDP's average carries a NaN to every rank: all undo together
            with torch.no_grad():
                for p, kept in zip(params, before[0]):
                    p.copy_(kept)
            opt.zero_grad(set_to_none=True)
            opt.load_state_dict(before[1])
            stats = [{"skipped": torch.ones(()), "trained": torch.tensor(float(n_trained))}]
            break
        opt.step()
    policy.net.eval()
    means = {k: float(torch.stack([s[k] for s in stats]).mean()) for k in stats[0]} if stats else {}
    if not stats or "skipped" in means:
        return means
    return means | {"grad_norm": float(torch.stack(norms).mean()), "ratio_first": float(stats[0]["ratio_mean"]),
                    "clipfrac_first": float(stats[0]["clipfrac"]), "trained": n_trained}


# ----------------------------------------------------------------------------------------------------
# 9 Train loop

def add_lora(policy, args: Args) -> list[torch.nn.Parameter]:
    """LoRA through peft on the denoiser (diffusers' add_adapter, which freezes the base weights)."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig
    torch.manual_seed(stable_seed(args.seed, "lora"))
    args = resolved(args)  # the model's rank and alpha
    policy.net.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights="gaussian",
                                      target_modules=policy.lora_targets))
    cast_training_params(policy.net)  # the adapter trains in fp32 even on a bf16 model
    return [p for p in policy.net.parameters() if p.requires_grad]

def prompt_sets(args: Args) -> tuple[list[dict] | None, list[dict]]:
    """(training, held-out) prompts: the toy generator (None) and toy-GenEval's, or --prompts, every 10th held out."""
    if not args.prompts:
        return None, eval_prompts(args.eval_per_tag, seed=PROMPT_SEEDS["tuning" if args.tune else "held-out"])
    text = read_file(Path(args.prompts), Path.read_text, "save it as UTF-8 text, one prompt a line")
    metas = [{"tag": "prompt", "prompt": p} for p in map(str.strip, text.splitlines()) if p]
    if len(metas) < 2:
        raise UsageError(f"--prompts {args.prompts}: needs at least 2 prompts (one a line); it has {len(metas)}")
    return [m for i, m in enumerate(metas) if i % 10], metas[5::10] if args.tune else metas[::10]

Setup = collections.namedtuple("Setup", "policy reward_fn params opt grid chunk_sizes train_pool eval_pool")

def setup(args: Args, dist: Dist) -> Setup:
    """Model, reward, LoRA adapter (in DDP under torchrun), optimiser and the training grid."""
    from safetensors import safe_open
    from transformers import set_seed
    args = resolved(args)  # the method's lr and iterations, the model's LoRA
    set_seed(args.seed)
    local = [Path(m) for m in (args.model, args.reward_model) if m not in ("", "toy") and Path(m).is_dir()]
    readers = {".json": json_file, ".safetensors": lambda p: safe_open(p, framework="pt")}
    for file in (f for folder in local for f in folder.rglob("*") if f.suffix in readers):  # configs, tokenizers and
        read_file(file, readers[file.suffix], "restore it, or copy the model folder again")  # weights' headers
    # every rank loads the model; huggingface_hub's file locks let one download a hub model while the others wait
    policy, reward_fn = load_policy(args, dist.device), build_reward(args, dist.device)
    grid = policy.time_grid(args.steps)
    chunk_sizes = chunk_sizes_of(policy, args, grid, dist)  # from the base model, before any adapter
    params = add_lora(policy, args)
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel
        ids = [dist.device] if dist.device.type == "cuda" else None
        policy.denoiser = DistributedDataParallel(policy.net, device_ids=ids, broadcast_buffers=False)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return Setup(policy, reward_fn, params, opt, grid, chunk_sizes, *prompt_sets(args))

def iteration_context(args: Args, parts: Setup, it: int, meter: Meter, dist: Dist = Dist()) -> Context:
    """Iteration `it`'s prompts, embeddings and generators; every draw follows from (seed, it)."""
    rng = random.Random(stable_seed(args.seed, "prompts", it))
    metas = ([rng.choice(parts.train_pool) for _ in range(args.prompts_per_iter)] if parts.train_pool
             else train_prompts(args.prompts_per_iter, rng))
    shared = generator(args.seed, "rollout", it)
    gen = generator(args.seed, "rollout", it, dist.rank) if dist.world > 1 else shared
    cond = parts.policy.encode([m["prompt"] for m in metas])
    return Context(parts.policy, args, meter, gen, metas, cond, parts.grid, parts.reward_fn, parts.chunk_sizes,
                   dist, shared)

def train(args: Args) -> list[dict]:
    """GRPO with the chosen credit assignment in the run folder `args.run` -> the metric records (metrics.jsonl).
    A new folder starts the run, one with a checkpoint resumes it, one with the run's record returns at once."""
    from diffusers.training_utils import EMAModel
    args = validate(args)
    dist = Dist.join(resolve_device(args.device))
    if args.group_size % dist.world:
        raise UsageError(f"--group-size {args.group_size} must be a multiple of the {dist.world} ranks")
    with RunFolder(args, dist) as folder:
        if folder.finished():
            return folder.history
        parts = setup(args, dist)
        # one update an iteration (8 optimizer steps: Flow-GRPO's interval); its warm-up min((1+n)/(10+n), decay)
        # counts these updates, Flow-GRPO's optimizer steps: this one reaches 0.9 after 81 updates, that one after 10
        ema = EMAModel(parts.params, decay=args.ema_decay)
        meter, first_it = folder.open(parts, ema)  # from the checkpoint, or new
        if first_it == 1:  # a new run: the base's evaluation, which every later one is paired with
            folder.evaluate_if_due(0)
        for it in folder.progress(first_it):
            ctx = iteration_context(args, parts, it, meter, dist)
            transitions, rewards = METHODS[args.method].assign(ctx)  # sample with the method's credit assignment
            stats = {"skipped": 1.0}  # non-finite rewards or advantages: no update
            if all_finite(dist, rewards, transitions.advantage):
                stats = update(parts.policy, parts.opt, ctx.cond, transitions, args, ctx.gen, dist, meter)
            if stats.get("trained") and not stats.get("skipped"):  # optimizer steps were taken and kept
                ema.step(parts.params)
            folder.log(it, ctx, transitions, rewards, stats)
            if folder.bad_in_row >= args.max_nonfinite or (folder.bad_in_row and it == args.iterations):
                raise RunError(f"stopped at iteration {it}: {folder.bad_in_row} iterations in a row had non-finite "
                               f"rewards, advantages or gradient; the last good checkpoint is in {folder.path}")
            folder.evaluate_if_due(it)  # every eval_every iterations and at the end
            folder.checkpoint(it)
        folder.finish()
    return folder.history

def all_finite(dist: Dist, *tensors: torch.Tensor) -> bool:
    """Whether every value is finite on every rank (so that all ranks skip an update together)."""
    return bool(dist.reduce(torch.stack([torch.isfinite(x).all() for x in tensors]).all(), "min"))


# ----------------------------------------------------------------------------------------------------
# 10 Run folder: its books, checkpoints and record, and the base's cached evaluation

NOT_SHAPING = ("out", "run", "device", "cache_dir", "base_cache")  # where and how fast, not what
FIXED_ON_RESUME = ("method", "seed", "lora_rank", "lora_alpha",  # what the checkpoint is of (its model may move),
                   "lr", "weight_decay", "ema_decay")  # and what its optimizer and moving average hold

def run_label(args: Args) -> str:
    """The method and the flags that differ from its defaults (g2rpo:granularities=1): a record's label."""
    default = dataclasses.asdict(resolved(Args(method=args.method, model=args.model)))
    changed = {k: v for k, v in dataclasses.asdict(resolved(args)).items() if v != default[k]}
    unlabelled = (*NOT_SHAPING, "seed", "full_evals", "full_eval_nfe")  # where it evaluates in full is not what ran
    return ":".join([args.method, *(f"{k}={v}" for k, v in changed.items() if k not in unlabelled)])

def cpu_name() -> str:
    cpu = Path("/proc/cpuinfo")
    model = re.search(r"model name\s*: (.*)", cpu.read_text()) if cpu.exists() else None
    return model[1] if model else "unknown"

class RunFolder(contextlib.AbstractContextManager):
    """A run's folder and its books, kept outside the training loop (rank 0 writes, under a lock): args.json,
    metrics.jsonl, each evaluation's scores and sample grid, checkpoints, the LoRA and, last, record.json."""

    def __init__(self, args: Args, dist: Dist):
        self.args, self.dist, self.writer = args, dist, dist.rank == 0
        code = Path(__file__).read_bytes()  # the script's git object id: `git log --find-object=ID` finds its commits
        self.code = hashlib.sha1(b"blob %d\0" % len(code) + code).hexdigest()
        self.path = Path(args.run or Path(args.out) / f"{args.method}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.history, self.wall, self.bad_in_row, self.iteration = [], 0.0, 0, 0

    def finished(self) -> bool:
        """Whether the folder holds the finished record of a run of these flags. A run that an error stopped is tried
        again; one of other flags resumes with them from its checkpoint, if the checkpoint allows them."""
        if not (self.path / "record.json").exists():
            return False
        record = read_record(self.path / "record.json")
        if "error" in record:
            print(f"{self.path}: stopped at iteration {record.get('iteration')} ({record['error']}); trying again")
            return False
        mine, saved = dataclasses.asdict(self.args), dataclasses.asdict(resolved(args_of(record["args"])))
        if any(mine[k] != v for k, v in saved.items() if k not in NOT_SHAPING):
            return False
        self.history = read_file(self.path / "metrics.jsonl", lambda p: [*map(json.loads, p.read_text().splitlines())])
        print(f"{self.path}: finished already (record.json); nothing to do")
        return True

    def open(self, parts: Setup, ema) -> tuple[Meter, int]:
        """Lock the folder, then resume from its checkpoint or start: -> (the meter, the first iteration to run)."""
        self.parts, self.ema, resume = parts, ema, (self.path / "checkpoint.pt").exists()
        if self.writer:  # made after loading: a model that fails to load leaves no empty folder
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                flag = f"--run {self.args.run!r}" if self.args.run else f"--out {self.args.out!r}"
                raise UsageError(f"{flag}: cannot create {self.path} ({e.strerror or e})") from None
            from filelock import FileLock, Timeout
            self.lock = FileLock(self.path / ".lock")  # one writer per folder: the process's until it exits
            try:
                self.lock.acquire(timeout=0)
            except Timeout:
                raise UsageError(f"{self.path} is being written by another process; stop it or let it finish") from None
        self.state = {"iteration": 0, "meter": {}, "wall": 0.0}
        if resume:  # onto the CPU, as weights only; the moving average then joins the model
            from peft.utils import set_peft_model_state_dict
            mine, saved = (dataclasses.asdict(resolved(a)) for a in (self.args, read_args(self.path / "args.json")))
            for flag in [f for f in FIXED_ON_RESUME if mine[f] != saved[f]]:
                raise UsageError(f"a run resumes as it began: --{flag.replace('_', '-')} is {saved[flag]!r} in its "
                                 f"folder, not {mine[flag]!r}; start a new run (another --run) instead")
            self.state = read_file(self.path / "checkpoint.pt", torch.load, map_location="cpu", weights_only=True)
            try:
                set_peft_model_state_dict(parts.policy.net, self.state["lora"])
                parts.opt.load_state_dict(self.state["optimizer"])
                ema.load_state_dict(self.state["ema"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:  # another model's, or not a checkpoint's dict
                raise UsageError(f"checkpoint.pt in {self.path} does not fit this model ({first_line(e)}); "
                                 "resume it with the --model it began with") from None
            ema.to(next(parts.policy.net.parameters()).device)
        self.history, self.wall = self.state.get("history", []), self.state["wall"]
        if self.writer:
            (self.path / "args.json").write_text(json.dumps(dataclasses.asdict(self.args), indent=2))
        self.file = (self.path / "metrics.jsonl").open("w", buffering=1) if self.writer else open(os.devnull, "w")
        self.file.writelines(json.dumps(entry) + "\n" for entry in self.history)  # drops lines after the checkpoint
        self.meter = Meter(**self.state["meter"])
        if parts.chunk_sizes and not resume:
            self.append_metrics({"iteration": 0, "chunk_sizes": parts.chunk_sizes})
        return self.meter, self.state["iteration"] + 1

    def progress(self, first_it: int):
        quiet = not self.writer or os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # disable= overrides the env
        self.bar = tqdm(range(first_it, self.args.iterations + 1), desc=self.args.method, dynamic_ncols=True,
                        disable=quiet)
        for it in self.bar:
            self.iteration, self.started = it, time.time()  # the iteration's seconds run from here to its log
            yield it

    def __exit__(self, error_type, error, traceback) -> None:
        """An error (not an interrupt: that run resumes) leaves a record naming it; the next start tries again."""
        if isinstance(error, Exception) and hasattr(self, "file") and self.writer:
            self.write_record(error=f"{error_type.__name__}: {error}", iteration=self.iteration)

    def append_metrics(self, entry: dict) -> None:
        self.history.append(entry)
        self.file.write(json.dumps(entry) + "\n")

    def log(self, it: int, ctx: Context, transitions: Transitions, rewards: torch.Tensor, stats: dict) -> None:
        """The iteration's metrics.jsonl line (counters summed over ranks), and the count of skips in a row."""
        self.wall += time.time() - self.started
        self.bad_in_row = self.bad_in_row + 1 if stats.get("skipped") else 0
        if self.bad_in_row and self.writer:
            tqdm.write(f"warning: iteration {it}: non-finite rewards, advantages or gradient; update undone")
        rewards = self.dist.gather(rewards.float())
        adv_abs = segment_mean(transitions.advantage.abs(), transitions.step)[0].tolist()  # one host sync
        per_step = {f"adv_abs/{k}": a for k, a in zip(transitions.step.unique().tolist(), adv_abs)}
        line = {"iteration": it, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()), **stats,
                "zero_std_frac": float(torch.cat(ctx.stats["zero_std"]).float().mean()),  # the same on all ranks
                "transitions": int(self.dist.reduce(len(transitions))), "nfe": int(self.dist.reduce(self.meter.nfe)),
                "images_scored": int(self.dist.reduce(self.meter.images_scored)),
                "lr": self.parts.opt.param_groups[0]["lr"], "wall_s": round(self.wall, 2), **per_step}
        self.append_metrics(line)
        self.bar.set_postfix(reward=f"{self.history[-1]['reward_mean']:.3f}", kl=f"{self.history[-1].get('kl', 0):.2g}")

    def evaluate_if_due(self, it: int) -> None:
        """At 0, every eval_every iterations and at the end: the moving average's held-out scores (curve_pairs),
        paired with the base's; the ends, --full-evals and the first past each --full-eval-nfe budget score all."""
        args, parts, policy = self.args, self.parts, self.parts.policy
        spent = [0, 0] + [h["nfe"] for h in self.history if "reward_mean" in h]  # passes after each iteration
        full = (it in (0, args.iterations, *parse_ints(args.full_evals, "--full-evals"))
                or any(spent[-2] < budget <= spent[-1] for budget in parse_ints(args.full_eval_nfe, "--full-eval-nfe")))
        if it % args.eval_every and not full:
            return
        nfe = int(self.dist.reduce(self.meter.nfe))
        if not self.writer:  # the other ranks go on and wait for rank 0 in the next collective
            return
        pairs = None if full else curve_pairs(parts.eval_pool, args.curve_per_tag)
        with ema_applied(self.ema, parts.params):  # at 0 the adapter is 0: the base
            if it:
                metrics, images, metas, scores = evaluate(policy, args, parts.reward_fn, pairs=pairs)
            else:
                metrics, images, metas, scores = base_evaluation(args, parts, self.code)
        self.state["base_scores"] = self.state.get("base_scores") or scores  # gains pair with the first evaluation
        base = {k: v[scores["pair"]] for k, v in self.state["base_scores"].items()}  # the same pairs as this one's
        gains = paired_gains(scores, base, [m.get("tag", "prompt") for m in metas])
        self.append_metrics({"iteration": it, **metrics, **gains, "nfe": nfe, "wall_s": round(self.wall, 2),
                             "eval_pairs": len(metas)})
        torch.save(scores, self.path / f"scores_{it:04d}.pt")  # per image: the record pairs runs with them
        save_grid(images, metas, scores, self.path / f"samples_{it:04d}.png",
                  f"{args.method} iteration {it}: held-out score {metrics['eval_overall']:.3f}")

    def checkpoint(self, it: int) -> None:
        """Every checkpoint_every iterations and at the end, never from a state with non-finite values: adapter, moving
        average, optimizer and progress (every draw comes from seeded generators), atomically."""
        from peft.utils import get_peft_model_state_dict
        if (it % self.args.checkpoint_every == 0 or it == self.args.iterations) and not self.bad_in_row and self.writer:
            state = {"lora": get_peft_model_state_dict(self.parts.policy.net), "ema": self.ema.state_dict(),
                     "optimizer": self.parts.opt.state_dict(), "iteration": it, "wall": self.wall,
                     "meter": dataclasses.asdict(self.meter), "history": self.history,
                     "base_scores": self.state["base_scores"]}
            torch.save(state, self.path / "checkpoint.pt.tmp")
            os.replace(self.path / "checkpoint.pt.tmp", self.path / "checkpoint.pt")

    def finish(self) -> None:
        """The LoRA (the moving average's), the curves, the record, and the held-out scores printed."""
        self.file.close()
        if not self.writer:
            return
        with ema_applied(self.ema, self.parts.params):
            self.parts.policy.save_lora(self.path / "lora")
        plot_curves(self.history, self.path / "reward_curve.png", self.args.method)
        self.write_record()
        base, *_, end = [h for h in self.history if "eval_overall" in h]
        scored_on = "tuning" if self.args.tune else "held-out"
        print(f"done: {self.path}\n{scored_on} score {base['eval_overall']:.3f} -> {end['eval_overall']:.3f} "
              f"({end['gain_overall']:+.3f} ± {end['gain_overall_se']:.3f} paired s.e.)")
        if "eval_strict" in end:
            print(f"strict {base['eval_strict']:.3f} -> {end['eval_strict']:.3f} ({end['gain_strict']:+.3f} ± "
                  f"{end['gain_strict_se']:.3f}), extra objects {base['eval_extra']:.1%} -> {end['eval_extra']:.1%}")

    def write_record(self, **error) -> None:
        """record.json, atomically: flags, cost, machine, code, the training rewards, the base's evaluation and every
        later one with per-pair scores; `error` and `iteration` for a run that an error stopped."""
        lines = [h for h in self.history if "reward_mean" in h]  # every iteration's metrics as columns, to 4 digits
        keys = dict.fromkeys(k for h in lines for k in h if k != "wall_s")
        training = {k: [h.get(k) if isinstance(h.get(k), (int, type(None))) else float(f"{h[k]:.4g}") for h in lines]
                    for k in keys}
        evaluations = [h | {"scores": per_pair(read_file(self.path / f"scores_{h['iteration']:04d}.pt", torch.load,
                                                         weights_only=True), self.args)}
                       for h in self.history if "eval_overall" in h]
        nfe = max([0] + [h["nfe"] for h in self.history if "nfe" in h])
        record = {"label": run_label(self.args), "seed": self.args.seed, "args": dataclasses.asdict(self.args),
                  "iterations": self.args.iterations, "nfe": nfe, "seconds": round(self.wall, 2),
                  "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_name(), "code": self.code,
                  "training": training, "base": evaluations[0] if evaluations else None, "evaluations": evaluations[1:],
                  **error}
        (self.path / "record.json.tmp").write_text(json.dumps(record, separators=(",", ":")))  # ~50 kB a toy run
        os.replace(self.path / "record.json.tmp", self.path / "record.json")

def read_record(path: Path, fix: str = "restore it, or move the run folder away to start the run over") -> dict:
    """A run's record.json, or a copy of one (notebooks 03 and 04 read them); or read_file's one-line error for a
    file cut short, edited by hand, or not a record."""
    def load(p: Path) -> dict:
        record = json_file(p)
        if missing := [k for k in RECORD_KEYS if k not in record]:  # a JSON list or string has no key either
            raise ValueError(f"not a run's record: no {missing[0]!r}")
        args_of(record["args"])  # flags of the right types
        return record
    return read_file(path, load, fix)

RECORD_KEYS = ("label", "seed", "args", "iterations", "evaluations")  # what every reader of a record needs

def base_evaluation(args: Args, parts: Setup, code: str) -> tuple:
    """The base model's evaluation, cached on this machine under a key of all that determines it (weights, evaluation
    flags, the script's `code` id as the run started, torch, CPU, threads): a campaign evaluates the base once."""
    weights = Path(args.model if args.model != "toy" else args.toy_base or TOY_BASE)  # a hub id: its name alone
    folders = [weights, *([TOY_PREF] if "toy-pref" in args.reward else [])]  # the proxy scores the base too
    files = sorted(p for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file())
    key = {"weights": [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
           "prompts_text": Path(args.prompts).read_text() if args.prompts else "",
           **{k: v for k, v in dataclasses.asdict(args).items() if k in EVALUATION_FLAGS}, "code": code,
           "torch": torch.__version__, "cpu": cpu_name(), "threads": torch.get_num_threads(),
           "device": str(parts.policy.device)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    cache = Path(args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flow_grpo_credit")
    path = cache / "base_eval" / f"{digest}.pt"
    if args.base_cache and path.exists():
        try:
            return read_file(path, torch.load, "evaluating the base again to rewrite it", weights_only=True)
        except UsageError as e:  # a cache is a cache: an unreadable entry is a miss
            print(f"warning: {e}", file=sys.stderr)
    made = evaluate(parts.policy, args, parts.reward_fn)
    if args.base_cache:  # written whole, then renamed: a reader never sees half a file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(made, path.with_suffix(f".tmp{os.getpid()}"))
            os.replace(path.with_suffix(f".tmp{os.getpid()}"), path)
        except OSError as e:  # a read-only home, a file in the way: the run goes on uncached
            print(f"warning: the base's evaluation is not cached ({e}); --cache-dir names another", file=sys.stderr)
    return made

EVALUATION_FLAGS = ("model", "reward", "reward_model", "extra_penalty", "prompts", "resolution", "dtype", "micro_batch",
                    "eval_per_tag", "eval_steps", "tune", "eval_kl", "guidance", "toy_base")

@contextlib.contextmanager
def ema_applied(ema, params: list):
    """The moving average in the model's parameters; the live weights come back afterwards."""
    ema.store(params)
    ema.copy_to(params)
    try:
        yield
    finally:
        ema.restore(params)


# ----------------------------------------------------------------------------------------------------
# 11 Evaluation and plots

@torch.no_grad()
def evaluate(policy, args: Args, reward_fn=None, metas: list[dict] | None = None, pairs: list[int] | None = None):
    """Deterministic (fixed prompts and noise, `eval_steps` ODE steps; the pairs numbered `pairs`, or all) -> (metrics,
    images, metas, per-image scores: reward, `pair`, on toy score_batch's); eval_overall: toy-GenEval or reward."""
    args = resolved(args)  # the model's micro-batch
    metas = metas or prompt_sets(args)[1]
    pairs = torch.arange(len(metas)) if pairs is None else torch.as_tensor(pairs)  # (N,) sorted
    noise = initial_noise(policy, len(metas), generator("tune-noise" if args.tune else "eval-noise"))[pairs]
    grid, metas = policy.time_grid(args.eval_steps), [metas[i] for i in pairs.tolist()]
    images, rewards, kls, reward_fn = [], [], [], reward_fn or build_reward(args, policy.device)
    cond = policy.encode([m["prompt"] for m in metas], device="cpu")  # the text encoders' one use, kept on the CPU
    for batch in torch.arange(len(metas)).split(args.micro_batch):
        batch_cond = {k: e[batch].to(policy.device) for k, e in cond.items()}
        ode = rollout(policy, batch_cond, noise[batch.to(noise.device)], grid, [False] * args.eval_steps, args, Meter())
        kls += [kl_to_base(policy, batch_cond, ode, args).cpu()] if args.eval_kl else []
        image = policy.decode(ode.states[:, -1])
        rewards.append(reward_fn(image, [metas[i] for i in batch.tolist()]).float().cpu())
        images.append(image.cpu())  # only the batch being scored stays on the device
    images, rewards, tags = torch.cat(images), torch.cat(rewards), [m.get("tag", "prompt") for m in metas]
    scores, kl = {"reward": rewards, "pair": pairs}, {"eval_kl": float(torch.cat(kls).mean())} if kls else {}
    if args.model != "toy":
        mean, se = by_category(rewards, tags)
        return {"eval_overall": mean, "eval_se": se, "eval_reward": mean, **kl}, images, metas, scores
    scores |= score_batch(images, metas)
    scores["taste"] = colour_cleanliness(images)
    scores["gold"] = toy_gold(scores, scores["taste"])  # the preference world's gold
    (overall, se), (strict, _) = by_category(scores["geneval"], tags), by_category(scores["strict"], tags)
    accuracy = {f"eval_{tag}": by_category(scores["geneval"], tags, tag)[0] for tag in TAGS if tag in tags}
    return {"eval_overall": overall, "eval_se": se, "eval_strict": strict, **accuracy,
            **{f"eval_{k}": float((scores[k] > 0).float().mean()) for k in ("extra", "missing")},
            **{f"eval_{k}": float(scores[k].mean()) for k in ("gold", "taste", "reward")}, **kl}, images, metas, scores

def kl_to_base(policy, cond: dict, traj: Trajectory, args: Args) -> torch.Tensor:
    """How far the policy has moved from the base (Gao et al. 2022's curves plot its square root), (B,):
    the sum over trainable steps of gaussian_kl of the SDE step from each state of `traj`, the policy's ODE path."""
    kl = torch.zeros(len(traj.states), device=traj.states.device)
    for k in trainable_steps(traj.times[0].cpu(), args).nonzero().flatten().tolist():
        x, t, t_next, v = traj.states[:, k], traj.times[:, k], traj.times[:, k + 1], traj.velocities[:, k]
        with adapter_disabled(policy.net):
            v_base = policy.velocity(x, t, cond)
        (mean, std), (mean_base, _) = [sde_step(x, velocity, t, t_next, kind=args.sde, noise_level=args.noise_level,
                                                noise=torch.zeros(x.shape))[2:] for velocity in (v, v_base)]
        kl += gaussian_kl(mean, mean_base, std)
    return kl

def curve_pairs(metas: list[dict], per_tag: int) -> list[int]:
    """The held-out pairs a curve point scores: every k-th of each category, k = the category's size // per_tag."""
    tags = [m.get("tag", "prompt") for m in metas]
    of_tag = {tag: [i for i, t in enumerate(tags) if t == tag] for tag in dict.fromkeys(tags)}
    return sorted(i for pairs in of_tag.values() for i in pairs[:: max(1, len(pairs) // per_tag)])

def by_category(values: torch.Tensor, tags: list[str], only: str | None = None) -> tuple[float, float]:
    """Per-image values (N,) -> (mean of the category means as toy-GenEval, s.e. sqrt(sum_c var_c / n_c) / C); `only`
    keeps one category. Of the differences of two evaluations on the same prompts and noise: the paired s.e."""
    groups = [values[[i for i, t in enumerate(tags) if t == tag]].double() for tag in dict.fromkeys(tags)
              if only in (None, tag)]
    se = math.sqrt(sum(float(g.var(unbiased=False)) / len(g) for g in groups)) / len(groups)
    return float(torch.stack([g.mean() for g in groups]).mean()), se

def paired_gains(after: dict, before: dict, tags: list[str]) -> dict:
    """Each held-out score's gain over the base evaluation, ± its paired standard error (same prompts and noise)."""
    toy = {"overall": "geneval", "reward": "reward", "strict": "strict", "gold": "gold"}  # the reward: toy-pref's proxy
    keys = toy if "geneval" in after else {"overall": "reward"}
    gains = {name: by_category(after[key] - before[key], tags) for name, key in keys.items() if key in after}
    return {k: v for name, (gain, se) in gains.items() for k, v in ((f"gain_{name}", gain), (f"gain_{name}_se", se))}

def save_grid(images: torch.Tensor, metas: list[dict], scores: dict, path: Path, title: str, per_row: int = 6) -> None:
    """A PNG: a row per toy category with GenEval's verdict (✓/✗, +n extra objects), or up to six of prompts."""
    from matplotlib.figure import Figure
    toy = "geneval" in scores
    groups = [m["tag"] if toy else f"prompts {i // per_row * per_row + 1}-" for i, m in enumerate(metas)]
    rows = {name: [i for i, g in enumerate(groups) if g == name][:per_row] for name in list(dict.fromkeys(groups))[:6]}
    fig = Figure(figsize=(per_row * 1.6, len(rows) * 1.9), layout="tight")
    for (name, idx), row in zip(rows.items(), fig.subplots(len(rows), per_row, squeeze=False)):
        row[0].text(-0.1, 0.5, name, transform=row[0].transAxes, rotation=90, va="center", ha="right", fontsize=7)
        for ax in row:
            ax.axis("off")
        for i, ax in zip(idx, row):
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            ok, extra = (bool(scores["geneval"][i]), int(scores["extra"][i])) if toy else (None, 0)
            mark = "" if ok is None else ("✓ " if ok else "✗ ") + (f"+{extra} " if extra else "")
            colour = {None: "black", True: "green", False: "red"}[ok]
            ax.set_title(textwrap.fill(mark + metas[i]["prompt"], 24)[:80], fontsize=6, color=colour)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)

def plot_curves(history: list[dict], path: Path, label: str) -> None:
    """A PNG of four panels by iteration: training reward, held-out scores, each step's |advantage|, flat groups."""
    from matplotlib.figure import Figure
    train, evals = [h for h in history if "reward_mean" in h], [h for h in history if "eval_overall" in h]
    its = [h["iteration"] for h in train]
    rewards, window = [h["reward_mean"] for h in train], min(8, len(train))  # 8 prompts an iteration: noisy
    trend = np.convolve(rewards, np.ones(window) / window, "valid").tolist()  # the mean of each `window` iterations
    reward = {label: (its, rewards), f"mean of {window} iterations": (its[window - 1:], trend)}
    scores = {k: ([h["iteration"] for h in evals], [h[k] for h in evals])  # eval_strict and eval_extra: toy only
              for k in ("eval_overall", "eval_strict", "eval_extra") if k in evals[0]}
    steps = sorted({k for h in train for k in h if k.startswith("adv_abs/")}, key=lambda k: int(k[8:]))
    credit = {f"step {k[8:]}": (its, [h.get(k, 0.0) for h in train]) for k in steps}
    flat = {label: (its, [h["zero_std_frac"] for h in train])}
    panels = {"training reward": reward, "held-out score (ODE)": scores, "mean |advantage| of the step": credit,
              "groups of equal rewards (zero_std_frac)": flat}
    fig = Figure(figsize=(4.4 * len(panels), 3.3), layout="tight")
    for ax, (ylabel, lines) in zip(fig.subplots(1, len(panels)), panels.items()):
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", ms=3, label=name)
        ax.set(xlabel="iteration", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)

def per_pair(scores: dict, args: Args) -> dict:
    """An evaluation's per-pair scores for a record: pair numbers, the toy's integer scores or a model's rewards;
    under toy-pref also the proxy's reward and the gold (to 4 digits), which notebook 04 sets against each other."""
    toy, pref = "strict" in scores, args.reward == "toy-pref"
    counts = ("pair", "strict", "geneval", "extra", "missing") if toy else ("pair",)
    floats = ("reward", "gold") if pref else () if toy else ("reward",)
    kept = {k: scores[k].int().tolist() for k in counts}
    return kept | {k: [round(x, 4) for x in scores[k].tolist()] for k in floats}


# ----------------------------------------------------------------------------------------------------
# 12 CLI

def parse_args(argv=None) -> Args:
    """CLI -> Args. --run FOLDER of a started run: its saved flags, overridden by those given."""
    import argparse
    import inspect
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UsageError(message)

    helps = dict(re.findall(r"^    (\w+): .*?  # (.*)$", inspect.getsource(Args), re.M))
    parser = Parser(description="GRPO with credit assignment for flow-matching text-to-image models.",
                    argument_default=argparse.SUPPRESS)  # only the flags given appear in the namespace
    by_type = {"bool": dict(action=argparse.BooleanOptionalAction), "int": dict(type=int), "float": dict(type=float)}
    for f in dataclasses.fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), help=f"{helps[f.name]} (default: {f.default})",
                            **by_type.get(f.type, dict(type=str)))
    given = vars(parser.parse_args(argv))
    saved_file = Path(given.get("run", "")) / "args.json"
    saved = read_args(saved_file) if given.get("run") and saved_file.exists() else Args()
    return dataclasses.replace(saved, **given)

def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        train(args)
    except (UsageError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # under torchrun: a clean exit (gloo may abort without it)
    return 0


if __name__ == "__main__":
    sys.exit(main())
