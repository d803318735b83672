"""The toy's learned preference proxy: a tiny CLIP trained on noisy pairwise preferences drawn from a known gold.

    python notebooks/toy_pref.py --out my_toy_pref          # 10,000 prompts: 18 minutes at one thread (below)
    python flow_grpo_credit.py --reward toy-pref            # train against the shipped proxy, assets/toy_pref
    python flow_grpo_credit.py --reward pickscore --reward-model my_toy_pref    # ... or against a remade one

The gold (the script's toy_gold, which every toy evaluation reports) is what a rater would want; the proxy sees only
preferences between two base samples of one prompt, drawn from the gold by Bradley-Terry at temperature 0.1, as
PickScore learned from Pick-a-Pic's choices.
RL against the proxy can then be scored against the gold it imitates: how much of a proxy gain is real.

assets/toy_pref is this recipe's output with its defaults. A remake at one thread on another CPU or library version is
close, not identical (floating-point sums differ): on a 2-core AMD EPYC it agreed with the held-out labels 67.8% of the
time (shipped: 68.4%), with the gold's order 67.9% (67.4%), and correlated with the gold at 0.545 (0.528). Its phases
took there, at one thread: sampling 20,000 training images 10.5 minutes (with their gold), 3,072 held-out images 1.6
minutes, training 5.4 minutes, the held-out evaluation 5 seconds (17.7 minutes in all). --samples FILE keeps the
sampled pairs, so that a second recipe with other training flags starts there."""
import argparse
import copy
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flow_grpo_credit as fgc  # noqa: E402


@torch.no_grad()
def sample_pairs(policy, metas: list[dict], gen: torch.Generator, steps: int, batch: int = 500) -> torch.Tensor:
    """Two base samples per prompt, by the script's deterministic evaluation (Euler ODE, `steps` steps along
    policy.time_grid) -> (2N, 3, RES, RES) in [0, 1]; rows 2i and 2i + 1 are prompt i's pair."""
    noise = fgc.initial_noise(policy, 2 * len(metas), gen)  # (2N, 3, RES, RES)
    cond = policy.encode([m["prompt"] for m in metas for _ in range(2)], device="cpu")  # (2N, L, 64)
    grid, args, images = policy.time_grid(steps), fgc.resolved(fgc.Args()), []
    for idx in torch.arange(len(noise)).split(batch):
        ode = fgc.rollout(policy, {k: e[idx] for k, e in cond.items()}, noise[idx], grid, [False] * steps, args,
                          fgc.Meter())
        images.append(policy.decode(ode.states[:, -1]))
    return torch.cat(images)


def bt_labels(gold: torch.Tensor, gen: torch.Generator, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry preferences of each pair (rows 2i, 2i + 1): (label (P,) 1 if 2i is preferred, P(2i preferred))."""
    p = torch.sigmoid((gold[0::2] - gold[1::2]) / temperature)  # (P,)
    return (torch.rand(len(p), generator=gen) < p).float(), p


def build_proxy(text_encoder_folder: Path, vision: dict, seed: int):
    """A CLIPModel whose text tower starts from the toy base's (its 8 positions, and 8 more for longer captions),
    with a fresh vision tower of `vision`'s sizes on 16 px; exp(logit_scale) / 26 starts at 4."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextModel
    torch.manual_seed(seed)
    base = CLIPTextModel.from_pretrained(text_encoder_folder)
    text_config = {**base.config.to_dict(), "max_position_embeddings": 16, "_name_or_path": ""}  # no local path saved
    config = CLIPConfig(text_config=text_config, vision_config={"image_size": fgc.RES, **vision},
                        projection_dim=vision["hidden_size"], logit_scale_init_value=math.log(26 * 4))
    clip = CLIPModel(config)
    state = base.state_dict()  # the keys of clip.text_model's
    positions = clip.text_model.embeddings.position_embedding.weight.detach().clone()  # (16, 64)
    positions[:8] = state.pop("embeddings.position_embedding.weight")
    clip.text_model.load_state_dict({**state, "embeddings.position_embedding.weight": positions})
    return clip


def proxy_tokenizer(folder: Path):
    """The toy tokenizer, with the [PAD] id 0 appended to every caption as its end: CLIP pools the text at the first
    id equal to eos_token_id (0 here), which a batch's longest caption would otherwise lack (its pool: the 1st word)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="[PAD]", unk_token="[UNK]",
                                  model_max_length=16)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="$A [PAD]", special_tokens=[("[PAD]", 0)])
    tok.backend_tokenizer.no_padding()  # the base's file pads to 8; clip_reward pads each batch to its longest
    return tok


def proxy_scores(clip, tok, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """fgc.clip_reward's pickscore on 16 px images, with gradients: exp(logit_scale) cos(E_img, E_txt) / 26 -> (N,).
    Pixels are normalised with mean = std = 0.5 (the saved processor's), so [0, 1] maps to [-1, 1]; clip_reward's
    bicubic resize to image_size 16 leaves 16 px images as they are (main checks the two scores agree)."""
    text = tok(prompts, padding=True, truncation=True, return_tensors="pt", max_length=min(77, tok.model_max_length))
    out = clip(pixel_values=(images - 0.5) / 0.5, **text)
    return out.logits_per_image.diag() / 26


def agreement(s: torch.Tensor, label: torch.Tensor) -> float:
    """Share of pairs (rows 2i, 2i + 1 of s) the scores order as `label` (1: 2i first) does."""
    return float(((s[0::2] > s[1::2]).float() == label).float().mean())


def train_proxy(clip, tok, data: dict, val: dict, epochs: int, lr: float, batch: int, seed: int):
    """AdamW on the Bradley-Terry loss -log sigmoid(s_preferred - s_other); keeps the weights of the epoch with the
    best agreement with the validation pairs' labels (never the gold's). -> (clip, best epoch, its val agreement)."""
    gen, pairs, best = torch.Generator().manual_seed(seed), len(data["label"]), (-1.0, 0, None)
    total = epochs * math.ceil(pairs / batch)
    opt = torch.optim.AdamW(clip.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / total)))
    for epoch in range(1, epochs + 1):
        clip.train()
        for idx in torch.randperm(pairs, generator=gen).split(batch):
            rows = torch.stack([2 * idx, 2 * idx + 1], 1).flatten()  # (2b,): each pair's two images side by side
            s = proxy_scores(clip, tok, data["images"][rows], [data["prompts"][i] for i in rows.tolist()])
            sign = 2 * data["label"][idx] - 1  # +1 where image 2i is preferred
            loss = F.softplus(-sign * (s[0::2] - s[1::2])).mean()  # -log sigmoid(s_preferred - s_other)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        score = agreement(score_all(clip, tok, val), val["label"])
        print(f"epoch {epoch}: last loss {loss.item():.3f}, validation agreement {score:.3f}", flush=True)
        if score > best[0]:
            best = (score, epoch, copy.deepcopy(clip.state_dict()))
    clip.load_state_dict(best[2])
    return clip.eval(), best[1], best[0]


@torch.no_grad()
def score_all(clip, tok, data: dict, batch: int = 1000) -> torch.Tensor:
    """proxy_scores of every image of `data`, in eval mode, without gradients -> (2N,)."""
    clip.eval()
    return torch.cat([proxy_scores(clip, tok, data["images"][i], [data["prompts"][j] for j in i.tolist()])
                      for i in torch.arange(len(data["images"])).split(batch)])


def labelled_pairs(policy, metas: list[dict], seed_key: str, args) -> dict:
    """Two samples of each prompt, their gold and a Bradley-Terry label per pair; noise and labels on generators
    keyed by `seed_key` and the seed. -> images (2N, 3, RES, RES), prompts (2N), gold (2N,), label and p (N,)."""
    images = sample_pairs(policy, metas, fgc.generator("toy-pref", seed_key, "noise", args.seed), args.steps)
    doubled = [m for m in metas for _ in range(2)]
    gold = fgc.toy_gold(fgc.score_batch(images, doubled), fgc.colour_cleanliness(images), args.charge)
    label, p = bt_labels(gold, fgc.generator("toy-pref", seed_key, "labels", args.seed), args.temperature)
    return {"images": images, "prompts": [m["prompt"] for m in doubled], "gold": gold, "label": label, "p": p}


def split(data: dict, pairs: slice) -> dict:
    rows = slice(2 * (pairs.start or 0), None if pairs.stop is None else 2 * pairs.stop)
    return {k: v[pairs] if k in ("label", "p") else v[rows] for k, v in data.items()}


def save_proxy(clip, tok, out: Path) -> None:
    """The folder fgc.clip_reward('pickscore', out) loads: CLIPModel (fp32), CLIPImageProcessor, tokenizer."""
    from transformers import CLIPImageProcessor
    clip.save_pretrained(out)
    tok.save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": fgc.RES}, crop_size={"height": fgc.RES, "width": fgc.RES},
                       image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder to write (a CLIPModel, its processor, report.json)")
    parser.add_argument("--prompts", type=int, default=10000, help="training prompts, two samples each (10000)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of those, pairs kept for early stopping")
    parser.add_argument("--heldout-per-tag", type=int, default=256, help="held-out fgc.eval_prompts per category")
    parser.add_argument("--steps", type=int, default=10, help="ODE steps of the base samples (the script's eval)")
    parser.add_argument("--temperature", type=float, default=0.1, help="Bradley-Terry temperature of the labels")
    parser.add_argument("--charge", type=float, default=0.5, help="toy_gold's charge per extra or missing object")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (the best on validation is kept)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (cosine to 0)")
    parser.add_argument("--batch", type=int, default=128, help="pairs per step")
    parser.add_argument("--layers", type=int, default=4, help="vision transformer layers")
    parser.add_argument("--patch", type=int, default=2, help="vision patch size on the 16 px image")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, noise, labels and weights")
    parser.add_argument("--samples", default="", help="a .pt file of the sampled pairs: read if there, else written")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"error: {out} exists; choose a new folder", file=sys.stderr)
        return 2
    times, start = {}, time.time()
    if args.samples and Path(args.samples).exists():  # the times are those of the run that sampled them
        train, heldout, times = torch.load(args.samples)
    else:
        policy = fgc.load_toy(fgc.Args(), "cpu")
        train = labelled_pairs(policy, fgc.train_prompts(args.prompts, random.Random(args.seed)), "train", args)
        times["sample_train_s"], start = time.time() - start, time.time()
        heldout = labelled_pairs(policy, fgc.eval_prompts(args.heldout_per_tag), "heldout", args)
        times["sample_heldout_s"], start = time.time() - start, time.time()
        if args.samples:
            torch.save((train, heldout, times), args.samples)
    n_val = round(args.prompts * args.val_fraction)
    train, val = split(train, slice(0, args.prompts - n_val)), split(train, slice(args.prompts - n_val, None))

    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": args.layers, "num_attention_heads": 4,
              "patch_size": args.patch}
    clip = build_proxy(fgc.TOY_BASE / "text_encoder", vision, args.seed)
    tok = proxy_tokenizer(fgc.TOY_BASE / "tokenizer")
    clip, epoch, val_agreement = train_proxy(clip, tok, train, val, args.epochs, args.lr, args.batch, args.seed)
    times["train_s"], start = time.time() - start, time.time()
    save_proxy(clip, tok, out)

    reward = fgc.clip_reward("pickscore", str(out), "cpu")  # the held-out numbers come through the script's path
    with torch.no_grad():
        s = torch.cat([reward(heldout["images"][i], [{"prompt": heldout["prompts"][j]} for j in i.tolist()])
                       for i in torch.arange(len(heldout["images"])).split(1000)])
    torch.testing.assert_close(s, score_all(clip, tok, heldout), atol=1e-4, rtol=1e-4)
    gold, label = heldout["gold"], heldout["label"]
    ordered = gold[0::2] != gold[1::2]  # (P,) pairs the gold orders
    gold_first, clean = (gold[0::2] > gold[1::2]).float(), fgc.colour_cleanliness(heldout["images"])
    report = {
        "heldout_label_agreement": agreement(s, label),
        "heldout_gold_order_agreement": agreement(s.view(-1, 2)[ordered].flatten(), gold_first[ordered]),
        "heldout_label_ceiling": float(torch.maximum(heldout["p"], 1 - heldout["p"]).mean()),
        "heldout_gold_label_agreement": agreement(gold, label),
        "heldout_pearson": float(torch.corrcoef(torch.stack([s, gold]))[0, 1]),
        "heldout_pairs": len(label), "heldout_pairs_gold_ordered": int(ordered.sum()),
        "train_pairs": len(train["label"]), "val_pairs": len(val["label"]), "best_epoch": epoch,
        "val_label_agreement": val_agreement, "parameters": sum(p.numel() for p in clip.parameters()),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "gold_mean_sd": [float(gold.mean()), float(gold.std())],
        "cleanliness_mean_sd": [float(clean.mean()), float(clean.std())],
        **times, "evaluate_s": time.time() - start}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
