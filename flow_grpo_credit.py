"""flow_grpo_credit: credit assignment for GRPO on flow-matching text-to-image models, in one file.

Five ways to give credit to the denoising steps of a flow model trained with GRPO, each a short
function next to one shared rollout and one shared GRPO loss, so the methods can be read and diffed
side by side (equations: METHODS.md, cited as "METHODS §n").

    flow_grpo  Flow-GRPO (arXiv 2505.05470)        SDE at every step, one advantage for all steps
    stepwise   Stepwise-Flow-GRPO (arXiv 2603.28718) Tweedie rewards per state, credit = reward gain
    tempflow   TempFlow-GRPO (arXiv 2508.04324)     ODE, one SDE step, ODE; noise-aware weights
    g2rpo      G2RPO (arXiv 2510.01982)             one SDE step from a shared anchor, multi-granularity
    chunk      Chunk-GRPO (arXiv 2510.21583)        chunk-level importance ratios

Contents
    0  Conventions and helpers          6  Rollout (shared)
    1  Args                             7  Credit assignment (one function per method)
    2  Toy world (prompts, renderer,    8  GRPO loss (shared)
       exact GenEval-style scorer)      9  Train loop
    3  Models (toy text-to-image flow)  10 Eval, benchmark, logging, plots
    4  Real models (SD3, FLUX.1) and    11 CLI
       PickScore / CLIP rewards
    5  SDE step and log-prob

Multi-GPU: `torchrun --nproc_per_node N flow_grpo_credit.py ...` (section 9, `Dist` in section 0).
Speed: `--benchmark N` times N iterations per phase, with FLOPs and MFU (section 10).

Conventions
    * t = 1 is noise, t = 0 is data: x_t = (1 - t) x0 + t x1, the model predicts v = x1 - x0,
      Tweedie estimate x0_hat = x_t - t v (METHODS §0.1).
    * A sampling grid t_0 = 1 > t_1 > ... > t_S = 0 comes from diffusers'
      FlowMatchEulerDiscreteScheduler; transition k maps the state at t_k to t_{k+1}.
    * The log-prob of a Gaussian step is a MEAN over the C*H*W dimensions, as in every official code
      (METHODS §0.3). The importance ratio is therefore the D-th root of the true likelihood ratio and
      stays very close to 1, which is why clip ranges are ~1e-4 rather than PPO's 0.2.
    * "sigma" collides: `noise_level` (a or eta) scales the SDE's diffusion coefficient, while `std`
      is the std of one transition x_k -> x_{k+1}. "r" is always a reward; the ratio is `ratio`.

Symbols in shape comments
    B prompts, G images per group (or branches), S steps of a grid, N transitions, C/H/W image.

Deviations from the papers (METHODS.md "Project decisions")
    1. KL is the exact per-step Gaussian KL with the transition std, averaged over dimensions.
    2. Under the `ddim` SDE the first step (t = 1) is deterministic and is not trained.
    3. G2RPO continuations always end exactly at t = 0 (no early-stop Tweedie artefact).
    4. The toy world stands in for SD3.5 + GenEval: a 16x16 shapes world with an exact scorer
       (`--model` trains the real SD3 / FLUX.1 pipelines with the same code).
    5. Every method normalises advantages with the group's population std + 1e-4 (the official codes
       mix global std, torch's unbiased std and 1e-8).
    6. Chunk-GRPO's automatic chunks split the relative-L1 profile's total variation into equal
       shares (v1 chose [2,3,4,7] by eye; v3's recursive rule has no stated stopping size).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

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


def stable_seed(*parts) -> int:
    """A seed from any printable parts that is the same on every machine and Python run."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def generator(device, *parts) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stable_seed(*parts))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Dist:
    """Where this process stands under torchrun (rank 0 of 1 without it)."""

    rank: int = 0
    world: int = 1

    @staticmethod
    def setup(device: torch.device) -> "Dist":
        """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return Dist()
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return Dist(dist.get_rank(), world)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place); the identity in a single process."""
        if self.world > 1:
            torch.distributed.all_reduce(x)
        return x

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) on each rank -> (world*N, ...) in rank order."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts)


def mean_over_dims(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,): the reduction every official code uses for log-probs (METHODS §0.3)."""
    return x.flatten(1).mean(1)


# ----------------------------------------------------------------------------------------------------
# 1 Args

METHOD_NAMES = ("flow_grpo", "stepwise", "tempflow", "g2rpo", "chunk")
SDE_KINDS = ("flow", "ddim")


@dataclass
class Args:
    """Every tunable number of a run. Each field's docstring is its --help text."""

    method: str = "flow_grpo"
    """credit-assignment method: flow_grpo, stepwise, tempflow, g2rpo, chunk, or all (compare them)"""
    model: str = "toy"
    """'toy' (the embedded shapes world), or a diffusers folder / hub id of SD3, SD3.5 or FLUX.1"""
    reward: str = "auto"
    """toy, pickscore, clip, or a weighted sum such as pickscore:0.7,clip:0.3 (auto: toy on the toy model, else pickscore)"""
    reward_model: str = ""
    """CLIP model of the pickscore/clip reward, path or hub id (default: the standard hub ids); name=path,name=path for a sum"""
    reward_processor: str = ""
    """CLIPProcessor of the reward model (default: PickScore's is laion/CLIP-ViT-H-14-laion2B-s32B-b79K, else the model's)"""
    prompts: str = ""
    """a text file, one prompt a line; every 10th line is held out for evaluation (default: the toy prompts)"""
    resolution: int = 512
    """image size of a real model (the toy world is 16 px)"""
    dtype: str = "auto"
    """fp32 or bf16 weights of a real model (auto: bf16 on CUDA, fp32 on the CPU); the SDE math stays fp32"""
    low_memory: bool = False
    """real models, the 24 GB recipe: gradient checkpointing, text encoders on the CPU between encodings, VAE decoding in slices"""
    iterations: int = 0
    """GRPO iterations (sample, score, update); 0: the method's default, about 10 minutes of the toy world on 2 CPU cores"""
    prompts_per_iter: int = 8
    """prompts sampled per iteration"""
    group_size: int = 8
    """images (or branches) that share one advantage normalisation"""
    steps: int = 10
    """sampling steps during training (Flow-GRPO's denoising reduction: fewer than eval)"""
    eval_steps: int = 20
    """ODE steps of the deterministic evaluation"""
    eval_every: int = 8
    """evaluate every N iterations (and at the start and end)"""
    eval_per_tag: int = 32
    """held-out evaluation prompts per GenEval category"""
    out: str = "runs"
    """folder that receives one sub-folder per run"""
    seed: int = 0
    """seed of the whole run (prompts, noise, LoRA init)"""
    device: str = "auto"
    """auto, cpu or cuda"""
    cache_dir: str = ""
    """where the pretrained toy model is cached (default: $XDG_CACHE_HOME/flow_grpo_credit)"""

    # GRPO and optimisation (METHODS §0.4, §1.6)
    lr: float = 1e-3
    """AdamW learning rate of the LoRA parameters"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    ema: float = 0.9
    """decay of the moving average of the adapter weights (updated once per iteration) that is evaluated and saved, as Flow-GRPO does (0.9); 0: the latest weights"""
    inner_updates: int = 8
    """optimizer steps per iteration (the samples are split into this many minibatches)"""
    train_fraction: float = 1.0
    """fraction of the sampled transitions (chunks) trained on, drawn at random (DanceGRPO's timestep fraction)"""
    clip_range: float = 1e-3
    """PPO clip epsilon; small because the log-prob is a mean over dimensions"""
    adv_clip: float = 5.0
    """advantages are clamped to [-adv_clip, adv_clip]"""
    beta: float = 0.0
    """weight of the per-step Gaussian KL to the reference (LoRA disabled); 0 skips the reference pass (README, Results)"""
    guidance: float = 0.0
    """guidance scale: real CFG on toy and SD3 (1 = no negative branch), distilled on FLUX (0: toy 1, SD3 4.5, FLUX 3.5)"""
    lora_rank: int = 0
    """LoRA rank (0: toy 16, real models 32 as Flow-GRPO)"""
    lora_alpha: float = 0.0
    """LoRA alpha, scale = alpha / rank (0: toy 16, real models 64 as Flow-GRPO)"""

    # SDE (METHODS §1.2, §4.1)
    sde: str = "flow"
    """SDE kind of stochastic steps: flow (Flow-GRPO) or ddim (Stepwise's DDIM-inspired SDE)"""
    noise_level: float = 1.0
    """a in sigma_t = a*sqrt(t/(1-t)) of the flow SDE (Flow-GRPO: 0.7; 1.0 explores more, README, Results)"""
    ddim_eta: float = 1.0
    """eta in sigma_k = eta*t_{k+1}*sqrt(1-t_k) of the ddim SDE"""

    # method-specific
    tweedie_substeps: int = 5
    """stepwise: ODE sub-steps from each state to t=0 for its intermediate reward; the first reuses the sampler's velocity (1 = plain Tweedie, no extra pass)"""
    seeds: int = 2
    """tempflow: initial noises per prompt; each seed and bifurcation step holds group_size branches"""
    branch_steps: int = 3
    """tempflow/g2rpo: branch points used per iteration, drawn at random (0 = all of the method's)"""
    granularities: str = "1,2,3"
    """g2rpo: continuation granularities Lambda (every lambda-th grid node after the SDE step)"""
    chunks: str = "auto"
    """chunk: chunk sizes over the trained steps, e.g. 2,3,4 (auto = from the relative-L1 profile)"""
    num_chunks: int = 4
    """chunk: number of chunks found by the automatic (auto) segmentation"""
    weighted_chunks: bool = False
    """chunk: draw trained chunks with probability proportional to their mean relative L1"""
    chunk_fraction: float = 1.0
    """chunk: fraction of chunks trained per trajectory"""

    # toy world pretraining
    pretrain_steps: int = 560
    """toy: pretraining steps of the base model (cached afterwards)"""
    pretrain_batch: int = 64
    """toy: pretraining batch size"""
    pretrain_lr: float = 2e-3
    """toy: pretraining learning rate"""
    pretrain_detailed: float = 0.5
    """toy: fraction of pretraining captions that name the colours a GenEval prompt leaves free (without them the base model ignores colour words, README)"""

    # reliability
    checkpoint_every: int = 10
    """write checkpoint.pt every N iterations (and at the end); --resume RUN_DIR continues from it"""
    max_nonfinite: int = 3
    """stop after this many iterations in a row with non-finite rewards, advantages or loss"""
    compare_seeds: str = "0"
    """with --method all (or a list a,b): the seeds every method runs with, e.g. 0,1,2"""
    jobs: int = 1
    """with several runs: how many run at once, in processes sharing the CPU threads equally (each run's wall-clock then counts the sharing)"""
    benchmark: int = 0
    """time N iterations (after one that counts FLOPs) and print seconds per phase, images/s, peak memory and MFU; writes nothing"""
    peak_tflops: float = 0.0
    """bf16 peak of the accelerator for --benchmark's MFU (0: known for H100, H200, A100)"""

    @property
    def sde_level(self) -> float:
        """The noise parameter of the chosen SDE kind: a of the flow SDE, eta of the ddim SDE."""
        return self.noise_level if self.sde == "flow" else self.ddim_eta


# ----------------------------------------------------------------------------------------------------
# 2 Toy world: GenEval-style prompts, a renderer and an exact scorer
#
# Prompts follow GenEval's metadata schema: {"tag", "include": [{"class", "count", "color"?,
# "position"?: [relation, index]}], "exclude"?: [...], "prompt"}. Classes are shapes, colours come
# from a four-colour palette, images are RES x RES RGB in [0, 1] on a black background.

RES = 16
SHAPE_SIZE = 5
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
CLASSES = ("circle", "square", "triangle")
COLORS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
RELATIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {2: "two", 3: "three"}
_MASK_ROWS = {  # 5x5 binary masks; the scorer tells them apart by fill ratio and top/bottom mass
    "square": ["#####"] * 5,
    "circle": [".###.", "#####", "#####", "#####", ".###."],
    "triangle": ["..#..", ".###.", ".###.", "#####", "#####"],
}
SHAPE_MASKS = {k: np.array([[c == "#" for c in row] for row in rows]) for k, rows in _MASK_ROWS.items()}
VOCAB = ["[PAD]", "[UNK]", "a", "and", "of", *NUMBER_WORDS.values(), *COLORS, *CLASSES,
         *(c + "s" for c in CLASSES), "left", "right", "above", "below"]
MAX_TOKENS = 8


def make_prompt(tag: str, rng: random.Random, name_colours: bool = False) -> dict:
    """One random prompt of a GenEval category, as GenEval metadata. `name_colours` also names the
    colours where the category leaves them free (single object, two objects, position), as a
    detailed caption would; pretraining captions do so at random (`--pretrain-detailed`)."""
    a, b = rng.sample(CLASSES, 2)
    ca, cb = rng.sample(list(COLORS), 2)
    coloured = name_colours or tag in ("colors", "color_attr")
    obj_a, obj_b = ({"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}) if coloured else \
        ({"class": a, "count": 1}, {"class": b, "count": 1})
    word_a, word_b = (f"{ca} {a}", f"{cb} {b}") if coloured else (a, b)
    if tag in ("single_object", "colors"):
        return {"tag": tag, "include": [obj_a], "prompt": f"a {word_a}"}
    if tag in ("two_object", "color_attr"):
        return {"tag": tag, "include": [obj_a, obj_b], "prompt": f"a {word_a} and a {word_b}"}
    if tag == "counting":
        n = rng.choice(list(NUMBER_WORDS))
        return {"tag": tag, "include": [{"class": a, "count": n}], "exclude": [{"class": a, "count": n + 1}],
                "prompt": f"{NUMBER_WORDS[n]} {a}s"}
    if tag == "position":  # "a A right of a B": B is include[0], A must stand right of it
        rel = rng.choice(RELATIONS)
        return {"tag": tag, "include": [obj_b, {**obj_a, "position": [rel, 0]}], "prompt": f"a {word_a} {rel} a {word_b}"}
    raise ValueError(f"unknown tag {tag!r}")


def eval_prompts(per_tag: int, seed: int = 1234) -> list[dict]:
    """The fixed evaluation set: `per_tag` prompts of each category, each with its own noise seed."""
    rng = random.Random(seed)
    return [make_prompt(tag, rng) for tag in TAGS for _ in range(per_tag)]


def train_prompts(n: int, rng: random.Random, detailed: float = 0.0) -> list[dict]:
    """Training prompts: categories uniformly, then a random prompt of the category; a `detailed`
    fraction of them name every colour (`make_prompt`'s name_colours)."""
    return [make_prompt(rng.choice(TAGS), rng, name_colours=detailed > 0 and rng.random() < detailed) for _ in range(n)]


def relations(a: tuple, b: tuple) -> set:
    """GenEval's relative-position rule between object centres a and b ((x, y), size each)."""
    (ax, ay), (bx, by) = a[0], b[0]
    offset = np.array([ax - bx, ay - by], dtype=float)
    dims = 0.1 * (np.array(a[1], dtype=float) + np.array(b[1], dtype=float))
    revised = np.maximum(np.abs(offset) - dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    out |= {"left of"} if dx < -0.5 else set()
    out |= {"right of"} if dx > 0.5 else set()
    out |= {"above"} if dy < -0.5 else set()
    out |= {"below"} if dy > 0.5 else set()
    return out


def render(meta: dict, rng: random.Random) -> np.ndarray:
    """A ground-truth image (RES, RES, 3) in [0, 1] that satisfies the prompt; free attributes are random."""
    objects = []  # (class, color)
    for item in meta["include"]:
        objects += [(item["class"], item.get("color") or rng.choice(list(COLORS)))] * item["count"]
    for _ in range(1000):  # rejection sampling of non-touching placements that satisfy the relation
        corners = [(rng.randrange(RES - SHAPE_SIZE + 1), rng.randrange(RES - SHAPE_SIZE + 1)) for _ in objects]
        if any(abs(p[0] - q[0]) <= SHAPE_SIZE and abs(p[1] - q[1]) <= SHAPE_SIZE
               for i, p in enumerate(corners) for q in corners[:i]):
            continue
        centres = [((x + SHAPE_SIZE / 2, y + SHAPE_SIZE / 2), (SHAPE_SIZE, SHAPE_SIZE)) for x, y in corners]
        if all(item.get("position") is None or item["position"][0] in relations(centres[i], centres[item["position"][1]])
               for i, item in enumerate(meta["include"])):
            break
    img = np.zeros((RES, RES, 3), dtype=np.float32)
    for (cls, color), (x, y) in zip(objects, corners):
        img[y:y + SHAPE_SIZE, x:x + SHAPE_SIZE][SHAPE_MASKS[cls]] = COLORS[color]
    return img


@dataclass
class Detection:
    cls: str | None  # None: a blob that is no known shape
    color: str
    centre: tuple
    size: tuple


def detect(img: np.ndarray, min_area: int = 6) -> list[Detection]:
    """The toy 'object detector': nearest palette colour per pixel, 4-connected components, shape rule.

    Exact on rendered images: a square fills its box, a circle misses its corners (fill 21/25), a
    triangle holds most of its mass in the lower half."""
    palette = np.array([(0.0, 0.0, 0.0), *COLORS.values()])  # (5, 3), black background first
    nearest = ((img[:, :, None, :] - palette) ** 2).sum(-1).argmin(-1)  # (RES, RES)
    found, seen = [], np.zeros_like(nearest, dtype=bool)
    for y0, x0 in zip(*np.nonzero(nearest)):
        if seen[y0, x0]:
            continue
        colour, stack, pixels = nearest[y0, x0], [(y0, x0)], []
        seen[y0, x0] = True
        while stack:  # flood fill
            y, x = stack.pop()
            pixels.append((y, x))
            for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= yy < RES and 0 <= xx < RES and not seen[yy, xx] and nearest[yy, xx] == colour:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        if len(pixels) < min_area:
            continue
        ys, xs = np.array(pixels).T
        h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
        top = (ys < ys.min() + h // 2).sum()
        bottom = (ys >= ys.max() + 1 - h // 2).sum()
        fill = len(pixels) / (h * w)
        if not (3 <= h <= 7 and 3 <= w <= 7):
            cls = None
        elif top < 0.7 * bottom:
            cls = "triangle"
        else:
            cls = "square" if fill >= 0.92 else "circle"
        centre = (float(xs.min() + xs.max() + 1) / 2, float(ys.min() + ys.max() + 1) / 2)  # box centre, as GenEval
        found.append(Detection(cls, list(COLORS)[colour - 1], centre, (int(w), int(h))))
    return found


def score_image(img: np.ndarray, meta: dict) -> tuple[float, float]:
    """GenEval's verdict (0/1) and a dense partial score in [0, 1] (the default RL reward).

    Verdict, as GenEval: each include item needs >= count objects of its class (and colour, and
    position relative to include[index]); each exclude item needs < count objects of its class.
    Dense: per include item, half credit for objects of the class and half for the right colour (each
    min(n, count)/count), scaled down for too many objects where an exclude applies; a position item
    counts half for its objects and half for the relation. The mean over items is the score."""
    dets = detect(img)
    by_class = {c: [d for d in dets if d.cls == c] for c in CLASSES}
    ok, parts = True, []
    for item in meta["include"]:
        n = item["count"]
        of_class = by_class[item["class"]]
        matching = [d for d in of_class if item.get("color") in (None, d.color)]
        ok &= len(matching) >= n
        part = 0.5 * min(len(of_class), n) / n + 0.5 * min(len(matching), n) / n
        if item.get("position"):
            rel, ref = item["position"]
            anchors = [d for d in by_class[meta["include"][ref]["class"]]]
            related = any(rel in relations((d.centre, d.size), (a.centre, a.size)) for d in matching for a in anchors)
            ok &= related
            part = 0.5 * part + 0.5 * related
        parts.append(part)
    for item in meta.get("exclude", []):
        n_found = len(by_class[item["class"]])
        ok &= n_found < item["count"]
        if n_found >= item["count"]:  # too many: shrink the matching include item's credit
            parts = [p * (item["count"] - 1) / n_found for p in parts]
    return float(ok), float(np.mean(parts))


def score_batch(images: torch.Tensor, metas: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, RES, RES) images in [0, 1] -> verdicts (N,), dense scores (N,)."""
    arr = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    scores = [score_image(img, meta) for img, meta in zip(arr, metas)]
    verdict, dense = torch.tensor(scores, dtype=torch.float32).T
    return verdict, dense


def render_batch(metas: list[dict], rng: random.Random) -> torch.Tensor:
    """Ground-truth images for prompts: (N, 3, RES, RES) in [0, 1]."""
    return torch.from_numpy(np.stack([render(m, rng) for m in metas])).permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------------------------------
# 3 Models
#
# A policy is anything with `net` (the trainable denoiser that carries the LoRA adapter),
# `encode(prompts) -> cond` (a dict of batch-first tensors), `velocity(x, t, cond)`, `decode` and
# `save_lora`. The toy policy is a tiny diffusers UNet2DConditionModel in pixel space with a tiny
# transformers CLIP text encoder and a word-level tokenizer over the toy grammar.


def build_tokenizer():
    """A word-level transformers tokenizer over the toy vocabulary (no files needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                   model_max_length=MAX_TOKENS)


def build_toy_modules(seed: int):
    """Fresh (untrained) toy UNet and text encoder; 1.7M + 0.1M parameters."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_TOKENS, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    unet = UNet2DConditionModel(
        sample_size=RES, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16)
    return unet, text_encoder


class ToyPolicy:
    """Toy text-to-image flow model: pixels in [-1, 1] are the 'latents', decode is an affine map."""

    lora_defaults = (16, 16.0)  # (rank, alpha)
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                    "conv1", "conv2"]  # attention, feed-forward and the resnets' convolutions

    def __init__(self, unet, text_encoder, tokenizer, guidance: float = 0.0):
        self.net, self.text_encoder, self.tokenizer = unet, text_encoder, tokenizer
        self.guidance = guidance or 1.0
        self.passes = 2 if self.guidance != 1.0 else 1  # forward passes per denoising step (CFG: 2)
        self.text_encoder.requires_grad_(False)

    @property
    def device(self):
        return next(self.net.parameters()).device

    def to(self, device):
        self.net.to(device)
        self.text_encoder.to(device)
        return self

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        ids = self.tokenizer(prompts, padding="max_length", max_length=MAX_TOKENS, truncation=True,
                             return_tensors="pt").input_ids.to(self.device)
        return {"encoder_hidden_states": self.text_encoder(ids).last_hidden_state}  # (B, L, 64)

    def latent_shape(self, n: int) -> tuple:
        return (n, 3, RES, RES)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() + 1) / 2).clamp(0, 1)  # (N, 3, RES, RES) in [0, 1]

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v(x_t, t, c) with classifier-free guidance; t (N,) in [0, 1]. The unconditional branch is
        computed without gradient (Flow-GRPO detaches it too)."""
        v = self.net(x, t * 1000, **cond).sample
        if self.guidance == 1.0:
            return v
        with torch.no_grad():
            v_uncond = self.net(x, t * 1000, **self.uncond(len(x))).sample
        return v_uncond + self.guidance * (v - v_uncond)

    def uncond(self, n: int) -> dict:
        if not hasattr(self, "_uncond"):
            self._uncond = self.encode([""])
        return {k: v.expand(n, *v.shape[1:]) for k, v in self._uncond.items()}

    def time_grid(self, steps: int) -> torch.Tensor:
        return time_grid(steps)

    def save_lora(self, folder: Path) -> None:
        """The adapter in diffusers' LoRA format, which `unet.load_lora_adapter` reads. Keys stay in peft
        format: diffusers' old-format conversion renames only the attention layers and would leave the
        conv LoRA keys as they are, a mix its own loader then rejects."""
        from diffusers.loaders import StableDiffusionLoraLoaderMixin  # the pipeline's saver, without importing pipelines

        StableDiffusionLoraLoaderMixin.save_lora_weights(folder, unet_lora_layers=lora_layers(self.net))


def toy_cache_dir(args: Args) -> Path:
    root = Path(args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flow_grpo_credit")
    recipe = f"res{RES}-steps{args.pretrain_steps}-b{args.pretrain_batch}-lr{args.pretrain_lr}-d{args.pretrain_detailed}-v2"
    return root / f"toy-{recipe}"


def pretrain_toy(args: Args, device) -> ToyPolicy:
    """Rectified-flow pretraining on rendered shapes: loss |v_theta(x_t, t, c) - (x1 - x0)|^2 with
    logit-normal t (as SD3), 10% empty captions so classifier-free guidance works, EMA 0.99 weights,
    and detailed captions (`pretrain_detailed`) so the model learns what colour words mean.
    Seeded, so the same recipe gives the same weights; the result is cached on disk."""
    unet, text_encoder = build_toy_modules(seed=0)
    unet.to(device).train()
    text_encoder.to(device).train()
    tokenizer = build_tokenizer()
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.pretrain_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50))
    average = WeightAverage(params, decay=0.99)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for _ in tqdm(range(args.pretrain_steps), desc="pretraining toy model", leave=False):
        metas = train_prompts(args.pretrain_batch, rng, args.pretrain_detailed)
        x0 = render_batch(metas, rng) * 2 - 1  # (B, 3, RES, RES) in [-1, 1]
        captions = [m["prompt"] if rng.random() > 0.1 else "" for m in metas]
        x1 = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(len(x0), generator=gen))  # logit-normal(0, 1)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * x1
        ids = tokenizer(captions, padding="max_length", max_length=MAX_TOKENS, return_tensors="pt").input_ids
        v = unet(xt.to(device), t.to(device) * 1000, text_encoder(ids.to(device)).last_hidden_state).sample
        loss = F.mse_loss(v, (x1 - x0).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        average.update()
    average.copy_to_model()
    return ToyPolicy(unet.eval(), text_encoder.eval(), tokenizer, args.guidance)


def load_toy(args: Args, device) -> ToyPolicy:
    """The pretrained toy model from the cache, pretraining it first if absent."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = toy_cache_dir(args)
    if not (folder / "done").exists():
        start = time.time()
        policy = pretrain_toy(args, device)
        print(f"pretrained the toy model in {time.time() - start:.0f} s; cached in {folder}")
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        policy.net.save_pretrained(tmp / "unet")
        policy.text_encoder.save_pretrained(tmp / "text_encoder")
        policy.tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "done").write_text("ok\n")
        if not folder.exists():  # another process may have finished first; its copy is as good
            tmp.replace(folder)
        # fall through and load what was saved, so every run starts from bit-identical weights
    from transformers import PreTrainedTokenizerFast
    unet = UNet2DConditionModel.from_pretrained(folder / "unet").to(device).eval()
    text_encoder = CLIPTextModel.from_pretrained(folder / "text_encoder").to(device).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    return ToyPolicy(unet, text_encoder, tokenizer, args.guidance)


# ----------------------------------------------------------------------------------------------------
# 4 Real models (SD3 / SD3.5, FLUX.1) and CLIP-family rewards
#
# The same policy interface over a diffusers pipeline: the latents are the VAE's (packed 2x2 for
# FLUX), the denoiser is the pipeline's transformer, the time grid is its scheduler's (shifted sigmas).

REAL_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
CLIP_DEFAULTS = {"pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
                 "clip": ("openai/clip-vit-large-patch14", "")}


class PipelinePolicy:
    """SD3 / SD3.5 (real CFG with a negative branch) or FLUX.1 (guidance-distilled: the scale is an
    input of the transformer, one forward pass a step) as a policy."""

    lora_defaults = (32, 64.0)  # Flow-GRPO's r and alpha on SD3.5
    lora_targets = REAL_LORA_TARGETS  # the transformer's attention projections (joint blocks included)

    def __init__(self, pipe, args: Args, device):
        from diffusers import FluxPipeline

        self.pipe, self.net, self.size, self.low_memory = pipe, pipe.transformer, args.resolution, args.low_memory
        self.flux = isinstance(pipe, FluxPipeline)
        self.guidance = args.guidance or (3.5 if self.flux else 4.5)
        self.passes = 2 if self.guidance != 1.0 and not self.flux else 1
        self.dtype = self.net.dtype
        self.cache = {}  # prompt -> its embeddings: each prompt is encoded once
        self.net.to(device).requires_grad_(False)
        pipe.vae.to(device).requires_grad_(False)
        if args.low_memory:
            self.net.enable_gradient_checkpointing()
        self.encoders = [getattr(pipe, n) for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if getattr(pipe, n, None)]
        for enc in self.encoders:
            enc.to("cpu" if args.low_memory else device).requires_grad_(False)

    @property
    def device(self):
        return self.net.device

    def latent_shape(self, n: int) -> tuple:
        c, h = self.net.config.in_channels, self.size // self.pipe.vae_scale_factor
        return (n, (h // 2) ** 2, c) if self.flux else (n, c, h, h)  # FLUX: 2x2 patches packed into tokens

    def time_grid(self, steps: int) -> torch.Tensor:
        """(steps + 1,) sigmas as the pipeline sets them: SD3's static shift, FLUX's resolution-dependent one."""
        import copy

        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        scheduler, cfg = copy.deepcopy(self.pipe.scheduler), self.pipe.scheduler.config
        if cfg.get("use_dynamic_shifting"):
            mu = calculate_shift(self.latent_shape(1)[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                 cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        else:
            scheduler.set_timesteps(steps)
        return scheduler.sigmas.float().cpu()

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """Embeddings of each prompt, computed once and kept (with --low-memory the text encoders
        visit the device only for this)."""
        new = [p for p in dict.fromkeys(prompts) if p not in self.cache]
        if new:
            dev = self.device
            for enc in self.encoders:
                enc.to(dev)
            if self.flux:  # no negative branch
                emb, pooled, _ = self.pipe.encode_prompt(new, new, device=dev, max_sequence_length=512)
            else:  # the negative prompt "" is kept under the key "" for the CFG branch
                emb, neg, pooled, neg_pooled = self.pipe.encode_prompt(new, new, new, device=dev,
                                                                       do_classifier_free_guidance=True)
                self.cache.setdefault("", {"encoder_hidden_states": neg[0], "pooled_projections": neg_pooled[0]})
            for i, p in enumerate(new):
                self.cache[p] = {"encoder_hidden_states": emb[i], "pooled_projections": pooled[i]}
            for enc in self.encoders:
                enc.to("cpu" if self.low_memory else dev)
        return {k: torch.stack([self.cache[p][k] for p in prompts]) for k in self.cache[prompts[0]]}

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        kw = {"hidden_states": x.to(self.dtype), "return_dict": False,
              **{k: v.to(self.dtype) for k, v in cond.items()}}
        if self.flux:  # FLUX takes t in [0, 1], positions of text and image tokens, and the guidance scale
            h = self.size // self.pipe.vae_scale_factor // 2
            kw |= {"timestep": t.to(self.dtype), "txt_ids": torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=x.device),
                   "img_ids": self.pipe._prepare_latent_image_ids(1, h, h, x.device, self.dtype)}
            if self.net.config.guidance_embeds:
                kw["guidance"] = torch.full((len(x),), self.guidance, device=x.device, dtype=self.dtype)
        else:
            kw["timestep"] = t * 1000
        return self.net(**kw)[0].float()

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v(x_t, t, c); on SD3 with CFG, the unconditional branch without gradient (as the toy)."""
        v = self.forward(x, t, cond)
        if self.flux or self.guidance == 1.0:
            return v
        with torch.no_grad():
            v_uncond = self.forward(x, t, {k: torch.stack([u] * len(x)) for k, u in self.cache[""].items()})
        return v_uncond + self.guidance * (v - v_uncond)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents -> images (N, 3, H, W) in [0, 1]; the VAE decodes 4 at a time with --low-memory."""
        vae = self.pipe.vae
        if self.flux:
            x = self.pipe._unpack_latents(x, self.size, self.size, self.pipe.vae_scale_factor)
        x = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        parts = x.split(4 if self.low_memory else len(x))
        return torch.cat([vae.decode(p.to(vae.dtype)).sample.float() for p in parts]).add(1).div(2).clamp(0, 1)

    def save_lora(self, folder: Path) -> None:
        """`pytorch_lora_weights.safetensors` in diffusers' format, which `pipe.load_lora_weights` reads."""
        type(self.pipe).save_lora_weights(folder, transformer_lora_layers=lora_layers(self.net))


def lora_layers(net) -> dict:
    """The adapter's weights with the scale alpha/r folded into lora_B: loaders that do not read alpha
    from the file (they assume alpha = r) then reproduce the trained model exactly."""
    from peft.utils import get_peft_model_state_dict

    config = net.peft_config["default"]
    scale = config.lora_alpha / config.r
    return {k: v * scale if "lora_B" in k else v for k, v in get_peft_model_state_dict(net).items()}


def weight_dtype(args: Args, device) -> torch.dtype:
    """--dtype: bf16 or fp32 weights of a real model (auto: bf16 on CUDA, fp32 on the CPU)."""
    return torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") else torch.float32


def load_pipeline(args: Args, device) -> PipelinePolicy:
    """A diffusers SD3 / SD3.5 / FLUX.1 pipeline from a folder or hub id (offline caches work)."""
    from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusion3Pipeline

    if Path(args.model).exists() and not (Path(args.model) / "model_index.json").exists():
        raise UsageError(f"--model {args.model}: no model_index.json there; a diffusers pipeline folder is expected")
    dtype = weight_dtype(args, device)
    try:
        with warnings.catch_warnings():  # newer diffusers call it `dtype`; `torch_dtype` works in every version
            warnings.simplefilter("ignore", FutureWarning)
            pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {args.model!r}: not a diffusers folder or reachable hub id "
                         f"({str(e).splitlines()[0][:160]})") from None
    if not isinstance(pipe, (StableDiffusion3Pipeline, FluxPipeline)):
        raise UsageError(f"--model {args.model!r} is a {type(pipe).__name__}; expected a StableDiffusion3Pipeline or FluxPipeline")
    return PipelinePolicy(pipe, args, device)


# SD3.5-Medium's transformer and VAE (stabilityai/stable-diffusion-3.5-medium) and PickScore's CLIP ViT-H/14,
# for benchmarks with random weights on machines that cannot download: speed and memory do not depend
# on the weights' values.
RANDOM_SD35M = "random-sd3.5-medium"
SD35_MEDIUM = {"transformer": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
               "vae": dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                           norm_num_groups=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                           use_post_quant_conv=False),
               "clip_widths": (768, 1280), "shift": 3.0}
PICKSCORE_ARCH = {"text_config": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                  "vision_config": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                        num_attention_heads=16, patch_size=14, image_size=224),
                  "projection_dim": 1024}


def prompt_tokenizer(length: int = 77):
    """The toy word-level tokenizer, padded to CLIP's 77 tokens: enough for random text encoders."""
    tok = build_tokenizer()
    tok.model_max_length = length
    return tok


def random_sd35_medium(args: Args, device) -> PipelinePolicy:
    """StableDiffusion3Pipeline with SD3.5-Medium's transformer and VAE (random weights). The two CLIP
    text encoders are one-layer random models of the real widths and T5 is left out (the pipeline then
    feeds zeros of T5's shape, 256 x 4096): text encoders run once per prompt, outside an iteration."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(0)
    dtype = weight_dtype(args, device)
    tok = prompt_tokenizer()
    clips = [CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=len(tok), hidden_size=w, projection_dim=w, num_hidden_layers=1,
                                                        num_attention_heads=8, intermediate_size=w, bos_token_id=0, eos_token_id=1))
             for w in SD35_MEDIUM["clip_widths"]]
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()  # quiet about casting freshly built modules to bf16
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**SD35_MEDIUM["transformer"]).to(device, dtype),
        vae=AutoencoderKL(**SD35_MEDIUM["vae"]).to(device, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SD35_MEDIUM["shift"]), text_encoder=clips[0], tokenizer=tok,
        text_encoder_2=clips[1], tokenizer_2=tok, text_encoder_3=None, tokenizer_3=None)
    diffusers.utils.logging.set_verbosity(verbosity)
    return PipelinePolicy(pipe, args, device)


def load_policy(args: Args, device):
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()  # loading bars of tiny files are noise on stderr
    transformers.utils.logging.disable_progress_bar()
    if args.model == RANDOM_SD35M:
        return random_sd35_medium(args, device)
    return load_toy(args, device) if args.model == "toy" else load_pipeline(args, device)


class ClipReward:
    """A CLIP-family reward on the device, batched, from decoded image tensors (no PNG round trip):

    pickscore: s = exp(logit_scale) * cos(E_img, E_txt) (Kirstain et al. 2023), divided by 26 as
               Flow-GRPO does to bring it near [0, 1];
    clip:      CLIPScore = 2.5 * max(cos(E_img, E_txt), 0) (Hessel et al. 2021)."""

    def __init__(self, kind: str, model: str, processor: str, device):
        from transformers import AutoConfig, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

        if model == "random":  # PickScore's architecture with random weights, for benchmarks
            self.kind, self.model = kind, CLIPModel(CLIPConfig(**PICKSCORE_ARCH)).to(device).eval().requires_grad_(False)
            self.processor = SimpleNamespace(image_processor=CLIPImageProcessor(), tokenizer=prompt_tokenizer())
            return
        processor = processor or ("" if model else CLIP_DEFAULTS[kind][1])  # a given model brings its processor
        model = model or CLIP_DEFAULTS[kind][0]
        processor = processor or model
        try:
            model_type = AutoConfig.from_pretrained(model).model_type
        except (OSError, ValueError) as e:
            raise UsageError(f"--reward-model {model!r}: cannot load it ({str(e).splitlines()[0][:160]})") from None
        if model_type != "clip":
            raise UsageError(f"--reward-model {model!r} is a {model_type!r} model; {kind} needs a CLIP model (CLIPModel)")
        self.kind, self.model = kind, CLIPModel.from_pretrained(model).to(device).eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(processor)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, metas: list[dict]) -> torch.Tensor:
        ip = self.processor.image_processor
        crop = ip.crop_size  # an int, a dict or (transformers 5) a SizeDict
        size = crop if isinstance(crop, int) else crop["height"] if isinstance(crop, dict) else crop.height
        pixels = F.interpolate(images.float(), size=(size, size), mode="bicubic", antialias=True)  # square images
        mean, std = (torch.tensor(v, device=images.device).view(1, 3, 1, 1) for v in (ip.image_mean, ip.image_std))
        text = self.processor.tokenizer([m["prompt"] for m in metas], padding=True, truncation=True,
                                        max_length=min(77, self.processor.tokenizer.model_max_length), return_tensors="pt").to(self.model.device)
        out = self.model(pixel_values=((pixels - mean) / std).to(self.model.device), **text)
        if self.kind == "pickscore":
            return out.logits_per_image.diag() / 26
        return 2.5 * (out.image_embeds * out.text_embeds).sum(-1).clamp_min(0)


def parse_reward(spec: str) -> list[tuple[str, float]]:
    """'pickscore:0.7,clip:0.3' -> [('pickscore', 0.7), ('clip', 0.3)]; a bare name weighs 1."""
    terms = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            terms.append((name, float(weight) if weight else 1.0))
        except ValueError:
            raise UsageError(f"--reward {spec!r}: weights must be numbers, as in pickscore:0.7,clip:0.3") from None
        if name not in ("toy", *CLIP_DEFAULTS):
            raise UsageError(f"--reward {spec!r}: unknown reward {name!r}; choose toy, pickscore, clip or a sum like pickscore:0.7,clip:0.3")
    return terms


def reward_spec(args: Args) -> str:
    return args.reward if args.reward != "auto" else "toy" if args.model == "toy" else "pickscore"


def build_reward(args: Args, device):
    """(images (N, 3, H, W) in [0, 1], metas) -> rewards (N,): the weighted sum the --reward spec names."""
    terms = parse_reward(reward_spec(args))
    if [n for n, _ in terms] == ["toy"]:
        return toy_reward
    named = dict(p.split("=", 1) for p in args.reward_model.split(",") if "=" in p)
    fns = {n: toy_reward if n == "toy" else ClipReward(n, named.get(n, "" if named else args.reward_model),
                                                      args.reward_processor if len(terms) == 1 else "", device)
           for n, _ in terms}
    return lambda images, metas: sum(w * fns[n](images, metas) for n, w in terms)


# ----------------------------------------------------------------------------------------------------
# 5 SDE step and log-prob


def _as_column(t, x: torch.Tensor) -> torch.Tensor:
    """A float or (B,) tensor of times -> (B, 1, 1, 1) in float32 on x's device."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    return t.reshape(-1, *([1] * (x.dim() - 1))).expand(x.shape[0], *([1] * (x.dim() - 1)))


def ode_step(x: torch.Tensor, v: torch.Tensor, t, t_next) -> torch.Tensor:
    """Euler step of the probability-flow ODE: x_{k+1} = x_k - (t_k - t_{k+1}) v (METHODS §0.1)."""
    return x + (_as_column(t_next, x) - _as_column(t, x)) * v


def sde_step(x, v, t, t_next, *, kind="flow", noise_level=0.7, noise=None, prev_sample=None, generator=None):
    """One stochastic step x_k -> x_{k+1} ~ N(mean, std^2 I); returns (x_next, log_prob, mean, std).

    kind="flow" (Flow-GRPO, METHODS §1.2, paper Eq. 9): sigma_t = a*sqrt(t/(1-t)), with t_1 in the
        denominator at t = 1 (the official first-step substitution);
        mean = x - dt*[v + sigma_t^2/(2t) * x1_hat],  std = sigma_t*sqrt(dt),  dt = t - t_next.
    kind="ddim" (Stepwise's DDIM-inspired SDE, METHODS §4.1, paper Eq. 8): std = eta*t_next*sqrt(1-t);
        mean = (1-t_next)*x0_hat + sqrt(t_next^2 - std^2)*x1_hat (variance preserving).
    x0_hat = x - t v and x1_hat = x + (1-t) v are the predicted data and noise.

    log_prob (B,) is the Gaussian log-density MEAN over C*H*W (METHODS §0.3); it is 0 where std = 0
    (a deterministic step, never trained). With noise_level 0 both kinds are the Euler ODE step.
    `prev_sample` re-scores a stored transition instead of sampling one; `std` (B,) is the transition std.
    """
    x, v = x.float(), v.float()  # fp32: the mean overflows in bf16 (METHODS §9)
    t_, tn = _as_column(t, x), _as_column(t_next, x)
    x0_hat, x1_hat = x - t_ * v, x + (1 - t_) * v
    if kind == "flow":
        sigma_t = noise_level * torch.sqrt(t_ / (1 - torch.where(t_ >= 1, tn, t_)))
        dt = t_ - tn
        mean = x - dt * (v + sigma_t**2 / (2 * t_) * x1_hat)
        std = sigma_t * torch.sqrt(dt)
    elif kind == "ddim":
        std = noise_level * tn * torch.sqrt(1 - t_)
        mean = (1 - tn) * x0_hat + torch.sqrt((tn**2 - std**2).clamp_min(0)) * x1_hat
    else:
        raise UsageError(f"unknown SDE kind {kind!r}; choose one of {', '.join(SDE_KINDS)}")
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device if generator is None else generator.device)
        prev_sample = mean + std * noise.to(x.device).float()
    prev_sample = prev_sample.detach().float()
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    log_density = -((prev_sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    log_prob = torch.where(std.flatten() > 0, mean_over_dims(log_density), torch.zeros_like(std.flatten()))
    return prev_sample, log_prob, mean, std.flatten()


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s^2) || N(mean_ref, s^2)) per dimension, averaged: mean_d (mu - mu_ref)^2 / (2 s^2),
    (B,). The exact Gaussian KL of one transition over D (METHODS §1.6, §5.4, Project decision 4)."""
    safe = torch.where(std > 0, std, torch.ones_like(std)).reshape(-1, *([1] * (mean.dim() - 1)))
    return mean_over_dims((mean - mean_ref) ** 2 / (2 * safe**2)) * (std > 0)


def time_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """(steps + 1,) times from 1 to 0 as diffusers' FlowMatchEulerDiscreteScheduler sets them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


# ----------------------------------------------------------------------------------------------------
# 6 Rollout (shared by every method)


@dataclass
class Meter:
    """The honest compute counter: per-image model forward passes (a CFG step counts 2) and reward calls."""

    nfe: int = 0
    reward_calls: int = 0

    def forward(self, policy, n: int) -> None:
        self.nfe += n * policy.passes


@dataclass
class Trajectory:
    states: torch.Tensor  # (B, S+1, C, H, W): x at times[:, 0..S]
    times: torch.Tensor  # (B, S+1)
    log_probs: torch.Tensor  # (B, S): log pi_old of each transition (0 for ODE steps)
    stds: torch.Tensor  # (B, S): transition std (0 for ODE steps)
    stochastic: torch.Tensor  # (S,) bool
    velocities: torch.Tensor  # (B, S, C, H, W): v at states[:, k], kept for Stepwise's free Tweedie step


@torch.no_grad()
def rollout(policy, cond: dict, x: torch.Tensor, times: torch.Tensor, stochastic, args: Args, meter: Meter,
            gen: torch.Generator | None = None) -> Trajectory:
    """Integrate from x (B, C, H, W) along `times` ((S+1,) or (B, S+1), decreasing), taking an SDE step
    where `stochastic` (S,) is true and an Euler ODE step elsewhere. Every method samples through this:
    Flow-GRPO (all SDE), TempFlow and G2RPO branches (start at a stored state, one SDE step, own grid),
    Stepwise's Tweedie refinement (ODE on a per-sample grid)."""
    b = x.shape[0]
    times = (times if times.dim() == 2 else times.expand(b, -1)).to(x.device)
    stochastic = torch.as_tensor(stochastic, dtype=torch.bool)
    states, log_probs, stds, velocities = [x], [], [], []
    for k in range(times.shape[1] - 1):
        t, t_next = times[:, k], times[:, k + 1]
        v = policy.velocity(x, t, cond)
        meter.forward(policy, b)
        velocities.append(v)
        if stochastic[k]:
            x, log_prob, _, std = sde_step(x, v, t, t_next, kind=args.sde,
                                           noise_level=args.sde_level,
                                           generator=gen)
        else:
            x, log_prob, std = ode_step(x, v, t, t_next), torch.zeros(b, device=x.device), torch.zeros(b, device=x.device)
        states.append(x)
        log_probs.append(log_prob)
        stds.append(std)
    return Trajectory(torch.stack(states, 1), times, torch.stack(log_probs, 1), torch.stack(stds, 1), stochastic,
                      torch.stack(velocities, 1))


def initial_noise(policy, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(policy.latent_shape(n), generator=gen, device=gen.device).to(policy.device)

@dataclass
class Transitions:
    """A flat list of N transitions x -> x_next to train on: the one thing every method hands the loss.

    `chunk` ids say which transitions share one importance ratio (Chunk-GRPO); by default every
    transition is its own chunk, which is step-level GRPO. `weight` is TempFlow's step weight (1 elsewhere)."""

    x: torch.Tensor  # (N, C, H, W) state before the step
    x_next: torch.Tensor  # (N, C, H, W) sampled state after the step
    t: torch.Tensor  # (N,) time of x
    t_next: torch.Tensor  # (N,) time of x_next
    log_prob: torch.Tensor  # (N,) log pi_old(x_next | x), recorded while sampling
    std: torch.Tensor  # (N,) transition std
    prompt: torch.Tensor  # (N,) long: index into this iteration's prompts
    advantage: torch.Tensor  # (N,)
    weight: torch.Tensor  # (N,)
    chunk: torch.Tensor  # (N,) long: transitions with the same id share one ratio
    step: torch.Tensor  # (N,) long: index k of the transition on the base grid (for per-step metrics)

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, idx) -> "Transitions":
        return Transitions(**{f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)})

    @staticmethod
    def cat(parts: list["Transitions"]) -> "Transitions":
        offsets = np.cumsum([0] + [int(p.chunk.max()) + 1 if len(p) else 0 for p in parts[:-1]])
        parts = [dataclasses.replace(p, chunk=p.chunk + int(o)) for p, o in zip(parts, offsets)]
        return Transitions(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Transitions)})


def transitions_from(traj: Trajectory, prompt: torch.Tensor, advantage: torch.Tensor, trained, *,
                     weight=None, chunk=None, first_step: int = 0) -> Transitions:
    """Select the trained transitions of a trajectory batch. advantage, weight, chunk: (B, S) or None;
    trained: (S,) bool; first_step: index on the base grid of the trajectory's first transition."""
    b, s = traj.log_probs.shape
    dev = traj.states.device

    def per_step(value, default):  # scalar, (S,), (B, 1) or (B, S) -> (B, S) on the states' device
        return torch.as_tensor(default if value is None else value, device=dev).expand(b, s)

    keep = per_step(trained, True).bool()  # (B, S)
    return Transitions(
        x=traj.states[:, :-1][keep], x_next=traj.states[:, 1:][keep],
        t=traj.times[:, :-1][keep], t_next=traj.times[:, 1:][keep],
        log_prob=traj.log_probs[keep], std=traj.stds[keep],
        prompt=per_step(prompt.to(dev)[:, None], 0)[keep], advantage=per_step(advantage, 0.0)[keep].float(),
        weight=per_step(weight, 1.0)[keep].float(),
        chunk=per_step(chunk, torch.arange(b * s, device=dev).view(b, s))[keep],
        step=per_step(torch.arange(s, device=dev) + first_step, 0)[keep])


@dataclass
class Context:
    """What a credit-assignment function is given: the policy, this iteration's prompts and helpers."""

    policy: object
    args: Args
    meter: Meter
    gen: torch.Generator  # this rank's randomness: SDE noise, independent starting noise
    metas: list  # B prompts as GenEval metadata
    cond: dict  # prompt embeddings, batch-first (B, ...)
    grid: torch.Tensor  # (S+1,) base time grid
    reward_fn: object  # (images (N, 3, H, W) in [0, 1], metas) -> rewards (N,)
    chunk_sizes: list | None = None
    stats: dict = field(default_factory=dict)
    dist: Dist = field(default_factory=Dist)  # under torchrun a group's members are spread over the ranks
    shared_gen: torch.Generator | None = None  # the same on every rank (None: gen); what a group shares

    def __post_init__(self):
        if self.shared_gen is None:
            self.shared_gen = self.gen

    @property
    def group_size(self) -> int:
        """Members of each group sampled on this rank: --group-size, divided by the number of ranks."""
        return self.args.group_size // self.dist.world

    def cond_of(self, prompt: torch.Tensor) -> dict:
        return {k: v[prompt] for k, v in self.cond.items()}

    def noise(self, n: int) -> torch.Tensor:
        """(n, C, H, W) independent starting noise, one per sample of this rank."""
        return initial_noise(self.policy, n, self.gen)

    def shared_noise(self, n: int) -> torch.Tensor:
        """(n, C, H, W) starting noise a group shares: the same on every rank, since its members may be
        sampled on several ranks."""
        return initial_noise(self.policy, n, self.shared_gen)

    def rollout(self, prompt, x, times, stochastic) -> Trajectory:
        return rollout(self.policy, self.cond_of(prompt), x, times, stochastic, self.args, self.meter, self.gen)

    def reward(self, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """Decode and score final latents x (N, C, H, W) of prompts `prompt` (N,) -> (N,)."""
        self.meter.reward_calls += len(x)
        r = self.reward_fn(self.policy.decode(x), [self.metas[i] for i in prompt.tolist()])
        return r.to(x.device).float()

    def advantages(self, r: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """Group-relative advantage (r - mean_g) / (std_g + 1e-4), population std (METHODS §1.5).
        A group whose rewards are all equal gets zero advantages (counted in zero_std_frac).
        Under torchrun the rewards of all ranks are gathered first, so a group spanning ranks is
        normalised as a whole; each rank keeps the advantages of its own samples."""
        local = slice(self.dist.rank * len(r), (self.dist.rank + 1) * len(r))
        r, group = self.dist.gather(r), self.dist.gather(group.to(r.device))  # (ranks*N,) in rank order
        _, inv = torch.unique(group, return_inverse=True)
        n = torch.zeros(int(inv.max()) + 1, device=r.device).index_add_(0, inv, torch.ones_like(r))
        mean = torch.zeros_like(n).index_add_(0, inv, r) / n
        var = torch.zeros_like(n).index_add_(0, inv, (r - mean[inv]) ** 2) / n
        std = var.sqrt()
        self.stats.setdefault("zero_std", []).extend((std < 1e-8).tolist())
        return ((r - mean[inv]) / (std[inv] + 1e-4))[local]

    def trainable(self) -> torch.Tensor:
        return trainable_steps(self.grid, self.args)


def trainable_steps(grid: torch.Tensor, args: Args) -> torch.Tensor:
    """(S,) bool: which transitions of `grid` can be trained: stochastic-capable (std > 0 under the
    chosen SDE) and not the last one (METHODS §1.4)."""
    s = len(grid) - 1
    return (step_stds(grid, args) > 0) & (torch.arange(s) < s - 1)


def step_stds(grid: torch.Tensor, args: Args) -> torch.Tensor:
    """(S,) transition std of an SDE step at each step of `grid` (it does not depend on the state)."""
    level = args.sde_level
    z = torch.zeros(len(grid) - 1, 1)
    return sde_step(z, z, grid[:-1], grid[1:], kind=args.sde, noise_level=level, noise=z)[3]


def repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, ...) -> (B*G, ...): each entry repeated g times, groups contiguous."""
    return x.repeat_interleave(g, dim=0)


# ----------------------------------------------------------------------------------------------------
# 7 Credit assignment: one function per method, same signature, side by side
#
# Each takes the iteration's Context and returns (Transitions to train on, rewards for logging).
# Sampling differences are data for the shared rollout: which steps are stochastic, where a
# trajectory starts, which grid it follows. Nothing below touches the loss or the optimiser.


def flow_grpo(ctx: Context):
    """Flow-GRPO (arXiv 2505.05470; METHODS §1.4-1.6, paper Eqs. 9-10).

    All steps SDE from independent noises; one group-normalised advantage per image,
        A_i = (R_i - mean_group R) / (std_group R + 1e-4),
    broadcast to every trained step (the last step is not trained)."""
    b, g, s = len(ctx.metas), ctx.group_size, len(ctx.grid) - 1
    prompt = repeat(torch.arange(b), g)  # (B*G,)
    traj = ctx.rollout(prompt, ctx.noise(b * g), ctx.grid, [True] * s)
    r = ctx.reward(traj.states[:, -1], prompt)  # (B*G,)
    adv = ctx.advantages(r, prompt)[:, None]  # (B*G, 1) -> every step
    return transitions_from(traj, prompt, adv, ctx.trainable()), r


def stepwise(ctx: Context):
    """Stepwise-Flow-GRPO (arXiv 2603.28718; METHODS §4.2-4.3, paper Eq. 8 for the ddim SDE).

    Shared initial noise per group. Reward of every state k = 0..S through a Tweedie estimate refined
    by `tweedie_substeps` ODE steps to t = 0: r[i, k] = R(x0_hat(x_k)); credit of step k is its gain
        g[i, k] = r[i, k+1] - r[i, k],   A = (g - mean_{i,k} g) / std_{i,k} g   over the prompt's group.
    Differs from flow_grpo by: per-step gains instead of one broadcast advantage; shared noise."""
    b, g, s, n = len(ctx.metas), ctx.group_size, len(ctx.grid) - 1, ctx.args.tweedie_substeps
    prompt = repeat(torch.arange(b), g)  # (B*G,)
    traj = ctx.rollout(prompt, repeat(ctx.shared_noise(b), g), ctx.grid, [True] * s)
    x, v, t = traj.states[:, 1:-1].flatten(0, 1), traj.velocities[:, 1:].flatten(0, 1), traj.times[:, 1:-1].flatten()
    later = tweedie_x0(ctx, repeat(prompt, s - 1), x, v, t, n).view(b * g, s - 1, *x.shape[1:])
    scored = torch.cat([later, traj.states[:, -1:]], 1)  # (B*G, S, C, H, W): x0_hat of k = 1..S-1, final image
    r = ctx.reward(scored.flatten(0, 1), repeat(prompt, s)).view(b * g, s)
    # k = 0 is the group's shared noise, so its estimate (and reward) is a group constant: once per group
    start = tweedie_x0(ctx, torch.arange(b), traj.states[::g, 0], traj.velocities[::g, 0], traj.times[::g, 0], n)
    r = torch.cat([repeat(ctx.reward(start, torch.arange(b)), g)[:, None], r], 1)  # (B*G, S+1)
    adv = gain_advantages(ctx, r, prompt)  # (B*G, S)
    return transitions_from(traj, prompt, adv, ctx.trainable()), r[:, -1]


def tweedie_x0(ctx: Context, prompt, x, v, t, n: int) -> torch.Tensor:
    """x0_hat of states x (N, C, H, W) at times t (N,) by n Euler steps of the ODE to t = 0 on an equal
    sub-grid (METHODS §4.2). The first step uses the velocity v that sampling already computed at x,
    so plain Tweedie (n = 1: x - t v) costs no forward pass, and n sub-steps cost n - 1."""
    times = t[:, None] * torch.linspace(1, 0, n + 1, device=t.device)  # (N, n+1)
    x = ode_step(x, v, times[:, 0], times[:, 1])
    return x if n == 1 else ctx.rollout(prompt, x, times[:, 1:], [False] * (n - 1)).states[:, -1]


def gain_advantages(ctx: Context, r: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """Stepwise's credit (METHODS §4.3): gains g[i, k] = r[i, k+1] - r[i, k] of rewards r (B*G, S+1),
    normalised jointly over all (trajectory, step) of a prompt with the population std -> (B*G, S)."""
    gains = r[:, 1:] - r[:, :-1]  # (B*G, S)
    return ctx.advantages(gains.flatten(), repeat(prompt, gains.shape[1])).view_as(gains)


def tempflow(ctx: Context):
    """TempFlow-GRPO (arXiv 2508.04324; METHODS §5.1-5.3, paper Eq. 8).

    ODE main path per (prompt, seed); at a bifurcation step k, G children take one SDE step from the
    ODE state s_k and finish by ODE; process reward R_k^j; advantage over the G children of one
    (prompt, seed, k); loss weight w_k = std_k / mean_{trained k'} std_k' (mean 1).
    Differs from flow_grpo by: one stochastic step per rollout; per-step rewards; noise-aware weights."""
    b, g, s, seeds = len(ctx.metas), ctx.group_size, len(ctx.grid) - 1, ctx.args.seeds
    prompt = repeat(torch.arange(b), seeds)  # (B*seeds,)
    main = ctx.rollout(prompt, ctx.shared_noise(b * seeds), ctx.grid, [False] * s)
    trainable = ctx.trainable()
    stds = step_stds(ctx.grid, ctx.args)
    weight = stds / stds[trainable].mean()  # (S,) Norm(sigma_t sqrt(dt)) to mean 1 over trained steps
    parts, rewards = [], []
    for k in branch_points(ctx, trainable):
        child_prompt = repeat(prompt, g)  # (B*seeds*G,)
        branch = ctx.rollout(child_prompt, repeat(main.states[:, k], g), ctx.grid[k:], [True] + [False] * (s - k - 1))
        r = ctx.reward(branch.states[:, -1], child_prompt)
        adv = ctx.advantages(r, repeat(torch.arange(b * seeds), g))[:, None]  # per (prompt, seed, k)
        only_first = torch.arange(s - k) == 0
        parts.append(transitions_from(branch, child_prompt, adv, only_first, weight=weight[k], first_step=k))
        rewards.append(r)
    return Transitions.cat(parts), torch.cat(rewards)


def g2rpo(ctx: Context):
    """G2RPO (arXiv 2510.01982; METHODS §6.1-6.3).

    Shared ODE anchor per prompt; for k in the first half of the steps, G branches take one SDE step
    from the anchor state s_k; each branch is finished by ODE at every granularity lambda (every
    lambda-th grid node after t_{k+1}, ending at t = 0) and scored; fused advantage
        A_k^i = sum_lambda (R_k^{i,lambda} - mean_i) / std_i.
    Differs from tempflow by: one anchor per prompt, k over the first half, multi-granularity sum, no weights."""
    b, g, s = len(ctx.metas), ctx.group_size, len(ctx.grid) - 1
    prompt = torch.arange(b)
    anchor = ctx.rollout(prompt, ctx.shared_noise(b), ctx.grid, [False] * s)
    first_half = ctx.trainable() & (torch.arange(s) < s // 2)
    parts, rewards = [], []
    for k in branch_points(ctx, first_half):
        child_prompt = repeat(prompt, g)  # (B*G,)
        sde = ctx.rollout(child_prompt, repeat(anchor.states[:, k], g), ctx.grid[k:k + 2], [True])
        adv = torch.zeros(b * g, device=sde.states.device)  # (B*G,) fused over granularities
        for lam in parse_granularities(ctx.args.granularities):
            coarse = continuation_grid(ctx.grid, k + 1, lam)
            end = ctx.rollout(child_prompt, sde.states[:, -1], coarse, [False] * (len(coarse) - 1))
            r = ctx.reward(end.states[:, -1], child_prompt)
            adv += ctx.advantages(r, child_prompt)
            rewards.append(r)
        parts.append(transitions_from(sde, child_prompt, adv[:, None], [True], first_step=k))
    return Transitions.cat(parts), torch.cat(rewards)


def chunk(ctx: Context):
    """Chunk-GRPO (arXiv 2510.21583; METHODS §7.3-7.5, v1 Eqs. 14-16).

    Sampling and advantage as flow_grpo (shared noise per group, as the paper); the trained steps are
    split into consecutive chunks and each chunk gets one importance ratio
        ratio_j = exp( mean_{k in chunk j} (log pi_theta - log pi_old) ).
    Optionally only a fraction of the chunks is trained, drawn by their mean relative L1.
    Differs from flow_grpo by: chunk ids that make the shared loss use chunk-level ratios."""
    b, g, s = len(ctx.metas), ctx.group_size, len(ctx.grid) - 1
    prompt = repeat(torch.arange(b), g)  # (B*G,)
    traj = ctx.rollout(prompt, repeat(ctx.shared_noise(b), g), ctx.grid, [True] * s)
    r = ctx.reward(traj.states[:, -1], prompt)
    adv = ctx.advantages(r, prompt)[:, None]
    trainable = ctx.trainable()
    sizes = ctx.chunk_sizes
    of_step = torch.full((s,), -1, dtype=torch.long)  # chunk index of each step, -1 = not trained
    of_step[trainable] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    keep = trainable.expand(b * g, s).clone()  # (B*G, S)
    n_train = max(1, int(len(sizes) * ctx.args.chunk_fraction))
    if n_train < len(sizes):
        rel = relative_l1(traj.states).cpu()  # (B*G, S)
        per_chunk = torch.stack([rel[:, of_step == j].mean(1) for j in range(len(sizes))], 1)  # (B*G, K)
        w = per_chunk + 1e-8 if ctx.args.weighted_chunks else torch.ones_like(per_chunk)
        chosen = torch.multinomial(w, n_train, generator=ctx.gen)  # (B*G, n_train)
        picked = torch.zeros_like(per_chunk, dtype=torch.bool).scatter_(1, chosen, True)
        never = torch.zeros(b * g, 1, dtype=torch.bool)  # column K answers of_step = -1 (untrained steps)
        keep &= torch.cat([picked, never], 1)[:, of_step]
    chunk_id = torch.arange(b * g)[:, None] * len(sizes) + of_step.clamp_min(0)  # (B*G, S)
    return transitions_from(traj, prompt, adv, keep, chunk=chunk_id), r


METHODS = {"flow_grpo": flow_grpo, "stepwise": stepwise, "tempflow": tempflow, "g2rpo": g2rpo, "chunk": chunk}
# --iterations 0: each method's default run, about 10 minutes of the toy world on 2 CPU cores, so a
# method that spends more forward passes per iteration (README, Results) runs fewer iterations.
DEFAULT_ITERATIONS = {"flow_grpo": 64, "stepwise": 32, "tempflow": 40, "g2rpo": 32, "chunk": 56}


def branch_points(ctx: Context, allowed: torch.Tensor) -> list[int]:
    """Steps k where TempFlow/G2RPO branch: all allowed ones, or `branch_steps` of them at random."""
    ks = torch.nonzero(allowed).flatten()
    if 0 < ctx.args.branch_steps < len(ks):
        ks = ks[torch.randperm(len(ks), generator=ctx.shared_gen, device=ctx.shared_gen.device)[: ctx.args.branch_steps].cpu()].sort().values
    return ks.tolist()


def continuation_grid(grid: torch.Tensor, start: int, lam: int) -> torch.Tensor:
    """G2RPO's granularity-lambda grid from node `start`: t_start, t_{start+1}, then every lambda-th
    node, always ending at t = 0 (METHODS §6.2; Project decision 8)."""
    idx = list(range(start, start + 2)) + list(range(start + 1 + lam, len(grid), lam))
    idx = [i for i in dict.fromkeys(idx) if i < len(grid)]
    if idx[-1] != len(grid) - 1:
        idx.append(len(grid) - 1)
    return grid[idx]


def relative_l1(states: torch.Tensor) -> torch.Tensor:
    """Chunk-GRPO's temporal dynamics (METHODS §7.4, v1 Eq. 15): |x_{k+1} - x_k|_1 / |x_k|_1, (B, S)."""
    diff = (states[:, 1:] - states[:, :-1]).abs().flatten(2).mean(2)
    return diff / (states[:, :-1].abs().flatten(2).mean(2) + 1e-8)


def chunks_from_profile(profile: torch.Tensor, num_chunks: int) -> list[int]:
    """Chunk sizes from a relative-L1 profile (S,) of the trained steps: boundaries split the profile's
    total variation sum_k |L1rel_{k+1} - L1rel_k| into equal shares, so the steps where the dynamics
    change fastest get the smallest chunks (our automatic reading of Chunk-GRPO v1 §4.3)."""
    n = len(profile)
    num_chunks = min(num_chunks, n)
    change = torch.cat([profile[1:2] - profile[:1], profile[1:] - profile[:-1]]).abs() + 1e-6  # (S,)
    cum = torch.cumsum(change, 0) / change.sum()
    ends = [int(torch.searchsorted(cum, j / num_chunks)) + 1 for j in range(1, num_chunks)]
    ends = [min(max(e, j + 1), n - (num_chunks - 1 - j)) for j, e in enumerate(ends)]  # >= 1 step each
    for j in range(1, len(ends)):
        ends[j] = max(ends[j], ends[j - 1] + 1)
    bounds = [0, *ends, n]
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def parse_granularities(text: str) -> list[int]:
    try:
        lams = [int(p) for p in text.split(",")]
    except ValueError:
        lams = []
    if not lams or min(lams) < 1:
        raise UsageError(f"--granularities must be positive integers like 1,2,3, got {text!r}")
    return lams


def parse_chunks(text: str, n_trained: int) -> list[int] | None:
    """'auto' -> None (computed from the profile); else sizes that must sum to the trained steps."""
    if text == "auto":
        return None
    try:
        sizes = [int(p) for p in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or sum(sizes) != n_trained:
        raise UsageError(f"--chunks must be 'auto' or positive sizes summing to the {n_trained} trained steps, got {text!r}")
    return sizes


# ----------------------------------------------------------------------------------------------------
# 8 GRPO loss (shared)


def segment_mean(values: torch.Tensor, inv: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of `values` (N,) over segments given by `inv` (N,) in [0, n) -> (n,)."""
    total = torch.zeros(n, device=values.device, dtype=values.dtype).index_add(0, inv, values)
    count = torch.zeros(n, device=values.device, dtype=values.dtype).index_add(0, inv, torch.ones_like(values))
    return total / count


def grpo_loss(policy, cond: dict, tr: Transitions, args: Args) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO objective on transitions, as every official code writes it (METHODS §0.4):

        ratio_j = exp(mean_{k in chunk j} log pi_theta(x_{k+1}|x_k) - log pi_old(x_{k+1}|x_k))
        loss    = mean_j w_j * max(-A_j ratio_j, -A_j clip(ratio_j, 1-eps, 1+eps))  + beta * KL

    A chunk of one transition is the step-level ratio of Flow-GRPO; log-probs are means over C*H*W,
    so ratios stay within ~1e-3 of 1 and eps is tiny (METHODS §0.3). KL is to the adapter-disabled
    reference with the transition std (Project decision 4)."""
    level = args.sde_level
    c = {k: v[tr.prompt] for k, v in cond.items()}
    v = policy.velocity(tr.x, tr.t, c)
    _, log_prob, mean, _ = sde_step(tr.x, v, tr.t, tr.t_next, kind=args.sde, noise_level=level, prev_sample=tr.x_next)
    _, inv = torch.unique(tr.chunk, return_inverse=True)
    n = int(inv.max()) + 1
    log_ratio = chunk_log_ratios(log_prob, tr.log_prob, tr.chunk)  # (K,) one ratio per chunk
    ratio = torch.exp(log_ratio)
    adv = segment_mean(tr.advantage, inv, n).clamp(-args.adv_clip, args.adv_clip)
    weight = segment_mean(tr.weight, inv, n)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
    policy_loss = (weight * torch.maximum(unclipped, clipped)).mean()
    kl = torch.zeros((), device=v.device)
    if args.beta > 0:
        with torch.no_grad(), adapter_disabled(policy.net):
            v_ref = policy.velocity(tr.x, tr.t, c)
        _, _, mean_ref, _ = sde_step(tr.x, v_ref, tr.t, tr.t_next, kind=args.sde, noise_level=level, prev_sample=tr.x_next)
        kl = gaussian_kl(mean, mean_ref, tr.std).mean()
    loss = policy_loss + args.beta * kl
    stats = {"policy_loss": policy_loss.item(), "kl": kl.item(), "ratio_mean": ratio.mean().item(),
             "clipfrac": ((ratio - 1).abs() > args.clip_range).float().mean().item(),
             "approx_kl": (0.5 * log_ratio**2).mean().item()}
    return loss, stats


def chunk_log_ratios(log_prob: torch.Tensor, log_prob_old: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Chunk-GRPO's chunk ratio in log space (METHODS §7.3, v1 Eq. 14): the mean of the step
    log-ratios of each chunk, i.e. the geometric mean of its step ratios; (N,) -> (K,) by sorted id."""
    _, inv = torch.unique(chunk, return_inverse=True)
    return segment_mean(log_prob - log_prob_old, inv, int(inv.max()) + 1)


class adapter_disabled:
    """Context manager: the LoRA adapter switched off, i.e. the reference model pi_ref."""

    def __init__(self, net):
        self.net = net

    def __enter__(self):
        self.net.disable_adapters()

    def __exit__(self, *exc):
        self.net.enable_adapters()


def update(policy, opt, cond: dict, tr: Transitions, args: Args, gen: torch.Generator, dist: Dist = Dist()) -> dict:
    """Inner PPO updates: chunks (single transitions unless the method groups them) are shuffled, a
    `train_fraction` of them kept, and split into `inner_updates` minibatches, one AdamW step each
    (after global grad-norm clipping). The first minibatch is exactly on-policy (ratio 1).
    Under torchrun the gradients are averaged over ranks before the step (what DDP does), so every
    rank takes the same step and the weights stay identical."""
    ids = torch.unique(tr.chunk)
    order = ids[torch.randperm(len(ids), generator=gen, device=gen.device).cpu()]
    order = order[: max(1, round(len(order) * args.train_fraction))]  # DanceGRPO's timestep fraction
    params = [p for p in policy.net.parameters() if p.requires_grad]
    stats = []
    policy.net.train()
    for part in torch.tensor_split(order, min(args.inner_updates, len(order))):
        mb = tr[torch.isin(tr.chunk.cpu(), part)]
        loss, s = grpo_loss(policy, cond, mb, args)
        if dist.sum(torch.isfinite(loss).float().cpu()) < dist.world:  # never step from a poisoned loss, on any rank
            return {"skipped": 1}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in params if dist.world > 1 else []:  # the gradient average DDP would do
            if p.grad is not None:
                dist.sum(p.grad).div_(dist.world)
        s["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        opt.step()
        stats.append({"loss": loss.item(), **s})
    policy.net.eval()
    return {k: float(np.mean([s[k] for s in stats])) for k in stats[0]} | {"ratio_first": stats[0]["ratio_mean"],
                                                                           "clipfrac_first": stats[0]["clipfrac"]}


# ----------------------------------------------------------------------------------------------------
# 9 Train loop

class WeightAverage:
    """Exponential moving average of trainable weights (GRPO: updated once per iteration; the toy
    pretraining: every step, decay 0.99). Flow-GRPO evaluates and checkpoints this average (METHODS
    §1.6-1.7: decay 0.9), which smooths out the iteration-to-iteration noise of small-batch policy
    gradients. `with average.applied():` puts the average into the model and restores the live
    weights afterwards."""

    def __init__(self, params: list, decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for avg, p in zip(self.shadow, self.params):
            avg.lerp_(p, 1 - self.decay)

    @torch.no_grad()
    def copy_to_model(self, weights: list | None = None) -> None:
        """Put `weights` (default: the average) into the model's parameters."""
        for p, w in zip(self.params, self.shadow if weights is None else weights):
            p.copy_(w)

    @contextlib.contextmanager
    def applied(self):
        live = [p.detach().clone() for p in self.params]
        self.copy_to_model()
        try:
            yield
        finally:
            self.copy_to_model(live)


def add_lora(policy, args: Args) -> list[torch.nn.Parameter]:
    """LoRA through peft on the denoiser (diffusers' add_adapter); the base weights are frozen."""
    from peft import LoraConfig

    torch.manual_seed(stable_seed(args.seed, "lora"))
    policy.net.requires_grad_(False)
    rank, alpha = args.lora_rank or policy.lora_defaults[0], args.lora_alpha or policy.lora_defaults[1]
    policy.net.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                      target_modules=policy.lora_targets))
    params = [p for p in policy.net.parameters() if p.requires_grad]
    for p in params:  # the adapter trains in fp32 even on a bf16 model
        p.data = p.data.float()
    return params


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu or auto")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def validate(args: Args) -> None:
    """Every bad input becomes one UsageError naming the flag and what is valid, before any file is written."""
    if args.method not in METHODS:
        raise UsageError(f"unknown --method {args.method!r}; choose one of {', '.join(METHODS)} (or all)")
    if args.sde not in SDE_KINDS:
        raise UsageError(f"unknown --sde {args.sde!r}; choose one of {', '.join(SDE_KINDS)}")
    checks = [("iterations", args.iterations >= 0, ">= 0 (0: the method's default)"), ("group-size", args.group_size >= 2, ">= 2"),
              ("prompts-per-iter", args.prompts_per_iter >= 1, ">= 1"), ("steps", args.steps >= 3, ">= 3"),
              ("eval-steps", args.eval_steps >= 1, ">= 1"), ("eval-every", args.eval_every >= 1, ">= 1"),
              ("eval-per-tag", args.eval_per_tag >= 1, ">= 1"), ("lr", args.lr > 0, "> 0"),
              ("clip-range", args.clip_range > 0, "> 0"), ("beta", args.beta >= 0, ">= 0"),
              ("inner-updates", args.inner_updates >= 1, ">= 1"), ("seeds", args.seeds >= 1, ">= 1"),
              ("tweedie-substeps", args.tweedie_substeps >= 1, ">= 1"), ("guidance", args.guidance == 0 or args.guidance >= 1, "0 or >= 1"),
              ("noise-level", args.noise_level > 0, "> 0"), ("ddim-eta", 0 < args.ddim_eta <= 1, "in (0, 1]"),
              ("chunk-fraction", 0 < args.chunk_fraction <= 1, "in (0, 1]"),
              ("train-fraction", 0 < args.train_fraction <= 1, "in (0, 1]"), ("num-chunks", args.num_chunks >= 1, ">= 1"),
              ("lora-rank", args.lora_rank >= 0, ">= 0"), ("jobs", args.jobs >= 1, ">= 1"),
              ("lora-alpha", args.lora_alpha >= 0, ">= 0"), ("resolution", args.resolution % 16 == 0 and args.resolution > 0, "a positive multiple of 16"), ("branch-steps", args.branch_steps >= 0, ">= 0"),
              ("pretrain-steps", args.pretrain_steps >= 1, ">= 1"), ("pretrain-detailed", 0 <= args.pretrain_detailed <= 1, "in [0, 1]"),
              ("ema", 0 <= args.ema < 1, "in [0, 1)"), ("max-grad-norm", args.max_grad_norm > 0, "> 0"),
              ("checkpoint-every", args.checkpoint_every >= 1, ">= 1"), ("max-nonfinite", args.max_nonfinite >= 1, ">= 1"),
              ("benchmark", args.benchmark >= 0, ">= 0"), ("peak-tflops", args.peak_tflops >= 0, ">= 0")]
    for flag, ok, valid in checks:
        if not ok:
            raise UsageError(f"--{flag} must be {valid}, got {getattr(args, flag.replace('-', '_'))!r}")
    if args.dtype not in ("auto", "fp32", "bf16"):
        raise UsageError(f"--dtype must be auto, fp32 or bf16, got {args.dtype!r}")
    if args.model != "toy" and args.model.startswith((".", "/", "~")) and not Path(args.model).expanduser().exists():
        raise UsageError(f"--model {args.model}: no such folder (a diffusers pipeline folder or a hub id is expected)")
    names = [n for n, _ in parse_reward(reward_spec(args))]
    if "toy" in names and (args.model != "toy" or args.prompts):
        raise UsageError("--reward toy scores the built-in toy prompts on the toy model; use pickscore or clip here")
    if args.prompts and not Path(args.prompts).is_file():
        raise UsageError(f"--prompts {args.prompts}: no such file (one prompt a line is expected)")
    parse_granularities(args.granularities)
    n_trained = int(trainable_steps(time_grid(args.steps), args).sum())
    parse_chunks(args.chunks, n_trained)
    resolve_device(args.device)


def make_run_dir(args: Args) -> Path:
    run = Path(args.out) / f"{args.method}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        run.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise UsageError(f"--out {args.out!r}: cannot create the run folder {run} ({e.strerror or e})") from None
    return run


def prompt_sets(args: Args) -> tuple[list[dict] | None, list[dict]]:
    """(training prompts, held-out prompts). Built in: the toy generator (None) and the fixed toy-GenEval
    set; from --prompts FILE: every 10th line is held out, the rest are drawn for training."""
    if not args.prompts:
        return None, eval_prompts(args.eval_per_tag)
    lines = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if len(lines) < 2:
        raise UsageError(f"--prompts {args.prompts}: needs at least 2 prompts (one a line); it has {len(lines)}")
    metas = [{"tag": "prompt", "prompt": line} for line in lines]
    return [m for i, m in enumerate(metas) if i % 10], metas[::10]


def iteration_prompts(args: Args, train_pool: list[dict] | None, it: int) -> list[dict]:
    """The prompts of iteration `it`: drawn from --prompts, or generated in the toy grammar."""
    rng = random.Random(stable_seed(args.seed, "prompts", it))
    return [rng.choice(train_pool) for _ in range(args.prompts_per_iter)] if train_pool else \
        train_prompts(args.prompts_per_iter, rng)


def toy_reward(images: torch.Tensor, metas: list[dict]) -> torch.Tensor:
    """The default RL reward of the toy world: the scorer's dense partial score in [0, 1]."""
    return score_batch(images, metas)[1]


def chunk_sizes_of(policy, args: Args, grid: torch.Tensor) -> list[int] | None:
    """Chunk-GRPO's chunk sizes over the trained steps (--chunks, or auto); None for other methods."""
    if args.method != "chunk":
        return None
    trainable = trainable_steps(grid, args)
    return parse_chunks(args.chunks, int(trainable.sum())) or auto_chunk_sizes(policy, args, grid, trainable)


def auto_chunk_sizes(policy, args: Args, grid: torch.Tensor, trainable: torch.Tensor) -> list[int]:
    """Chunk sizes from the base model's relative-L1 profile on a fixed batch (Chunk-GRPO §7.4)."""
    metas = eval_prompts(2, seed=99)
    ctx = Context(policy, args, Meter(), generator(policy.device, "chunk-profile"), metas,
                  policy.encode([m["prompt"] for m in metas]), grid, None)
    traj = ctx.rollout(torch.arange(len(metas)), ctx.noise(len(metas)), grid, [True] * (len(grid) - 1))
    profile = relative_l1(traj.states).mean(0)[trainable]  # (trained steps,)
    return chunks_from_profile(profile, args.num_chunks)


def train(args: Args, resume: str | None = None) -> list[dict]:
    """Run GRPO with the chosen credit assignment; returns the metric records (also in metrics.jsonl).
    With `resume` (a run folder), continue from its last checkpoint up to `args.iterations`.
    Under `torchrun --nproc_per_node N`, every rank takes all prompts of the iteration and samples
    group_size / N members of each group (what a group shares, its starting noise or ODE anchor, is
    drawn from a generator common to all ranks); rewards are all-gathered before group normalisation,
    gradients are averaged over ranks, metrics are gathered, and only rank 0 writes files."""
    validate(args)
    args = dataclasses.replace(args, iterations=args.iterations or DEFAULT_ITERATIONS[args.method])
    device = resolve_device(args.device)
    dist = Dist.setup(device)
    if dist.world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if args.group_size % dist.world:
        raise UsageError(f"--group-size {args.group_size} must be a multiple of the {dist.world} ranks")
    writer = dist.rank == 0
    seed_everything(args.seed)
    run = Path(resume) if resume else make_run_dir(args) if writer else None  # before the slow loading
    try:
        if dist.rank > 0:  # rank 0 loads first: it alone pretrains and caches the toy model if needed
            dist.barrier()
        policy, reward_fn = load_policy(args, device), build_reward(args, device)
        if dist.rank == 0:
            dist.barrier()
        train_pool, eval_metas = prompt_sets(args)
    except UsageError:
        if run and not resume:  # a model or reward that does not load leaves no empty run folder behind
            run.rmdir()
        raise
    if writer:
        (run / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    params = add_lora(policy, args)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    grid = policy.time_grid(args.steps)
    meter, history, wall, start_it, bad_in_row = Meter(), [], 0.0, 1, 0
    chunk_sizes = chunk_sizes_of(policy, args, grid)  # before a checkpoint is loaded: the base model's profile
    if resume:
        loading = time.time()
        state = load_checkpoint(run, policy, opt)
        meter, history, wall, start_it = Meter(**state["meter"]), state["history"], state["wall"], state["iteration"] + 1
        if writer:
            print(f"resumed at iteration {state['iteration']}: checkpoint.pt ({(run / 'checkpoint.pt').stat().st_size / 1e6:.1f} MB) "
                  f"loaded in {time.time() - loading:.2f} s")
    average = WeightAverage(params, args.ema)  # what is evaluated and saved
    if resume and "ema" in state:  # (checkpoints of older versions hold none: the average restarts there)
        average.shadow = [t.to(policy.device) for t in state["ema"]]
    if chunk_sizes and writer:
        print(f"chunk sizes over the trained steps: {chunk_sizes}")
    log = (run / "metrics.jsonl").open("w") if writer else None
    for entry in history if writer else []:  # a resumed run rewrites what its checkpoint holds, dropping later lines
        log.write(json.dumps(entry) + "\n")

    def record(entry: dict) -> None:
        history.append(entry)
        if writer:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    def total(n: int) -> int:  # a counter summed over ranks
        return int(dist.sum(torch.tensor(n)))

    def run_eval(iteration: int) -> None:
        nfe = total(meter.nfe)
        if writer:  # the other ranks go on and wait for rank 0 at the next gradient average
            with average.applied():
                metrics, images, metas, verdicts = evaluate(policy, args, reward_fn, eval_metas)
            record({"iteration": iteration, **metrics, "nfe": nfe, "wall_s": round(wall, 2)})
            save_grid(images, metas, verdicts, run / f"samples_{iteration:04d}.png",
                      f"{args.method} iteration {iteration}: held-out score {metrics['eval_overall']:.3f}")

    if not resume:
        if chunk_sizes:
            record({"iteration": 0, "chunk_sizes": chunk_sizes})
        run_eval(0)
    quiet = not writer or os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # tqdm's own switch, which an explicit disable= overrides
    bar = tqdm(range(start_it, args.iterations + 1), desc=args.method, dynamic_ncols=True, disable=quiet)
    for it in bar:
        start = time.time()
        metas = iteration_prompts(args, train_pool, it)
        shared = generator(device, args.seed, "rollout", it)
        gen = generator(device, args.seed, "rollout", it, dist.rank) if dist.world > 1 else shared
        ctx = Context(policy, args, meter, gen, metas, policy.encode([m["prompt"] for m in metas]), grid, reward_fn,
                      chunk_sizes, dist=dist, shared_gen=shared)
        transitions, rewards = METHODS[args.method](ctx)
        finite = bool(torch.isfinite(rewards).all() and torch.isfinite(transitions.advantage).all())
        finite = total(int(finite)) == dist.world
        stats = update(policy, opt, ctx.cond, transitions, args, ctx.gen, dist) if finite else {"skipped": 1}
        if not stats.get("skipped"):  # training (+ reference) passes actually run
            meter.forward(policy, len(transitions) * (2 if args.beta > 0 else 1))
            average.update()
        wall += time.time() - start
        bad_in_row = bad_in_row + 1 if stats.get("skipped") else 0
        if bad_in_row and writer:
            tqdm.write(f"warning: iteration {it}: non-finite rewards, advantages or loss; update skipped")
        if bad_in_row >= args.max_nonfinite:
            raise RunError(f"stopped at iteration {it}: {bad_in_row} iterations in a row had non-finite rewards, "
                           f"advantages or loss; the last good checkpoint is in {run}")
        per_step = {f"adv_abs/{k}": float(transitions.advantage[transitions.step == k].abs().mean())
                    for k in torch.unique(transitions.step).tolist()}
        rewards = dist.gather(rewards.float())  # zero_std is over whole groups already, the same on every rank
        entry = {"iteration": it, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()), **stats,
                 "zero_std_frac": float(np.mean(ctx.stats["zero_std"])), "transitions": total(len(transitions)),
                 "nfe": total(meter.nfe), "reward_calls": total(meter.reward_calls), "wall_s": round(wall, 2), **per_step}
        record(entry)
        bar.set_postfix(reward=f"{entry['reward_mean']:.3f}", kl=f"{entry.get('kl', 0):.2g}")
        if it % args.eval_every == 0 or it == args.iterations:
            run_eval(it)
        if (it % args.checkpoint_every == 0 or it == args.iterations) and not bad_in_row and writer:
            save_checkpoint(run, policy, opt, {"iteration": it, "meter": dataclasses.asdict(meter), "wall": wall,
                                               "history": history, "ema": average.shadow})
    if not writer:
        return history
    log.close()
    with average.applied():
        policy.save_lora(run / "lora")
    plot_curves(history, run / "reward_curve.png", args.method)
    evals = [h for h in history if "eval_overall" in h]
    score = "toy-GenEval overall" if args.model == "toy" else "held-out reward"
    print(f"done: {run}\n{score} {evals[0]['eval_overall']:.3f} -> {evals[-1]['eval_overall']:.3f} "
          f"({evals[-1]['eval_overall'] - evals[0]['eval_overall']:+.3f}) in {wall / 60:.1f} min of training, "
          f"{history[-1]['nfe']:.3g} forward passes")
    return history


def save_checkpoint(run: Path, policy, opt, state: dict) -> None:
    """Adapter weights and their moving average, optimizer state, RNG state and progress, written atomically (tmp, then rename).
    Every iteration's randomness is derived from (seed, iteration), so this is all a resume needs."""
    from peft.utils import get_peft_model_state_dict

    payload = {"lora": get_peft_model_state_dict(policy.net), "optimizer": opt.state_dict(),
               "torch_rng": torch.get_rng_state(), **state}
    tmp = run / "checkpoint.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, run / "checkpoint.pt")


def load_checkpoint(run: Path, policy, opt) -> dict:
    from peft.utils import set_peft_model_state_dict

    path = run / "checkpoint.pt"
    if not path.exists():
        raise UsageError(f"--resume {run}: no checkpoint.pt there (a run folder written by this script is expected)")
    state = torch.load(path, map_location=policy.device, weights_only=False)
    set_peft_model_state_dict(policy.net, state["lora"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return state


# ----------------------------------------------------------------------------------------------------
# 10 Eval, benchmark, logging, plots


@torch.no_grad()
def evaluate(policy, args: Args, reward_fn=None, metas: list[dict] | None = None):
    """Deterministic evaluation: fixed prompts (default: toy-GenEval's), fixed noise, `eval_steps`
    Euler ODE steps. Returns (metrics, images (N, 3, H, W), metas, verdicts (N,) or None).
    Toy model: eval_overall is toy-GenEval, the mean of the six category accuracies as GenEval
    reports it; real models: eval_overall is the mean reward of the held-out prompts."""
    metas = metas or eval_prompts(args.eval_per_tag)
    cond = policy.encode([m["prompt"] for m in metas])
    x = initial_noise(policy, len(metas), generator("cpu", "eval-noise"))
    traj = rollout(policy, cond, x, policy.time_grid(args.eval_steps), [False] * args.eval_steps, args, Meter())
    images = policy.decode(traj.states[:, -1])
    reward = float((reward_fn or toy_reward)(images, metas).mean())
    if args.model != "toy":
        return {"eval_overall": reward, "eval_reward": reward}, images, metas, None
    verdicts, _ = score_batch(images, metas)
    tags = np.array([m["tag"] for m in metas])
    per_tag = {f"eval_{tag}": float(verdicts[torch.from_numpy(tags == tag)].mean()) for tag in TAGS}
    metrics = {"eval_overall": float(np.mean(list(per_tag.values()))), **per_tag, "eval_reward": reward}
    return metrics, images, metas, verdicts


def save_grid(images: torch.Tensor, metas: list[dict], verdicts: torch.Tensor | None, path: Path, title: str,
              per_row: int = 6) -> None:
    """A labelled PNG: toy, one row per GenEval category with the verdict (✓/✗) over each sample;
    real models, the first three rows of held-out prompts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if verdicts is not None:
        tags = dict.fromkeys(m["tag"] for m in metas)
        rows = {tag: [i for i, m in enumerate(metas) if m["tag"] == tag][:per_row] for tag in tags}
    else:
        chunks = [list(range(r, min(r + per_row, len(metas)))) for r in range(0, min(len(metas), 3 * per_row), per_row)]
        rows = {f"prompts {c[0]}-{c[-1]}": c for c in chunks}
    fig, axes = plt.subplots(len(rows), per_row, figsize=(per_row * 1.6, len(rows) * 1.9), squeeze=False)
    for row, (name, idx) in enumerate(rows.items()):
        for col in range(per_row):
            ax = axes[row, col]
            ax.axis("off")
            if col < len(idx):
                i = idx[col]
                ax.imshow(images[i].permute(1, 2, 0).cpu().numpy(), interpolation="nearest")
                ok = verdicts is None or bool(verdicts[i])
                mark = "" if verdicts is None else "✓ " if ok else "✗ "
                ax.set_title(textwrap.fill(mark + metas[i]["prompt"], 24)[:80], fontsize=6,
                             color="black" if verdicts is None else "green" if ok else "red")
        axes[row, 0].text(-0.1, 0.5, name, transform=axes[row, 0].transAxes, rotation=90, va="center", ha="right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(history: list[dict], path: Path, label: str) -> None:
    """Reward per iteration and held-out toy-GenEval, against iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "reward_mean" in h]
    evals = [h for h in history if "eval_overall" in h]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot([h["iteration"] for h in train], [h["reward_mean"] for h in train], label=label)
    a.set(xlabel="iteration", ylabel="training reward (dense score)", title="reward")
    b.plot([h["iteration"] for h in evals], [h["eval_overall"] for h in evals], marker="o", label=label)
    b.set(xlabel="iteration", ylabel="toy-GenEval overall", title="held-out eval (ODE)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, from the vendors' data sheets


def benchmark(args: Args) -> dict:
    """Cost of a training iteration, split into sampling / reward / training: seconds, images per
    second, peak memory, and the MFU of sampling and of training (forward + backward) against the
    accelerator's bf16 peak. One iteration runs under torch's FlopCounterMode, which counts the FLOPs
    of every matmul, convolution and attention (and warms up); the next `args.benchmark` are timed.
    Nothing is written. Real speed on SD3.5-M: --model random-sd3.5-medium --reward-model random."""
    from torch.utils.flop_counter import FlopCounterMode

    validate(args)
    device = resolve_device(args.device)
    seed_everything(args.seed)
    policy, reward_fn = load_policy(args, device), build_reward(args, device)
    opt = torch.optim.AdamW(add_lora(policy, args), lr=args.lr, weight_decay=args.weight_decay)
    grid, (train_pool, _) = policy.time_grid(args.steps), prompt_sets(args)
    chunk_sizes = chunk_sizes_of(policy, args, grid)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counter, spent = FlopCounterMode(display=False), {}

    def timed_reward(images, metas):  # the reward's share of the sampling phase
        sync()
        start, before = time.perf_counter(), counter.get_total_flops()
        r = reward_fn(images, metas)
        sync()
        spent["reward_s"] += time.perf_counter() - start
        spent["reward_flops"] += counter.get_total_flops() - before
        return r

    def iteration(it: int) -> dict:
        spent.update(reward_s=0.0, reward_flops=0)
        metas = iteration_prompts(args, train_pool, it)
        cond = policy.encode([m["prompt"] for m in metas])  # once per prompt, as in training: not timed
        ctx = Context(policy, args, Meter(), generator(device, args.seed, "benchmark", it), metas, cond, grid,
                      timed_reward, chunk_sizes)
        sync()
        start, f0 = time.perf_counter(), counter.get_total_flops()
        transitions, _ = METHODS[args.method](ctx)
        sync()
        mid, f1 = time.perf_counter(), counter.get_total_flops()
        update(policy, opt, cond, transitions, args, ctx.gen)
        sync()
        return {"sampling_s": mid - start - spent["reward_s"], "reward_s": spent["reward_s"], "training_s": time.perf_counter() - mid,
                "sampling_flops": f1 - f0 - spent["reward_flops"], "reward_flops": spent["reward_flops"],
                "training_flops": counter.get_total_flops() - f1, "passes": ctx.meter.nfe, "images": ctx.meter.reward_calls,
                "transitions": len(transitions)}

    with counter:  # FLOPs per forward pass, per scored image and per trained transition; also the warm-up
        counted = iteration(0)
    per = {"passes": counted["sampling_flops"] / counted["passes"], "images": counted["reward_flops"] / counted["images"],
           "transitions": counted["training_flops"] / counted["transitions"]}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = [iteration(it) for it in tqdm(range(1, args.benchmark + 1), desc="benchmark", dynamic_ncols=True)]
    mean = {k: float(np.mean([t[k] for t in timed])) for k in timed[0] if not k.endswith("flops")}  # counted above
    total = mean["sampling_s"] + mean["reward_s"] + mean["training_s"]
    flop_rate = {"sampling": per["passes"] * mean["passes"] / mean["sampling_s"],
                 "training": per["transitions"] * mean["transitions"] / mean["training_s"]}  # FLOP/s
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = args.peak_tflops or next((v for k, v in BF16_PEAK_TFLOPS.items() if k in gpu), 0.0)
    if gpu:
        memory = torch.cuda.max_memory_allocated(device)
    else:  # the process's peak resident memory (Linux reports KiB; `resource` is Unix-only)
        import resource

        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"method": args.method, "model": args.model, "device": gpu or "cpu", **{k: round(mean[k], 4) for k in mean},
              "total_s": round(total, 4), "images_per_s": mean["images"] / total, "seconds_per_image": total / mean["images"],
              "peak_memory_gb": memory / 1e9, "flops_per_pass": per["passes"], "flops_per_image_reward": per["images"],
              "flops_per_transition": per["transitions"], **{f"tflops_{k}": v / 1e12 for k, v in flop_rate.items()},
              **{f"mfu_{k}": v / (peak * 1e12) if peak else None for k, v in flop_rate.items()}}
    mfu = (f"MFU against the bf16 peak of {peak:g} TFLOP/s: sampling {result['mfu_sampling']:.1%}, training "
           f"{result['mfu_training']:.1%}" if peak else "MFU: unknown peak (give --peak-tflops)")
    print(f"{args.method} on {args.model} ({gpu or 'cpu'}): {args.prompts_per_iter} prompts x group {args.group_size}, "
          f"{args.steps} steps, {policy.passes} forward pass(es) a step\n"
          f"per iteration (mean of {args.benchmark}): sampling {mean['sampling_s']:.2f} s, reward {mean['reward_s']:.2f} s, "
          f"training {mean['training_s']:.2f} s, total {total:.2f} s = {result['seconds_per_image']:.3f} s per image "
          f"({result['images_per_s']:.2f} images/s); peak memory {result['peak_memory_gb']:.2f} GB\n"
          f"achieved: sampling {result['tflops_sampling']:.3g} TFLOP/s, training forward+backward "
          f"{result['tflops_training']:.3g} TFLOP/s; {mfu}\n{json.dumps(result)}")
    return result


def compare(args: Args, folder: str | None = None) -> Path:
    """`--method all` (or a list such as flow_grpo,chunk, or several --compare-seeds): the methods with
    the same seeds, settings and iterations, `--jobs` runs at a time; writes
    comparison.md (toy-GenEval at the end, at an equal wall-clock budget and at an equal nfe budget,
    mean and spread over seeds) and comparison.png (held-out score against iteration, wall-clock, nfe).
    `--resume` of the comparison's folder continues every run from its last checkpoint (finished runs
    are read back), so a long comparison that is stopped loses at most `--checkpoint-every` iterations."""
    seeds = parse_seeds(args.compare_seeds)
    methods = list(METHODS) if args.method == "all" else args.method.split(",")
    for m in methods:
        validate(dataclasses.replace(args, method=m))
    folder = Path(folder) if folder else Path(args.out) / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    one_runs, resumes = [], []  # each run's args (its args.json then says: one run) and its folder to resume, or None
    for m in methods:
        for s in seeds:
            started = sorted(r for r in folder.glob(f"{m}-seed{s}-*") if (r / "checkpoint.pt").exists())
            one_runs.append(dataclasses.replace(args, method=m, seed=s, compare_seeds=str(s), jobs=1, out=str(folder)))
            resumes.append(str(started[-1]) if started else None)
    threads = max(1, torch.get_num_threads() // args.jobs)
    if args.jobs == 1:
        histories = [train(a, r) for a, r in zip(one_runs, resumes)]
    else:
        import concurrent.futures
        import multiprocessing

        if args.model == "toy" and not (toy_cache_dir(args) / "done").exists():
            load_toy(args, torch.device("cpu"))  # pretrain once here, not in every worker at the same time
        print(f"{len(one_runs)} runs, {args.jobs} at a time with {threads} thread(s) each; progress is in {folder}/*/metrics.jsonl")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            histories = list(pool.map(train_in_process, one_runs, resumes, [threads] * len(one_runs)))
    runs = {m: [] for m in methods}
    for a, history in zip(one_runs, histories):
        runs[a.method].append([h for h in history if "eval_overall" in h])
    last = [evals[-1] for per_seed in runs.values() for evals in per_seed]
    budgets = {"wall_s": min(e["wall_s"] for e in last), "nfe": min(e["nfe"] for e in last)}

    def at(evals, key):  # the last evaluation within the budget
        return [e for e in evals if e[key] <= budgets[key]][-1]["eval_overall"]

    def cell(values):
        return f"{np.mean(values):.3f} ± {np.std(values):.3f}"

    rows = ["| method | base | final | at equal wall-clock | at equal nfe | wall_s | nfe |", "|---|---|---|---|---|---|---|"]
    for m, per_seed in runs.items():
        rows.append(f"| {m} | {cell([e[0]['eval_overall'] for e in per_seed])} | {cell([e[-1]['eval_overall'] for e in per_seed])} | "
                    f"{cell([at(e, 'wall_s') for e in per_seed])} | {cell([at(e, 'nfe') for e in per_seed])} | "
                    f"{np.mean([e[-1]['wall_s'] for e in per_seed]):.0f} | {np.mean([e[-1]['nfe'] for e in per_seed]):.3g} |")
    iterations = args.iterations or "the method's default"
    note = (f"Held-out toy-GenEval overall, mean ± std over seeds {seeds}; {iterations} iterations each. "
            f"Budgets: {budgets['wall_s']:.0f} s of training wall-clock, {budgets['nfe']:.3g} forward passes "
            "(the smallest final value over all runs); a method is scored at its last evaluation within the budget.")
    (folder / "comparison.md").write_text(note + "\n\n" + "\n".join(rows) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for m, per_seed in runs.items():
        n = min(len(e) for e in per_seed)
        score = np.mean([[x["eval_overall"] for x in e[:n]] for e in per_seed], 0)
        for ax, key in zip(axes, ("iteration", "wall_s", "nfe")):
            ax.plot(np.mean([[x[key] for x in e[:n]] for e in per_seed], 0), score, marker="o", ms=3, label=m)
    for ax, key in zip(axes, ("iteration", "training wall-clock (s)", "forward passes (nfe)")):
        ax.set(xlabel=key, ylabel="toy-GenEval overall")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "comparison.png", dpi=110)
    plt.close(fig)
    print((folder / "comparison.md").read_text())
    return folder


def train_in_process(args: Args, resume: str | None, threads: int) -> list[dict]:
    """One run of a comparison in a worker process (`--jobs`), on its share of the CPU threads."""
    torch.set_num_threads(threads)
    os.environ["TQDM_DISABLE"] = "1"  # bars of parallel runs would overwrite each other
    return train(args, resume)


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"--compare-seeds must be integers like 0,1,2, got {text!r}") from None


# ----------------------------------------------------------------------------------------------------
# 11 CLI


def field_help() -> dict:
    """The docstring under each Args field, read from the source (CleanRL-style --help)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(Args)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def build_parser():
    """argparse over the Args fields; errors raise UsageError (one line, exit status 2)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UsageError(message)

    parser = Parser(description="GRPO with credit assignment for flow-matching text-to-image models.")
    helps = field_help()
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=helps.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, type=kind, default=f.default, help=f"{helps.get(f.name)} (default: {f.default})")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    return parser


def parse_args(argv=None) -> tuple[Args, str | None]:
    """CLI -> (Args, resume folder). With --resume, the run's saved args are the base and flags given
    on the command line override them (e.g. more --iterations)."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    resume = ns.pop("resume")
    if resume is None:
        return Args(**ns), None
    saved = Path(resume) / "args.json"
    if not saved.exists():
        raise UsageError(f"--resume {resume}: no args.json there (a run folder written by this script is expected)")
    given = {k: v for k, v in vars(parser.parse_args(argv, argparse_defaults_none(parser))).items() if v is not None}
    given.pop("resume", None)
    return Args(**{**json.loads(saved.read_text()), **given}), resume


def argparse_defaults_none(parser):
    """A namespace in which every flag defaults to None, to tell the flags that were given."""
    import argparse

    return argparse.Namespace(**{a.dest: None for a in parser._actions if a.dest != "help"})


def main(argv=None) -> int:
    try:
        args, resume = parse_args(argv)
        several = args.method == "all" or "," in args.method or "," in args.compare_seeds
        if args.benchmark and not resume:
            benchmark(args)
        else:
            compare(args, resume) if several else train(args, resume)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # under torchrun: a clean exit (gloo may abort without it)
    return 0


if __name__ == "__main__":
    sys.exit(main())
