"""What compiled FlexAttention costs a user in compilation: graphs and seconds per new shape or method.

    python benchmarks/flex_compile.py                                 # CPU (inductor's C++ backend)
    python benchmarks/flex_compile.py --device cuda --dtype bfloat16  # a GPU (Triton)

One causal ALiBi stack (the registry's ``alibi``) and one attention layer of
it (its projections identities) with the ``flex`` kernel, without gradients,
as evaluation runs it: first a sweep of ``--lengths`` (10 by
default) under no scaling, then each of ``--methods`` at two lengths (a
method's first call, then another length).  Each call's wall time is that of
its first run (compilation included, when it compiles) and of a second run
(the steady state); "new graphs" counts the graphs dynamo compiled for it.
Compilation starts from an empty inductor cache in a temporary directory and
without an earlier run's profile (local PGO), as a first run on a new
machine does; ``--warm-cache`` uses the usual cache instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DEFAULT_LENGTHS = [200, 400, 600, 800, 1000, 1200, 1400, 1600, 1800, 2000]
DEFAULT_METHODS = ["ntk", "linear:2", "cap", "cap:2", "log", "capnorm"]


def measure(opts) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from fairseq_alibi.core.scaling import Scaling
    from gpu_attention import attention_layer, build_stack

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    # ALiBi's stack from the registry and one layer of it, its kernel flex (projections identities):
    # the call evaluation makes, reached through the layer the models build.
    bias = build_stack("alibi", opts.train_length, opts.heads, opts.head_dim)
    layer = attention_layer(bias, 0, "flex", opts.heads, opts.head_dim, device, dtype)

    def timed(length: int) -> float:
        x = torch.randn(length, opts.batch, opts.heads * opts.head_dim, device=device, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            layer(x, x, x, need_weights=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def row(step: str, length: int) -> dict:
        graphs = counters["stats"]["unique_graphs"]
        first = timed(length)
        new = counters["stats"]["unique_graphs"] - graphs
        steady = timed(length)
        result = dict(step=step, length=length, new_graphs=new, first_s=first, steady_s=steady)
        print(f"{step:10s} T={length:6d}  new graphs {new}  first call {first:7.2f} s  steady {steady * 1e3:8.2f} ms",
              flush=True)
        return result

    rows = [row("none", length) for length in opts.lengths]
    for spelling in opts.methods:
        bias.rescale(Scaling.parse(spelling, opts.train_length))
        rows += [row(spelling, length) for length in (opts.lengths[-1], opts.lengths[len(opts.lengths) // 2])]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return dict(device=name, torch=torch.__version__, config={k: v for k, v in vars(opts).items() if k != "json"},
                rows=rows)


def markdown(result: dict) -> str:
    """The table of one run, and the totals of the length sweep."""
    lines = ["| calls | length | new graphs | first call s | steady call ms |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['step']} | {r['length']} | {r['new_graphs']} | {r['first_s']:.2f} | "
                     f"{r['steady_s'] * 1e3:.2f} |")
    sweep = [r for r in result["rows"] if r["step"] == "none"]
    compiled = sum(r["new_graphs"] for r in sweep)
    seconds = sum(r["first_s"] - r["steady_s"] for r in sweep if r["new_graphs"])
    lines.append("")
    lines.append(f"{result['device']}, torch {result['torch']}: {compiled} graphs for {len(sweep)} lengths, "
                 f"{seconds:.1f} s of compilation in all.")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    p.add_argument("--methods", nargs="*", default=DEFAULT_METHODS, help="--methods items, after the sweep")
    p.add_argument("--train-length", type=int, default=512, help="L of the dynamic and distance methods")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warm-cache", action="store_true", help="use the usual inductor cache and profile")
    p.add_argument("--json", help="also write the results here")
    opts = p.parse_args(argv)
    if not opts.warm_cache:  # before torch is imported
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="alibi_flex_compile_")
        os.environ["TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO"] = "0"
    import torch

    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device here")
    result = measure(opts)
    print()
    print(markdown(result))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
