"""The toy base model: its architecture, its pretraining recipe and the flaw it is given on purpose.

    python notebooks/toy_base.py --out my_toy_base          # 1,600 steps: 10 minutes on 2 cores of an AMD EPYC
    python flow_grpo_credit.py --toy-base my_toy_base       # a run from it instead of the shipped assets/toy_base

assets/toy_base is this recipe's output. A copy made on another CPU scores close to the shipped one, not identically:
floating-point sums differ between CPUs."""
import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flow_grpo_credit as fgc  # noqa: E402

VOCAB = ["[PAD]", "[UNK]", "a", "and", "of", *fgc.NUMBER_WORDS.values(), *fgc.COLORS, *fgc.CLASSES,
         *(c + "s" for c in fgc.CLASSES), "left", "right", "above", "below"]
MAX_TOKENS = 8

SHAPE_SIZE = 5
_MASK_ROWS = {  # 5x5 masks
    "square": ["#####"] * 5,
    "circle": [".###.", "#####", "#####", "#####", ".###."],
    "triangle": ["..#..", ".###.", ".###.", "#####", "#####"],
}
SHAPE_MASKS = {k: np.array([[c == "#" for c in row] for row in rows]) for k, rows in _MASK_ROWS.items()}


def render(meta: dict, rng: random.Random) -> np.ndarray:
    """A ground-truth image (RES, RES, 3) in [0, 1] that satisfies the prompt; free attributes are random."""
    objects = [(item["class"], item.get("color") or rng.choice(list(fgc.COLORS)))
               for item in meta["include"] for _ in range(item["count"])]
    span = fgc.RES - SHAPE_SIZE + 1
    for _ in range(1000):  # rejection sampling of non-touching placements that satisfy the relation
        corners = [(rng.randrange(span), rng.randrange(span)) for _ in objects]
        boxes = [((x + SHAPE_SIZE / 2, y + SHAPE_SIZE / 2), (SHAPE_SIZE, SHAPE_SIZE)) for x, y in corners]
        apart = all(abs(p[0] - q[0]) > SHAPE_SIZE or abs(p[1] - q[1]) > SHAPE_SIZE
                    for i, p in enumerate(corners) for q in corners[:i])
        if apart and all(item["position"][0] in fgc.relations(boxes[i], boxes[item["position"][1]])
                         for i, item in enumerate(meta["include"]) if item.get("position")):
            break
    img = np.zeros((fgc.RES, fgc.RES, 3), dtype=np.float32)
    for (cls, color), (x, y) in zip(objects, corners):
        img[y:y + SHAPE_SIZE, x:x + SHAPE_SIZE][SHAPE_MASKS[cls]] = fgc.COLORS[color]
    return img


def render_batch(metas: list[dict], rng: random.Random) -> torch.Tensor:
    """Ground-truth images for prompts: (N, 3, RES, RES) in [0, 1]."""
    return torch.from_numpy(np.stack([render(m, rng) for m in metas])).permute(0, 3, 1, 2)


def with_unnamed_object(meta: dict, rng: random.Random) -> dict:
    """`meta` drawn with one more object, of a class its caption does not name: the toy base's flaw."""
    named = {item["class"] for item in meta["include"]}
    unnamed = {"class": rng.choice([c for c in fgc.CLASSES if c not in named]), "count": 1}
    return {**meta, "include": [*meta["include"], unnamed]}


def build_tokenizer(length: int = MAX_TOKENS):
    """A word-level transformers tokenizer over the toy vocabulary (no files needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", model_max_length=length)


def build_toy_modules(seed: int, device="cpu"):
    """Fresh toy UNet and CLIP text encoder on `device`; 1.7M + 0.1M parameters."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    unet = UNet2DConditionModel(
        sample_size=fgc.RES, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16)
    return unet.to(device), text_encoder.to(device)


def pretrain_toy(steps: int, device, batch: int = 64, lr: float = 2e-3, detailed: float = 0.5, unnamed: float = 0.3):
    """Rectified-flow pretraining on rendered shapes: |v(x_t, t, c) - (x1 - x0)|^2, logit-normal t (as SD3), 10% empty
    captions for CFG, a `detailed` share of captions that name every colour, an EMA (0.99) of the weights. Seeded.
    -> the modules by name.

    The base's one flaw, on purpose: `unnamed` (30%) of the images hold one more object, of a class the
    caption does not name, as web alt-text leaves objects out. The base then adds an unasked object to about a
    third of its images, on every kind of prompt: a defect all prompts share, which RL removes in minutes, and
    whose removal the methods race on. Its other errors (position, counting) are prompt by prompt."""
    from diffusers.training_utils import EMAModel
    unet, text_encoder = build_toy_modules(seed=0, device=device)
    tokenizer, params = build_tokenizer(), [*unet.parameters(), *text_encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(  # a linear warm-up over 50 steps, then a cosine to 0
        opt, lambda i: min(1.0, (i + 1) / 50) * (1 + math.cos(math.pi * i / steps)) / 2)
    ema, rng, gen = EMAModel(params, decay=0.99), random.Random(0), torch.Generator().manual_seed(0)
    for _ in tqdm(range(steps), desc="pretraining toy model", leave=False):
        metas = fgc.train_prompts(batch, rng, detailed)
        drawn = [with_unnamed_object(m, rng) if rng.random() < unnamed else m for m in metas]
        x0 = render_batch(drawn, rng) * 2 - 1  # (B, 3, fgc.RES, fgc.RES) in [-1, 1]
        captions = [m["prompt"] if rng.random() > 0.1 else "" for m in metas]
        x1 = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(len(x0), generator=gen))  # logit-normal(0, 1)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * x1
        ids = tokenizer(captions, padding="max_length", max_length=MAX_TOKENS, return_tensors="pt").input_ids
        v = unet(xt.to(device), t.to(device) * 1000, text_encoder(ids.to(device)).last_hidden_state).sample
        opt.zero_grad(set_to_none=True)
        F.mse_loss(v, (x1 - x0).to(device)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema.step(params)
    ema.copy_to(params)
    return {"unet": unet, "text_encoder": text_encoder, "tokenizer": tokenizer}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder to write (unet, text_encoder, tokenizer)")
    parser.add_argument("--steps", type=int, default=1600, help="pretraining steps (default: 1600)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        print(f"error: {args.out} exists; choose a new folder", file=sys.stderr)
        return 2
    start, modules = time.time(), pretrain_toy(args.steps, torch.device(args.device))
    for name, module in modules.items():
        module.save_pretrained(Path(args.out) / name)
    print(f"pretrained the toy model in {time.time() - start:.0f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
