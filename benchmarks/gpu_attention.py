"""GPU benchmarks (not run in the session that wrote them: no GPU was available).

    python benchmarks/gpu_attention.py                 # both parts, ~5 minutes on one H100
    python benchmarks/gpu_attention.py --part kernels  # attention only
    python benchmarks/gpu_attention.py --part train    # model training words/s only
    python -m pytest -q tests/test_attention.py -k cuda   # the CUDA correctness tests first

Part ``kernels``: one attention call, forward + backward, bf16, 16 heads of 64
(d=1024) and a fixed 16K tokens per call (batch = 16384 / T), at T = 2K..16K:

* ``flash-causal``: SDPA with ``is_causal=True`` and no bias (the flash kernel):
  the speed limit, what a position-free causal model would cost;
* ``alibi-flex``: this package's ``flex`` path (compiled FlexAttention, ALiBi
  score_mod, causal block mask);
* ``alibi-sdpa``: this package's ``sdpa`` path (one ``[1, H, T, T]`` bias
  broadcast over the batch, memory-efficient kernel) -- skipped where the bias
  alone would not fit.

Reports median milliseconds (CUDA events, interleaved repeats) and the peak
memory of each call; the ratio column is time / flash-causal.

Part ``train``: words/s of ``transformer_lm_wiki103_alibi`` against
``transformer_lm_wiki103`` (the paper's 247M model with adaptive input/softmax,
vocabulary 267,735), built as fairseq-train builds them, bf16 autocast, Adam,
alternating update by update; the ratio is the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_lm, machine_description, make_dict_dir, median  # noqa: E402

from fairseq_alibi.core import kernels as K  # noqa: E402
from fairseq_alibi.core.bias import AlibiBias  # noqa: E402


def timed(fn, device):
    """(milliseconds, peak MiB) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop), (torch.cuda.max_memory_allocated() - base) / 2**20
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3, float("nan")


#: The attention call part ``kernels`` times: 16 heads of 64 (d=1024).
HEADS, HEAD_DIM = 16, 64


def kernel_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def kernels(opts, device):
    heads, head_dim = HEADS, HEAD_DIM
    dtype = kernel_dtype(device)
    shared = AlibiBias(heads)
    rows = []
    print("| T | batch | path | ms fwd+bwd (median) | peak MiB | time / flash-causal |")
    print("|---|---|---|---|---|---|")
    for length in opts.lengths:
        batch = max(1, opts.tokens // length)
        q, k, v = (
            torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)

        def flash():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        def flex():
            K.flex_kernel(q, k, v, shared, None, 0.0)[0].backward(grad)

        def sdpa():
            bias = shared.dense(length, length, dtype, device)
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None]).backward(grad)

        paths = {"flash-causal": flash}
        if device.type == "cuda" and K.flex_available():
            paths["alibi-flex"] = flex
        dense_gib = heads * length * length * torch.finfo(dtype).bits / 8 / 2**30
        if dense_gib < opts.max_dense_gib:
            paths["alibi-sdpa"] = sdpa
        results = {name: [] for name in paths}
        names = list(paths)
        for r in range(opts.repeats + 1):  # first pass: warm-up / compilation
            for name in names[r % len(names):] + names[: r % len(names)]:
                ms, mib = timed(paths[name], device)
                q.grad = k.grad = v.grad = None
                if r:
                    results[name].append((ms, mib))
        base = median([ms for ms, _ in results["flash-causal"]])
        for name in names:
            ms = median([m for m, _ in results[name]])
            mib = max(m for _, m in results[name])
            print(f"| {length} | {batch} | {name} | {ms:.2f} | {mib:.0f} | {ms / base:.2f} |", flush=True)
            rows.append(dict(length=length, batch=batch, path=name, ms=ms, peak_mib=mib, ratio=ms / base))
        for name in ("alibi-sdpa",):
            if name not in paths:
                print(f"| {length} | {batch} | {name} | skipped: dense bias {dense_gib:.1f} GiB | | |")
        shared._dense = shared._dense_key = None
        del q, k, v, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def train(opts, device):
    data_dir = make_dict_dir(opts.vocab)
    common = [
        "--criterion", opts.criterion, "--optimizer", "adam", "--lr", "1e-4",
        "--attention-dropout", "0.0",  # flex has no attention dropout (the paper's setting too)
    ]
    runs = {}
    for name, arch in (("sinusoidal", opts.arch), ("alibi", f"{opts.arch}_alibi")):
        task, model, criterion, cfg = build_lm(arch, data_dir, common, opts.length)
        model = model.to(device).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        runs[name] = dict(model=model, criterion=criterion, optimizer=optimizer, wps=[],
                          params=sum(p.numel() for p in model.parameters()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, opts.vocab, (opts.batch, opts.length + 1), generator=gen).to(device)
    sample = {
        "id": torch.arange(opts.batch, device=device),
        "nsentences": opts.batch,
        "ntokens": opts.batch * opts.length,
        "net_input": {"src_tokens": tokens[:, :-1].contiguous(),
                      "src_lengths": torch.full((opts.batch,), opts.length, device=device)},
        "target": tokens[:, 1:].contiguous(),
    }

    def step(run):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, sample_size, _ = run["criterion"](run["model"], sample)
        (loss / sample_size).backward()
        run["optimizer"].step()
        run["optimizer"].zero_grad(set_to_none=True)

    def timed_steps(run, n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            step(run)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return n * sample["ntokens"] / (time.perf_counter() - t)

    for run in runs.values():
        timed_steps(run, opts.warmup)
    ratios = []
    for r in range(opts.rounds):
        order = ("sinusoidal", "alibi") if r % 2 == 0 else ("alibi", "sinusoidal")
        wps = {name: timed_steps(runs[name], opts.steps) for name in order}
        for name in order:
            runs[name]["wps"].append(wps[name])
        ratios.append(wps["alibi"] / wps["sinusoidal"])
    print(f"{opts.arch}: params sinusoidal {runs['sinusoidal']['params']:,}, alibi {runs['alibi']['params']:,}; "
          f"T={opts.length}, batch {opts.batch}")
    for name, run in runs.items():
        print(f"  {name}: median {median(run['wps']):.0f} words/s")
    print(f"  alibi / sinusoidal words/s: median ratio {median(ratios):.3f} over {opts.rounds} rounds "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["kernels", "train", "both"], default="both")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per attention call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-dense-gib", type=float, default=16.0)
    p.add_argument("--arch", default="transformer_lm_wiki103")
    p.add_argument("--vocab", type=int, default=267735)
    p.add_argument("--criterion", default="adaptive_loss", help="adaptive_loss for the wiki103 archs")
    p.add_argument("--length", type=int, default=512, help="training tokens per sample")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the kernel rows here")
    opts = p.parse_args()
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU (see docs/performance.md)")
    print(machine_description())
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device))
    if opts.part in ("kernels", "both"):
        rows = kernels(opts, device)
        if opts.json:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_description()
            with open(opts.json, "w") as f:
                config = {"dtype": str(kernel_dtype(device)).replace("torch.", ""), "heads": HEADS,
                          "head_dim": HEAD_DIM, "tokens": opts.tokens, "repeats": opts.repeats}
                json.dump({"device": name, "torch": torch.__version__, "config": config, "rows": rows}, f, indent=1)
    if opts.part in ("train", "both"):
        train(opts, device)


if __name__ == "__main__":
    main()
