"""Speed and memory of a method's iterations: python notebooks/benchmark.py --repeat 3 [flags of the script].

Builds the run as training does, then times `--repeat` iterations after an untimed warm-up one: seconds per phase
(encoding, sampling, reward, update), images per second and peak memory. It writes no files."""
import argparse
import collections
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flow_grpo_credit as fgc  # noqa: E402


def benchmark(args: fgc.Args, repeat: int = 3) -> dict:
    """Mean seconds of each phase over `repeat` iterations, the work they did, images/s, peak memory."""
    args, dist = fgc.validate(args), fgc.Dist(device=fgc.resolve_device(args.device))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise fgc.UsageError("the benchmark measures one process on one device; run it without torchrun")
    trainer, cuda = fgc.setup(args, dist), dist.device.type == "cuda"
    spent, sync = collections.Counter(), torch.cuda.synchronize if cuda else (lambda: None)

    def timed(phase, fn, *a):  # fn(*a), its seconds added to spent[phase]
        sync()
        start = time.perf_counter()
        out = fn(*a)
        sync()
        spent[phase] += time.perf_counter() - start
        return out

    def iteration(it: int) -> dict:
        spent.clear()
        ctx = timed("encode_s", fgc.iteration_context, args, trainer, it, fgc.Meter())
        ctx.reward_fn = lambda images, metas, score=ctx.reward_fn: timed("reward_s", score, images, metas)
        transitions, _ = timed("sample_s", fgc.METHODS[args.method].assign, ctx)
        stats = timed("train_s", fgc.update, trainer.policy, trainer.opt, ctx.cond, transitions, args, ctx.gen,
                      dist, ctx.meter)  # the meter counts the training's passes too
        spent["sample_s"] -= spent["reward_s"]  # the reward ran inside the sampling phase
        return dict(spent, passes=ctx.meter.nfe, images=ctx.meter.images_scored, transitions=stats.get("trained", 0))

    iteration(0)  # warm-up: kernels, allocator and caches
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
    runs = [iteration(it) for it in tqdm(range(1, repeat + 1), desc="benchmark")]
    mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    total = sum(mean[k] for k in ("encode_s", "sample_s", "reward_s", "train_s"))
    memory = ({"peak_allocated_gb": torch.cuda.max_memory_allocated(dist.device) / 1e9,
               "peak_reserved_gb": torch.cuda.max_memory_reserved(dist.device) / 1e9} if cuda
              else {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9})  # Linux: KiB
    device = torch.cuda.get_device_name(dist.device) if cuda else "cpu"
    result = {"method": args.method, "model": args.model, "device": device, **mean, "total_s": total,
              "images_per_s": mean["images"] / total, **memory}
    print("\n".join(f"{k:18} {v:.4g}" if isinstance(v, float) else f"{k:18} {v}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Every other flag is the script's.")
    parser.add_argument("--repeat", type=int, default=3, help="timed iterations after the warm-up (default: 3)")
    known, rest = parser.parse_known_args(argv)
    try:
        if known.repeat < 1:
            raise fgc.UsageError(f"--repeat must be >= 1, got {known.repeat}")
        benchmark(fgc.parse_args(rest), known.repeat)
    except fgc.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
