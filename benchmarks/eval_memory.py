"""Long-context evaluation: time and peak memory of ALiBi, sinusoidal and the fork.

    python benchmarks/eval_memory.py                      # 1K..16K, 2 passes, ~10 min on 2 cores
    python benchmarks/eval_memory.py --lengths 1024 2048 --repeats 1   # quick look
    python benchmarks/eval_memory.py --device cuda --dtype bfloat16 --lengths 16384 32768 65536 \
        --methods alibi sinusoidal --repeats 1                             # a GPU

Every cell (method x length x pass) runs in a fresh subprocess, so its peak
resident memory (``ru_maxrss``, the kernel's high-water mark) belongs to that
cell alone.  A cell builds the model exactly as fairseq-train would, then
scores one sequence of the given length (batch 1) with fairseq's own
``SequenceScorer`` under ``torch.no_grad()`` -- what ``fairseq-eval-lm`` does
per batch: decoder forward, full-vocabulary log-softmax, gather of the target
log-probs.  The first forward warms the cell at its own length and is timed
apart (``first_s``: compilation included, e.g. ALiBi's flex on a GPU;
``warm_graphs``: the graphs it compiled); the cell's time (``seconds``) is the
median of ``--timed`` forwards after it (``times``), and ``timed_graphs``
counts what those compiled (0: the time is the kernels', not the compiler's).
Cells are interleaved (each pass visits the methods in a rotated order) and the
table reports medians over passes; ``--json`` is rewritten after every cell.

Methods (same sizes, same vocabulary, same weights initialisation seed; any
registered position method's ``transformer_lm_<name>`` too, trained at
``--train-length``):

* ``alibi``: ``transformer_lm_alibi`` with ``alibi_attention=auto`` (on a CPU
  the linear-memory chunked path past ``CHUNK_THRESHOLD``, on CUDA compiled
  FlexAttention);
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
import math
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: The default cells' methods; ``--methods`` takes every registered position method too (:func:`methods`).
METHODS = ("alibi", "sinusoidal", "fork")
ARCH = {"alibi": "transformer_lm_alibi", "sinusoidal": "transformer_lm", "fork": "transformer_lm"}


def methods():
    """Every ``--methods`` value: ``METHODS`` and the registered position methods (``core/positions.py``)."""
    from fairseq_alibi.core.positions import POSITIONS

    return list(METHODS) + [name for name in POSITIONS if name not in METHODS]


def arch(method: str) -> str:
    """The fairseq architecture of a cell's ``method``: ``transformer_lm_<method>`` for a registered one."""
    from fairseq_alibi import facts

    return ARCH.get(method) or facts.position_model(method)


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
    from common import build_lm, make_dict_dir, median, model_args
    from fairseq.sequence_scorer import SequenceScorer

    device = torch.device(opts.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    data_dir = make_dict_dir(opts.vocab)
    extra = model_args(opts.embed_dim, opts.layers, opts.heads, opts.ffn, dropout=0.0)
    if opts.method == "fork":
        extra.append("--no-token-positional-embeddings")
    if opts.method not in ARCH:  # a registered method: trained at --train-length (RNoPE's window, FIRE's threshold)
        extra += ["--alibi-train-length", str(opts.train_length)]
    task, model, _, _ = build_lm(arch(opts.method), data_dir, extra, tokens_per_sample=opts.length)
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

    # Warmed at the cell's own length: the first call compiles what it needs (ALiBi's
    # flex on a GPU: a graph for this shape) and is timed apart ("first_s"); the timed
    # calls after it run the kernels alone.  (A warm-up at 64 and 96 tokens, as before,
    # left one block of the block mask in both, so the first long call still compiled.)
    s = sample(opts.length)
    graphs = compiled_graphs()
    start = time.perf_counter()
    try:
        forward(s)
        if cuda:
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return {"method": opts.method, "length": opts.length, "failed": "out of GPU memory"}
    first = time.perf_counter() - start
    warm_graphs = compiled_graphs() - graphs
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ready = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mib()
    times, totals, graphs = [], [], compiled_graphs()
    for _ in range(opts.timed):
        start = time.perf_counter()
        try:
            totals.append(float(forward(s)))  # float(): the device's work is done
        except torch.cuda.OutOfMemoryError:
            return {"method": opts.method, "length": opts.length, "failed": "out of GPU memory"}
        times.append(time.perf_counter() - start)
    seconds = median(times)
    return {
        "method": opts.method,
        "length": opts.length,
        "seconds": seconds,
        "times": times,
        "first_s": first,
        "compile_s": max(0.0, first - seconds),
        "warm_graphs": warm_graphs,
        "timed_graphs": compiled_graphs() - graphs,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib(),
        "ready_mib": ready,
        "finite": all(math.isfinite(t) for t in totals),
        "params": sum(p.numel() for p in model.parameters()),
    }


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far in this process (0 where torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def fork_mask_gib(length: int, heads: int) -> float:
    return heads * length * length * 4 / 2**30


def main(argv=None):
    from common import positive

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=methods(),
                   help="alibi, sinusoidal, fork, or any registered position method")
    p.add_argument("--repeats", type=int, default=2, help="passes over all cells (each cell a fresh process)")
    p.add_argument("--timed", type=positive, default=1,
                   help="timed forwards per cell, after the one that warms it at its length (the median is its time)")
    p.add_argument("--train-length", type=positive, default=1024,
                   help="the training length of a registered method's model (RNoPE's window, FIRE's threshold)")
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
    opts = p.parse_args(argv)

    if opts.cell_method:
        opts.method, opts.length = opts.cell_method, opts.cell_length
        print("CELL " + json.dumps(run_cell(opts)), flush=True)
        return

    import torch  # the cells' own (one environment)
    from common import device_name, machine_description, median

    cells = []
    result = {"machine": machine_description(), "device": device_name(opts.device), "torch": torch.__version__,
              "config": vars(opts), "cells": cells, "complete": False}
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
                       "--dtype", opts.dtype, "--timed", str(opts.timed), "--train-length", str(opts.train_length)]
                if opts.features:
                    cmd.append("--features")
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("CELL ")]
                if proc.returncode != 0 or not lines:
                    print(f"pass {r} {method:10s} {length:6d}: FAILED rc={proc.returncode}\n{proc.stderr[-2000:]}")
                    cells.append({"method": method, "length": length, "failed": f"exit {proc.returncode}"})
                    write_json(opts.json, result)
                    continue
                cell = json.loads(lines[-1][5:])
                cell["pass"] = r
                cells.append(cell)
                write_json(opts.json, result)  # after every cell: a run stopped early keeps the cells it finished
                if "failed" in cell:
                    print(f"pass {r} {method:10s} {length:6d}: {cell['failed']}", flush=True)
                    continue
                print(f"pass {r} {method:10s} {length:6d}: {cell['seconds']:7.2f} s  "
                      f"peak {cell['peak_mib']:8.0f} MiB (after warm-up {cell['ready_mib']:.0f}); first call "
                      f"{cell['first_s']:.2f} s, graphs compiled {cell['warm_graphs']} warming, "
                      f"{cell['timed_graphs']} timed", flush=True)

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
    result["complete"] = True
    write_json(opts.json, result)


def write_json(path, result: dict) -> None:
    """``result`` to ``path`` where given (a new file renamed over it: a reader never sees half a file)."""
    if not path:
        return
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
