"""`detgate bench train`: the trainer's forward + backward against plain Hugging Face
transformers on the same model, weights, batch and dtype, in one run.

One iteration = the per-token logprobs of a [B, T] batch (every position after the first),
their sum as the loss, and its backward pass down to the weights. Three sides, interleaved so
that other load on a shared machine hits them alike:
- `batch_invariant`: detgate.train.Policy (logprobs bit for bit the sampler's): the worker's
  kernels forward, torch arithmetic backward, fp32 master weights rounded to the dtype each
  forward (that rounding and the fp32 gradients are part of its cost);
- `default`: the same Policy on plain torch ops (train/reference.py): what our code costs
  without the kernels;
- `transformers`: AutoModelForCausalLM in the dtype (its weights are the policy's serving
  weights), eager, SDPA attention.
The ratio is batch_invariant's time over transformers' (goal <= 1.3x). CPU: one thread by
default, minimum over repeats (the convention of `detgate bench kernels --device cpu`), in wall
time and in process CPU time (on a shared machine the wall time also counts the time other
processes held the core); CUDA: the median wall time, synchronised.

    detgate bench train                                  # SmolLM2-135M on the CPU, fp32
    detgate bench train --device cuda --preset qwen3-8b-shape --layers 4 --dtype bfloat16 \\
        --batch 8 --seq-len 1024                          # the Qwen3-8B shape on a GPU
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.train import Policy

SIDES = ("batch_invariant", "default", "transformers")


def build(args, folder: Path) -> tuple[Policy, Policy, torch.nn.Module]:
    """(batch_invariant policy, default policy, transformers model), one set of weights."""
    if args.preset:
        from detgate.worker.tools.make_model import PRESETS
        from detgate.worker.tools.random_model import load_random

        preset = PRESETS[args.preset]
        if args.layers:
            preset = dataclasses.replace(preset, num_layers=args.layers)
        loaded = load_random(preset, folder, seed=0, device=args.device,
                             mode="batch_invariant", dtype="float32")
        policy = Policy(loaded, folder, dtype=args.dtype)
    else:
        policy = Policy.from_pretrained(args.model, dtype=args.dtype, device=args.device)
        folder = policy.folder
    return policy, policy.with_mode("default"), _transformers_model(folder, policy, args)


def _transformers_model(folder: Path, policy: Policy, args) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    if args.layers:
        config.num_hidden_layers = args.layers
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                              attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(policy.serving_state_dict(), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"transformers model: missing {missing}, unexpected {unexpected}")
    return model.train()


def _iteration(side: str, model, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        model.zero_grad(set_to_none=True)
        if side == "transformers":
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), -1).gather(2, ids[:, 1:, None])
            loss = logprobs.sum()
        else:
            loss = model.token_logprobs(ids, attention_mask=mask).sum()
        loss.backward()
        return loss.item()

    return run


def _timed(run: Callable[[], float], cuda: bool) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one iteration."""
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(args) -> int:
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        policy, reference, hf = build(args, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, policy.config.vocab_size, (args.batch, args.seq_len),
                            generator=gen).to(args.device)
        mask = torch.ones_like(ids)
        runs = {"batch_invariant": _iteration("batch_invariant", policy, ids, mask),
                "default": _iteration("default", reference, ids, mask),
                "transformers": _iteration("transformers", hf, ids, mask)}
        losses = {side: run() for side, run in runs.items()}  # warm-up (Triton compiles)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        cpu_times: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):
            for side in SIDES:
                wall, cpu = _timed(runs[side], cuda)
                times[side].append(wall)
                cpu_times[side].append(cpu)
    pick = statistics.median if cuda else min
    seconds = {side: pick(t) for side, t in times.items()}
    cpu_seconds = {side: min(t) for side, t in cpu_times.items()}
    report = {
        "benchmark": "train", "date": utc_now(), "commit": git_commit(),
        "versions": versions("torch", "transformers", "triton"),
        "device": torch.cuda.get_device_name() if cuda else cpu_model(),
        "threads": None if cuda else torch.get_num_threads(),
        "model": args.preset or args.model, "layers": policy.config.num_layers,
        "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
        "statistic": "median" if cuda else "min", "seconds": seconds, "all_seconds": times,
        "losses": losses,
        "ratio_batch_invariant_over_transformers":
            seconds["batch_invariant"] / seconds["transformers"],
        "ratio_default_over_transformers": seconds["default"] / seconds["transformers"],
    }
    if not cuda:  # one thread: the CPU time a side used, whatever else the machine ran
        report |= {"cpu_seconds": cpu_seconds, "all_cpu_seconds": cpu_times,
                   "cpu_ratio_batch_invariant_over_transformers":
                       cpu_seconds["batch_invariant"] / cpu_seconds["transformers"]}
    path = save_result(report, f"train-{'cuda' if cuda else 'cpu'}-{args.dtype}", args.json)
    for side in SIDES:
        cpu = "" if cuda else f" ({cpu_seconds[side]:.3f} s CPU time)"
        print(f"{side:>16}: {seconds[side]:.3f} s forward + backward{cpu}")
    ratio = report["ratio_batch_invariant_over_transformers"]
    print(f"batch_invariant / transformers = {ratio:.2f}x (goal <= 1.3x); default / "
          f"transformers = {report['ratio_default_over_transformers']:.2f}x; saved {path}")
    if not cuda:
        print(f"in CPU time: batch_invariant / transformers = "
              f"{report['cpu_ratio_batch_invariant_over_transformers']:.2f}x")
    return 0
