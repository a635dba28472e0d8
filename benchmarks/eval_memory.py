"""Long-context evaluation: time and peak memory of ALiBi, sinusoidal and the fork.

    python benchmarks/eval_memory.py                      # 1K..16K, 2 passes, ~10 min on 2 cores
    python benchmarks/eval_memory.py --lengths 1024 2048 --repeats 1   # quick look
    python benchmarks/eval_memory.py --device cuda --dtype bfloat16 --lengths 16384 32768 65536 \
        --methods alibi sinusoidal --repeats 1                             # a GPU

Every cell (method x length x pass) runs in a fresh subprocess, so its peak
resident memory (``ru_maxrss``, the kernel's high-water mark) belongs to that
cell alone.  A cell builds the model exactly as fairseq-train would, warms it up
on 64 tokens, then scores one sequence of the given length (batch 1) with
fairseq's own ``SequenceScorer`` under ``torch.no_grad()`` -- what
``fairseq-eval-lm`` does per batch: decoder forward, full-vocabulary
log-softmax, gather of the target log-probs.  Cells are interleaved (each pass
visits the methods in a rotated order) and the table reports medians over passes.

Methods (same sizes, same vocabulary, same weights initialisation seed):

* ``alibi``: ``transformer_lm_alibi`` with ``alibi_attention=auto`` (the
  linear-memory chunked path past ``CHUNK_THRESHOLD``);
* ``sinusoidal``: stock ``transformer_lm`` as users get it (fairseq builds a
  ``T x T`` float future mask and hands it to SDPA);
* ``fork``: the reference fork's approach rebuilt here only: no position
  embeddings and, instead of the future mask, a ``[B*H, T, T]`` tensor holding
  the future mask plus the ``+m*j`` ALiBi bias, built once and used by every layer.

The ``--features`` variant stops after the decoder stack (no vocabulary
projection), which isolates the attention's own memory from the ``T x V`` logits.

``--device cuda``: the model and the sequence on the GPU (``--dtype`` of the
weights), peak = ``torch.cuda.max_memory_allocated`` of the scored forward
(``peak_mib``; ``ready_mib`` is what was allocated before it), times after
``torch.cuda.synchronize``.  A cell that runs out of GPU memory is reported
as such.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHODS = ("alibi", "sinusoidal", "fork")
ARCH = {"alibi": "transformer_lm_alibi", "sinusoidal": "transformer_lm", "fork": "transformer_lm"}


def rss_mib() -> float:
    """The process's high-water mark of resident memory, MiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024.0)


#: The environment of a cell that measures memory: glibc hands every block of
#: 64 KiB or more back to the system when it is freed (a fixed mmap threshold;
#: by default the threshold rises after the first large free, and freed heap
#: stays resident), so that resident memory follows the tensors a forward holds
#: at once, not what earlier calls left in the heap.  Other C libraries ignore it.
MEASURED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise OSError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Lower the kernel's high-water mark of this process's resident memory to
    what it holds now (``5`` into ``/proc/self/clear_refs``, Linux 4.0 and
    later), so that ``status_mib("VmHWM")`` is then the peak of what follows;
    False where that cannot be done (the caller falls back to ``ru_maxrss``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def install_fork_mask(decoder, num_heads: int, batch: int) -> None:
    """The fork's decoder mask: future mask + ``+m*j`` bias, ``[batch*H, T, T]``,
    cached and shared by all layers (rebuilt here for the comparison only)."""
    import torch
    from fairseq import utils
    from fairseq_alibi.core import alibi

    slopes = alibi.get_slopes(num_heads)
    cache = {}

    def buffered_future_mask(tensor):
        dim = tensor.size(0)
        if cache.get("dim", 0) < dim:
            cache.clear()
            future = torch.triu(utils.fill_with_neg_inf(torch.zeros([dim, dim])), 1)
            bias = slopes[:, None, None] * torch.arange(dim)[None, None, :].expand(num_heads, dim, -1)
            bias = bias.repeat(batch, 1, 1)
            cache["mask"] = future[None] + bias
            cache["dim"] = dim
            del future, bias
        return cache["mask"][:, :dim, :dim].to(tensor)

    decoder.buffered_future_mask = buffered_future_mask
    decoder.embed_positions = None


def run_cell(opts) -> dict:
    import torch
    from common import build_lm, make_dict_dir, model_args
    from fairseq.sequence_scorer import SequenceScorer

    device = torch.device(opts.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    data_dir = make_dict_dir(opts.vocab)
    extra = model_args(opts.embed_dim, opts.layers, opts.heads, opts.ffn, dropout=0.0)
    if opts.method == "fork":
        extra.append("--no-token-positional-embeddings")
    task, model, _, _ = build_lm(ARCH[opts.method], data_dir, extra, tokens_per_sample=opts.length)
    model = model.to(device=device, dtype=getattr(torch, opts.dtype)).eval()
    if opts.method == "fork":
        install_fork_mask(model.decoder, opts.heads, batch=1)
    scorer = SequenceScorer(task.target_dictionary)

    def sample(length):
        tokens = torch.randint(4, opts.vocab, (1, length + 1), generator=torch.Generator().manual_seed(length))
        tokens = tokens.to(device)
        return {
            "net_input": {"src_tokens": tokens[:, :-1], "src_lengths": torch.tensor([length], device=device)},
            "target": tokens[:, 1:],
            "ntokens": length,
        }

    def forward(s):
        if opts.features:
            with torch.no_grad():
                return model.decoder.extract_features(s["net_input"]["src_tokens"], None)[0].sum()
        return scorer.generate([model], s)[0][0]["positional_scores"].sum()

    # Lazy initialisation and allocator warm-up; two lengths, so that a compiled
    # kernel (ALiBi's flex on a GPU) has its length-generic graph before the clock
    # starts: on the H100 the first 16K cell of one pass timed a recompilation
    # (ALiBi 1.77 s at 16K, 0.75 s at 32K).
    forward(sample(64))
    forward(sample(96))
    s = sample(opts.length)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ready = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mib()
    start = time.perf_counter()
    try:
        total = float(forward(s))
    except torch.cuda.OutOfMemoryError:
        return {"method": opts.method, "length": opts.length, "failed": "out of GPU memory"}
    elapsed = time.perf_counter() - start
    return {
        "method": opts.method,
        "length": opts.length,
        "seconds": elapsed,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib(),
        "ready_mib": ready,
        "finite": bool(torch.isfinite(torch.tensor(total))),
        "params": sum(p.numel() for p in model.parameters()),
    }


def fork_mask_gib(length: int, heads: int) -> float:
    return heads * length * length * 4 / 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=2, help="passes over all cells")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--features", action="store_true", help="decoder stack only, no vocabulary projection")
    p.add_argument("--memory-fraction", type=float, default=0.6,
                   help="skip a fork cell whose mask alone would exceed this fraction of MemAvailable "
                   "(the machine may be shared; an OOM would hit other people's jobs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", help="write all cells here")
    p.add_argument("--cell-method", help=argparse.SUPPRESS)
    p.add_argument("--cell-length", type=int, help=argparse.SUPPRESS)
    opts = p.parse_args()

    if opts.cell_method:
        opts.method, opts.length = opts.cell_method, opts.cell_length
        print("CELL " + json.dumps(run_cell(opts)), flush=True)
        return

    from common import device_name, machine_description, median

    cells = []
    for r in range(opts.repeats):
        for length in opts.lengths:
            shift = (r + opts.lengths.index(length)) % len(opts.methods)
            for method in opts.methods[shift:] + opts.methods[:shift]:
                if method == "fork":
                    need = 2 * fork_mask_gib(length, opts.heads)  # the mask and the sum that builds it
                    if need > opts.memory_fraction * mem_available_gib():
                        print(f"pass {r} {method:10s} {length:6d}: skipped, needs ~{need:.0f} GiB for the mask")
                        cells.append({"method": method, "length": length, "skipped": f"~{need:.0f} GiB mask"})
                        continue
                cmd = [sys.executable, os.path.abspath(__file__), "--cell-method", method,
                       "--cell-length", str(length), "--vocab", str(opts.vocab),
                       "--embed-dim", str(opts.embed_dim), "--layers", str(opts.layers),
                       "--heads", str(opts.heads), "--ffn", str(opts.ffn), "--device", opts.device,
                       "--dtype", opts.dtype]
                if opts.features:
                    cmd.append("--features")
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("CELL ")]
                if proc.returncode != 0 or not lines:
                    print(f"pass {r} {method:10s} {length:6d}: FAILED rc={proc.returncode}\n{proc.stderr[-2000:]}")
                    cells.append({"method": method, "length": length, "failed": proc.returncode})
                    continue
                cell = json.loads(lines[-1][5:])
                cell["pass"] = r
                cells.append(cell)
                if "failed" in cell:
                    print(f"pass {r} {method:10s} {length:6d}: {cell['failed']}", flush=True)
                    continue
                print(f"pass {r} {method:10s} {length:6d}: {cell['seconds']:7.2f} s  "
                      f"peak {cell['peak_mib']:8.0f} MiB (after warm-up {cell['ready_mib']:.0f})", flush=True)

    print(f"\nmachine: {machine_description()}")
    print(f"model: {opts.layers} layers, d={opts.embed_dim}, {opts.heads} heads, ffn {opts.ffn}, "
          f"vocab {opts.vocab}, batch 1{', decoder features only' if opts.features else ''}")
    header = "| tokens | " + " | ".join(f"{m} s | {m} peak MiB" for m in opts.methods)
    header += " | alibi/sin peak | alibi/sin time |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(opts.methods) + 2))
    summary = {}
    for length in opts.lengths:
        row = [f"| {length}"]
        for method in opts.methods:
            done = [c for c in cells if c["method"] == method and c["length"] == length and "seconds" in c]
            if done:
                t, m = median([c["seconds"] for c in done]), median([c["peak_mib"] for c in done])
                summary[(method, length)] = (t, m)
                row += [f"{t:.2f}", f"{m:.0f}"]
            else:
                why = next((c.get("skipped") or c.get("failed") or "failed" for c in cells
                            if c["method"] == method and c["length"] == length), "-")
                row += ["-", f"not run ({why})"]
        a, s = summary.get(("alibi", length)), summary.get(("sinusoidal", length))
        row += [f"{a[1] / s[1]:.2f}", f"{a[0] / s[0]:.2f}"] if a and s else ["-", "-"]
        print(" | ".join(row) + " |")
    if opts.json:
        import torch  # the cells' own (one environment)

        with open(opts.json, "w") as f:
            json.dump({"machine": machine_description(), "device": device_name(opts.device),
                       "torch": torch.__version__, "config": vars(opts), "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
