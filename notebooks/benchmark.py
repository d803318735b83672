"""Speed and memory of a method's iterations: python notebooks/benchmark.py --repeat 3 [flags of the script].

Builds the run as training does, then times `--repeat` iterations: seconds per phase (encoding, sampling, reward,
update), images per second, peak memory, and each phase's FLOPs, which torch.utils.flop_counter counts in an untimed
run of the same iteration just before (the first also warms kernels, allocator and caches), the achieved TFLOP/s and
the MFU against the device's dense bf16 peak. It writes no files.

--architecture sd3.5-medium or flux.1-dev builds that pipeline and PickScore's CLIP-H in memory from the configs in
assets/architectures/, with random weights (speed and memory do not depend on their values), and runs the README's
recipe unless flags say otherwise; --layers N keeps N layers of every stack for quick checks."""
import argparse
import collections
import contextlib
import copy
import json
import os
import resource
import sys
import time
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flow_grpo_credit as fgc  # noqa: E402

ARCHITECTURES = Path(__file__).resolve().parent.parent / "assets" / "architectures"
RECIPE = ["--method", "chunk", "--group-size", "24", "--prompts-per-iter", "4", "--noise-level", "0.7",
          "--beta", "0.001"]  # the README's SD3.5 command; steps 10, 512 px, micro-batch 4, LoRA r 32 are defaults
LAYERS = {"SD3Transformer2DModel": ["num_layers"], "FluxTransformer2DModel": ["num_layers", "num_single_layers"],
          "CLIPTextModel": ["num_hidden_layers"], "CLIPTextModelWithProjection": ["num_hidden_layers"],
          "T5EncoderModel": ["num_layers"], "CLIPModel": ["text_config.num_hidden_layers",
                                                          "vision_config.num_hidden_layers"]}  # each stack's depth
PEAK_TFLOPS = {"B200": 2250, "H200": 989, "H100 PCIe": 756, "H100": 989, "H20": 148, "A100": 312, "L40S": 362,
               "L40": 181, "L4": 121, "A10G": 70, "A10": 125, "RTX 6000 Ada": 364, "A6000": 155, "RTX 5090": 209,
               "RTX 4090": 165, "RTX 3090": 71}  # dense bf16 tensor TFLOP/s by NVIDIA's data sheets; first match wins


def architecture(name: str) -> dict:
    path = ARCHITECTURES / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in ARCHITECTURES.glob("*.json") if p.stem != "pickscore"))
        raise fgc.UsageError(f"--architecture {name!r}: no {path.name} in {ARCHITECTURES}; choose {known}")
    return json.loads(path.read_text())


def build_module(part: dict, layers: int = 0, device="meta", dtype=torch.float32) -> torch.nn.Module:
    """A component from its config, `layers` (> 0) layers to each stack: on the meta device (no memory), or with
    random weights on `device`, N(0, 0.02) drawn once and tiled (values do not change the cost; drawing all: slow)."""
    import diffusers
    import transformers
    config = copy.deepcopy(part["config"])
    for key in LAYERS.get(part["class"], []) if layers else []:
        *outer, last = key.split(".")
        inner = config[outer[0]] if outer else config
        inner[last] = min(layers, inner[last])
    if "dual_attention_layers" in config:
        config["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < config["num_layers"]]
    with torch.device("meta"):
        if hasattr(diffusers, part["class"]):
            module = getattr(diffusers, part["class"]).from_config(config)
        else:
            kind = config.pop("model_type")
            module = getattr(transformers, part["class"])(transformers.AutoConfig.for_model(kind, **config))
    if str(device) != "meta":
        pool = (torch.randn((1 << 20) + 7, generator=torch.Generator().manual_seed(0)) * 0.02).to(device, dtype)
        made = {}
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, t in store.items():
                    if t is not None and t.is_meta and id(t) not in made:
                        made[id(t)] = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point()
                                                  else t.dtype)
                        flat = made[id(t)].view(-1)
                        if t.is_floating_point():
                            for i in range(0, len(flat), len(pool)):
                                flat[i:i + len(pool)] = pool[: len(flat) - i]
                        else:  # integer buffers are position ids
                            made[id(t)].copy_(torch.arange(t.shape[-1]).expand(t.shape))
                        if store is sub._parameters:
                            made[id(t)] = torch.nn.Parameter(made[id(t)], requires_grad=t.requires_grad)
                    if t is not None and id(t) in made:
                        store[name] = made[id(t)]
    return module.eval()


class Tokenizer:
    """Stands in for a tokenizer whose vocabulary files are not here: ids in [0, vocab_size) from each word's hash,
    padded to the lengths the pipelines ask for (at most `cap`), so the text encoders do the real work."""

    added_tokens_encoder = {}

    def __init__(self, vocab_size: int, model_max_length: int, cap: int = 0, **_):
        self.vocab_size, self.model_max_length, self.cap = vocab_size, model_max_length, cap

    def tokenize(self, text: str) -> list[str]:
        return text.split()

    def __call__(self, text, padding=False, max_length=None, truncation=False, return_tensors=None, **_):
        from transformers import BatchEncoding
        texts = [text] if isinstance(text, str) else list(text)
        ids = [[zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in t.split()] + [self.vocab_size - 1]
               for t in texts]  # the last id ends each text
        length = max_length if padding == "max_length" else max(map(len, ids))
        if truncation or padding == "max_length":
            length = min(length, max_length or self.model_max_length)
        length = min(length, self.cap or length)
        ids = torch.tensor([(row + [0] * length)[:length] for row in ids])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def batch_decode(self, ids, **_) -> list[str]:
        return [" ".join(map(str, row.tolist())) for row in ids]


def build_pipeline(name: str, layers: int, device, dtype, text_tokens: int = 0):
    """The architecture's diffusers pipeline with random weights in `dtype` on `device`."""
    import diffusers
    parts = {}
    for key, part in architecture(name)["components"].items():
        if part["class"] == "tokenizer":
            parts[key] = Tokenizer(**part, cap=text_tokens)
        elif key == "scheduler":
            parts[key] = getattr(diffusers, part["class"]).from_config(part["config"])
        else:
            parts[key] = build_module(part, layers, device, dtype)
    return getattr(diffusers, architecture(name)["pipeline"])(**parts)


def build_pickscore(layers: int, device, text_tokens: int = 0):
    """PickScore at random weights in float32 (as training loads it): exp(logit_scale) cos(E_img, E_txt) / 26, the
    formula of flow_grpo_credit.clip_reward, on CLIP-H's input size and normalisation."""
    spec = architecture("pickscore")["components"]
    clip = build_module(spec["model"], layers, device).requires_grad_(False)
    tok, size = Tokenizer(**spec["tokenizer"], cap=text_tokens), clip.config.vision_config.image_size
    mean, std = (torch.tensor(spec[k], device=device).view(1, 3, 1, 1) for k in ("image_mean", "image_std"))

    def score(images: torch.Tensor, metas: list[dict]) -> torch.Tensor:
        pixels = torch.nn.functional.interpolate(images.float().to(device), size=(size, size), mode="bicubic",
                                                 antialias=True)
        text = tok([m["prompt"] for m in metas], padding=True, truncation=True, max_length=77).to(device)
        return clip(pixel_values=(pixels - mean) / std, **text).logits_per_image.diag() / 26
    return score


def flop_counter():
    """FlopCounterMode, which counts matmuls, convolutions and the CUDA attention kernels, and here also the CPU's."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *_, **__: sdpa_backward_flop_count(g, q, k, v)})


def peak_tflops(device_name: str, given: float = 0.0) -> float:
    """--peak-tflops, else the table's first name in the device's, else 0 (unknown)."""
    return given or next((v for k, v in PEAK_TFLOPS.items() if k in device_name), 0.0)


def benchmark(args: fgc.Args, repeat: int = 3, pipe=None, reward_fn=None, peak: float = 0.0) -> dict:
    """Mean seconds and FLOPs of each phase over `repeat` iterations, the work they did, images/s, TFLOP/s, MFU,
    peak memory. `pipe` (a diffusers pipeline) and `reward_fn` replace what --model and --reward would load."""
    args, dist = fgc.validate(args), fgc.Dist(device=fgc.resolve_device(args.device))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise fgc.UsageError("the benchmark measures one process on one device; run it without torchrun")
    with contextlib.ExitStack() as patches:
        if pipe is not None:
            patches.enter_context(mock.patch.object(fgc, "load_policy", lambda a, d: fgc.PipelinePolicy(pipe, a, d)))
        if reward_fn is not None:
            patches.enter_context(mock.patch.object(fgc, "build_reward", lambda a, d: reward_fn))
        trainer = fgc.setup(args, dist)
    cuda = dist.device.type == "cuda"
    spent, flops = collections.Counter(), collections.Counter()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    counter = flop_counter()

    def timed(phase, fn, *a):  # fn(*a), its seconds added to spent[phase], its FLOPs to flops[phase]
        sync()
        start, counted = time.perf_counter(), counter.get_total_flops()
        out = fn(*a)
        sync()
        spent[phase] += time.perf_counter() - start
        flops[phase] += counter.get_total_flops() - counted
        return out

    def iteration(it: int) -> dict:
        spent.clear(), flops.clear()
        ctx = timed("encode_s", fgc.iteration_context, args, trainer, it, fgc.Meter())
        ctx.reward_fn = lambda images, metas, score=ctx.reward_fn: timed("reward_s", score, images, metas)
        transitions, _ = timed("sample_s", fgc.METHODS[args.method].assign, ctx)
        stats = timed("train_s", fgc.update, trainer.policy, trainer.opt, ctx.cond, transitions, args, ctx.gen,
                      dist, ctx.meter)  # the meter counts the training's passes too
        spent["sample_s"] -= spent["reward_s"]  # the reward ran inside the sampling phase
        flops["sample_s"] -= flops["reward_s"]
        return dict(spent, **{k.replace("_s", "_tflop"): v / 1e12 for k, v in flops.items()}, passes=ctx.meter.nfe,
                    images=ctx.meter.images_scored, transitions=stats.get("trained", 0))

    runs = []
    for it in tqdm(range(1, repeat + 1), desc="benchmark"):
        with counter:  # untimed: FlopCounterMode's Python hooks slow a run several-fold; the first is the warm-up
            counted = iteration(it)
        if cuda and it == 1:
            torch.cuda.reset_peak_memory_stats(dist.device)
        getattr(trainer.policy, "cache", {}).clear()  # the timed run encodes its prompts, as training's new ones
        runs.append({**iteration(it), **{k: v for k, v in counted.items() if k.endswith("_tflop")}})
    mean = {k: float(np.mean([r.get(k, 0) for r in runs])) for k in runs[0]}
    phases = ("encode", "sample", "reward", "train")
    total, total_flop = sum(mean[f"{p}_s"] for p in phases), sum(mean[f"{p}_tflop"] for p in phases)
    memory = ({"peak_allocated_gb": torch.cuda.max_memory_allocated(dist.device) / 1e9,
               "peak_reserved_gb": torch.cuda.max_memory_reserved(dist.device) / 1e9} if cuda
              else {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9})  # Linux: KiB
    device = torch.cuda.get_device_name(dist.device) if cuda else "cpu"
    peak = peak_tflops(device, peak) if cuda or peak else 0.0
    result = {"method": args.method, "model": args.model, "device": device, **mean, "total_s": total,
              "total_tflop": total_flop, "images_per_s": mean["images"] / total, "tflop_per_s": total_flop / total,
              "mfu": total_flop / total / peak if peak else "unknown peak: give --peak-tflops", **memory}
    if args.low_memory:  # 24 GB cards hold 24 GiB, less about 1 GiB for the CUDA context
        result["fits_24gb"] = (memory["peak_reserved_gb"] * 1e9 < 23 * 2**30) if cuda else "measured on CUDA only"
    print("\n".join(f"{k:18} {v:.4g}" if isinstance(v, float) else f"{k:18} {v}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Every other flag is the script's.")
    parser.add_argument("--repeat", type=int, default=3, help="timed iterations, each after an untimed "
                        "one that counts its FLOPs (default: 3)")
    parser.add_argument("--architecture", default="", help="sd3.5-medium or flux.1-dev at random weights, with "
                        "PickScore, from assets/architectures/ (default: --model and --reward as training loads them)")
    parser.add_argument("--layers", type=int, default=0, help="with --architecture: at most N layers in every stack "
                        "(denoiser, text encoders, reward towers) for quick checks (default: all)")
    parser.add_argument("--text-tokens", type=int, default=0, help="with --architecture: at most N tokens a prompt "
                        "in every text encoder, for quick checks (default: the pipeline's, 77 CLIP and 256 or 512 T5)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak for the MFU "
                        f"(default: by name from {', '.join(PEAK_TFLOPS)})")
    known, rest = parser.parse_known_args(argv)
    try:
        if known.repeat < 1:
            raise fgc.UsageError(f"--repeat must be >= 1, got {known.repeat}")
        if min(known.layers, known.text_tokens, known.peak_tflops) < 0:
            raise fgc.UsageError("--layers, --text-tokens and --peak-tflops must be >= 0")
        pipe = reward_fn = None
        if known.architecture:
            architecture(known.architecture)
            args = fgc.parse_args([*RECIPE, *rest, "--model", known.architecture])  # later flags win
            device = fgc.resolve_device(args.device)
            dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") \
                else torch.float32  # as load_policy chooses
            start = time.perf_counter()
            pipe = build_pipeline(known.architecture, known.layers, device, dtype, known.text_tokens)
            reward_fn = build_pickscore(known.layers, device, known.text_tokens)
            print(f"built {known.architecture} ({sum(p.numel() for p in pipe.transformer.parameters()) / 1e9:.3g} "
                  f"B transformer parameters) and PickScore in {time.perf_counter() - start:.1f} s")
        else:
            args = fgc.parse_args(rest)
        benchmark(args, known.repeat, pipe, reward_fn, known.peak_tflops)
    except fgc.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError as e:
        print(f"out of memory: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
