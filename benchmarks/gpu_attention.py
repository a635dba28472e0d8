"""GPU benchmarks: one attention call of every registered position method beside flash attention.

    python benchmarks/gpu_attention.py --part kernels              # attention calls, ~3-4 minutes on one H100
    python benchmarks/gpu_attention.py --part train                # the paper's 247M model's words/s
    python benchmarks/gpu_attention.py --part kernels --device cpu --lengths 64 128 --tokens 256 \\
        --heads 2 --head-dim 16 --diagnose-lengths none            # the code paths on a CPU, in seconds

Part ``kernels``: one attention call, forward and forward + backward, bf16 on
CUDA (float32 on a CPU), 16 heads of 64 (d=1024), a fixed 16K tokens per call
(batch = 16384 / T) at T = 2K..16K.  Rows, in the order they run:

1. **Every method's attention call**, at every length (``core/positions.py``'s
   registry, read when the benchmark runs: a method registered later is timed
   too): the model's own attention layer (``models.attention.PositionMultiheadAttention``,
   built on the method's stack object as the decoder builds it, its kernel
   ``auto``: what training runs), with the four projections replaced by
   identities, so the row is the method's part alone: its rotation or gates,
   the kernel ``auto`` picks, the head reshapes.  ALiBi twice: ``auto``
   (compiled FlexAttention on CUDA) and ``sdpa`` (its dense bias).  A hybrid
   stack (RNoPE) gives a row per kind of layer.  Beside them ``flash-causal``:
   SDPA with ``is_causal`` and no bias (the flash kernel), timed first and
   again last at each length (``flash-causal (again)``: the drift).
2. **ALiBi through flex with dynamic shapes**: the same ALiBi layer after
   ``torch._dynamo.reset()``, compiled with dynamic shapes (one graph for every
   length, as an evaluation over many lengths compiles it); the rows of 1.
   compile each length static (one graph per length, as training at one length).
3. **Diagnostics of ALiBi's flex call**, at ``--diagnose-lengths`` (8K by
   default; each a compilation of its own): plain ``flex_attention`` calls on
   q, k, v of ``[B, H, T, D]``, compiled per length, that split ALiBi's time:
   the causal block mask alone (no ``score_mod``); a ``score_mod`` that
   captures the slopes and nothing else, with the block mask, with two sets of
   ``kernel_options`` (:data:`KERNEL_OPTIONS`), and without the block mask
   (causality in the ``score_mod``: every block computed); the package's own
   ``score_mod`` and block mask (the layer's call without the layer), its
   ``score_mod`` with torch's ``create_block_mask``, and the slopes-only
   ``score_mod`` with the package's block mask.  Each is checked against a
   dense-bias SDPA reference of the same inputs (``max_abs_diff``).

Each row records device, torch, dtype, heads, head_dim, tokens, batch and
length; the milliseconds of the forward alone (``fwd_ms``) and of forward +
backward (``ms``; the backward is their difference), medians of
``--repeats`` interleaved readings (CUDA events); the first call's seconds
(``first_s``: compilation included where the path compiles); the peak memory of
one call; the ratios to ``flash-causal``; the kernels ``auto`` chose (``own
attention`` for a method that computes its attention itself).  A row that
runs out of memory or fails says so and the others still run.  ``--json`` is
rewritten after every row (``complete`` false until the end), so a run stopped
early keeps the rows it finished.

Part ``train``: words/s of ``transformer_lm_wiki103_alibi`` against
``transformer_lm_wiki103`` (the paper's 247M model with adaptive input/softmax,
vocabulary 267,735), built as fairseq-train builds them, bf16 autocast, Adam,
alternating update by update; the ratio is the median over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import sys
import time
import types
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_lm, device_name, machine_description, make_dict_dir, median, positive, replaced  # noqa: E402
from eval_memory import write_json  # noqa: E402

# fairseq, once imported, logs at DEBUG: not every lock the compiler takes
logging.getLogger("filelock").setLevel(logging.WARNING)

#: The attention call part ``kernels`` times: 16 heads of 64 (d=1024).
HEADS, HEAD_DIM = 16, 64
#: The depth of the stack a method's layers are built from (RNoPE's interleaving needs one).
LAYERS = 4
#: A reading slower than this (ms) is taken once: a path that slow needs no median to be seen.
SLOW_MS = 500.0
#: ``kernel_options`` tried on ALiBi's slopes-only ``score_mod`` (torch's defaults on an H100 or H200,
#: bf16, head_dim 64: forward 128 x 128 blocks, 3 stages, 4 warps; backward 64 x 128 / 128 x 64, 3 stages,
#: 8 warps; ``torch/_inductor/template_heuristics/triton.py``).  ``blocks 128x64``: the forward's key block
#: halved and the backward's blocks at 64, 4 warps: less register pressure where a ``score_mod`` adds work
#: (torch's maintainers' advice for such ``score_mod``s, pytorch/pytorch#138493); ``rows safe``: the default
#: blocks with the checks a causal mask makes unneeded skipped (every row sees a key: no fully masked row,
#: the visited blocks contiguous).
KERNEL_OPTIONS = {
    "blocks 128x64": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64,
                      "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4},
    "rows safe": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
}
#: The diagnostic rows (part 3), in the order they run: ``--diagnostics`` key -> the row's path.
DIAGNOSTICS = {
    "mask-only": "flex: block mask, no score_mod",
    "slopes": "flex: slopes-only score_mod + block mask",
    "slopes-128x64": "flex: slopes-only score_mod + block mask, blocks 128x64",
    "slopes-rows-safe": "flex: slopes-only score_mod + block mask, rows safe",
    "slopes-no-mask": "flex: slopes-only score_mod, no block mask",
    "package": "flex: package score_mod + package block mask",
    "package-score-mod": "flex: package score_mod + create_block_mask",
    "package-block-mask": "flex: slopes-only score_mod + package block mask",
}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    """(milliseconds, peak MiB above what was allocated before, None off CUDA) of one call."""
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
    return (time.perf_counter() - t) * 1e3, None


def kernel_dtype(device, name: Optional[str] = None) -> torch.dtype:
    """``--dtype`` if given, else bfloat16 on CUDA and float32 elsewhere."""
    if name:
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def configure_dynamo(shapes: str) -> None:
    """``static``: every new shape compiles a graph of its own (as training at one length);
    ``dynamic``: one graph for every length from the first call (as an evaluation over many
    lengths ends up with).  Room for a graph per length of every compiled function."""
    from torch._dynamo import config

    config.automatic_dynamic_shapes = shapes == "dynamic"
    config.assume_static_by_default = shapes != "dynamic"
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 256))


#: What a row records as ``auto``'s choice for a layer that computes its attention itself.
OWN_ATTENTION = "own attention"


@contextlib.contextmanager
def recorded_choices():
    """The kernels ``auto`` picks inside the block (``choose_kernel``), and
    :data:`OWN_ATTENTION` for a layer whose object computes its attention
    itself (``own_kernel``: ``layer.attention`` calls its ``attend`` and no
    kernel is chosen), each wrapped wherever a module of the package holds it
    (it may move between modules; nothing is recorded where it is gone)."""
    chosen: List[str] = []
    found = []
    for module, name in (("kernels", "choose_kernel"), ("layer", "attention")):
        try:
            found.append(getattr(importlib.import_module(f"fairseq_alibi.core.{module}"), name, None))
        except ImportError:
            found.append(None)
    choose, attention = found

    def recording(*args, **kwargs):
        name = choose(*args, **kwargs)
        chosen.append(name)
        return name

    def own(positions, *args, **kwargs):
        if getattr(positions, "own_kernel", False):
            chosen.append(OWN_ATTENTION)
        return attention(positions, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for original, wrapper in ((choose, recording), (attention, own)):
            if original is not None:
                stack.enter_context(replaced(original, wrapper))
        yield chosen


# ----------------------------------------------------------------- the calls timed
# Each factory returns (forward, step, reset, check): ``forward()`` the training forward
# (gradients on), ``step()`` forward + backward, ``reset()`` after a step (gradients
# dropped), ``check()`` the largest absolute difference from a reference, or None.


def qkv(batch: int, heads: int, length: int, head_dim: int, device, dtype, grad: bool = True):
    return [torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, requires_grad=grad)
            for _ in range(3)]


def flash_call(length, batch, heads, head_dim, device, dtype):
    """SDPA with ``is_causal`` and no bias: the flash kernel on CUDA."""
    q, k, v = qkv(batch, heads, length, head_dim, device, dtype)
    grad = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def reset():
        q.grad = k.grad = v.grad = None

    return forward, lambda: forward().backward(grad), reset, None


def method_paths(methods, length, heads, head_dim) -> List[dict]:
    """``{"path", "method", "kernel", "index"}`` of every row of part 1: each method's
    kinds of layer (one; a hybrid's several), ALiBi with ``auto`` and ``sdpa``."""
    from fairseq_alibi.core import positions as P

    paths = []
    for name in methods:
        stack = build_stack(name, length, heads, head_dim)
        kinds: Dict[int, tuple] = {}
        for index in range(LAYERS):
            kinds.setdefault(id(stack.at_layer(index)), (index, type(stack.at_layer(index)).__name__))
        for index, kind in kinds.values():
            for kernel in ("auto", "sdpa") if name == "alibi" else ("auto",):
                label = name if len(kinds) == 1 else f"{name}, layer {index} ({kind})"
                paths.append(dict(path=label if kernel == "auto" else f"{label} ({kernel})", method=name,
                                  kernel=kernel, index=index))
    assert all(p["method"] in P.POSITIONS for p in paths)
    return paths


def build_stack(name: str, length: int, heads: int, head_dim: int):
    """Method ``name``'s stack object with its defaults, for a model trained at ``length``
    tokens (RNoPE's window, FIRE's threshold), ``LAYERS`` layers deep."""
    from fairseq_alibi.core import positions as P
    from fairseq_alibi.core.scaling import Scaling

    entry = P.position(name)
    params = {p.name: p.default for p in entry.params}
    return P.build(name, heads, head_dim, params, Scaling.parse("none", length).complete(), LAYERS)


def attention_layer(stack, index: int, kernel: str, heads: int, head_dim: int, device, dtype):
    """Layer ``index`` of ``stack`` (a registry-built stack object), as the decoder builds it
    (``kernel``: its ``alibi_attention``), its four projections identities: its input
    ``[T, B, H * D]`` is q, k and v, and its time the method's part alone."""
    from fairseq_alibi.models.attention import PositionMultiheadAttention

    if isinstance(stack, torch.nn.Module):  # a learned bias: the stack's own parameters
        stack.to(device=device, dtype=dtype)
    layer = PositionMultiheadAttention(heads * head_dim, heads, stack.at_layer(index), kernel=kernel, dropout=0.0)
    for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
        setattr(layer, projection, torch.nn.Identity())
    return layer.to(device=device, dtype=dtype)  # its own parameters (FoX's gates)


def layer_call(method: str, index: int, kernel: str, length, batch, heads, head_dim, device, dtype):
    """Layer ``index`` of a fresh ``method`` stack (:func:`attention_layer`) on one random input."""
    stack = build_stack(method, length, heads, head_dim)
    layer = attention_layer(stack, index, kernel, heads, head_dim, device, dtype)
    x = torch.randn(length, batch, heads * head_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(length, batch, heads * head_dim, device=device, dtype=dtype)
    modules = [layer] + ([stack] if isinstance(stack, torch.nn.Module) else [])

    def forward():
        stack.start_pass()  # as the decoder does before each pass (a learned bias is rebuilt)
        return layer(x, x, x, need_weights=False)[0]

    def reset():
        x.grad = None
        for module in modules:
            module.zero_grad(set_to_none=True)

    return forward, lambda: forward().backward(grad), reset, None


def alibi_reference(q, k, v, slopes: torch.Tensor, causal_only: bool = False) -> torch.Tensor:
    """Dense-bias SDPA: ``-m_h (i - j)`` below the diagonal, ``-inf`` above (no bias: ``causal_only``)."""
    with torch.no_grad():
        if causal_only:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        length = q.size(2)
        pos = torch.arange(length, device=q.device)
        distance = (pos[None, :] - pos[:, None]).to(torch.float32)  # j - i
        bias = slopes.to(q.device)[:, None, None] * distance
        bias = bias.masked_fill(distance > 0, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])


_COMPILED: Dict[str, Callable] = {}


def compiled_flex(name: str) -> Callable:
    """Compiled ``flex_attention``, one function (code object) per diagnostic: dynamo's graphs,
    guards and recompilation counts are kept per code object."""
    if name not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        def call(q, k, v, score_mod, block_mask, kernel_options):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options)

        code_name = "diagnostic_" + re.sub(r"\W+", "_", name).strip("_")
        own = types.FunctionType(call.__code__.replace(co_name=code_name), call.__globals__, code_name, None,
                                 call.__closure__)
        _COMPILED[name] = torch.compile(own)
    return _COMPILED[name]


def package_flex():
    """The package's flex module where it still has ``score_mod`` and ``causal_block_mask``, else None."""
    try:
        from fairseq_alibi.core import flex as package
    except ImportError:
        return None
    return package if all(hasattr(package, n) for n in ("score_mod", "causal_block_mask")) else None


def diagnostic_call(key: str, length, batch, heads, head_dim, device, dtype, backward: bool):
    """The diagnostic ``key`` of part 3 (:data:`DIAGNOSTICS`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fairseq_alibi.core.alibi import get_slopes

    slopes = get_slopes(heads).to(device)

    def slopes_only(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def slopes_and_causal(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score + slopes[h] * (kv_idx - q_idx), -float("inf"))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def torch_mask():
        return create_block_mask(causal, None, None, length, length, device=device)

    if key not in DIAGNOSTICS:
        raise KeyError(f"no diagnostic {key!r}; allowed: {', '.join(DIAGNOSTICS)}")
    score_mod, block_mask, options = slopes_only, None, None
    if key == "mask-only":
        score_mod, block_mask = None, torch_mask()
    elif key == "slopes-no-mask":
        score_mod = slopes_and_causal
    elif key.startswith("package-"):
        package = package_flex()
        if package is None:
            raise LookupError("fairseq_alibi.core.flex has no score_mod and causal_block_mask any more")
        if key in ("package", "package-score-mod"):
            score_mod = package.score_mod(build_stack("alibi", length, heads, head_dim), length, length, device)
        block_mask = torch_mask() if key == "package-score-mod" else package.causal_block_mask(length, length, device)
    else:
        block_mask = torch_mask()
        options = {"slopes-128x64": KERNEL_OPTIONS["blocks 128x64"],
                   "slopes-rows-safe": KERNEL_OPTIONS["rows safe"]}.get(key)
    compiled = compiled_flex(key)
    q, k, v = qkv(batch, heads, length, head_dim, device, dtype, grad=backward)
    grad = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)

    def forward():
        return compiled(q, k, v, score_mod, block_mask, options)

    def reset():
        q.grad = k.grad = v.grad = None

    def check():  # in the timed forward's grad mode: the graph it compiled, no other
        out = forward().detach()
        reference = alibi_reference(q.detach(), k.detach(), v.detach(), slopes, causal_only=score_mod is None)
        return float((out.float() - reference.float()).abs().max())

    return forward, (lambda: forward().backward(grad)) if backward else None, reset, check


# ----------------------------------------------------------------- rows
def measure(make: Callable, device, repeats: int) -> dict:
    """The readings of one path (see the module's docstring), or ``failed`` with the reason."""
    row: dict = {}
    try:
        with recorded_choices() as chosen:
            forward, step, reset, check = make()
            mode = torch.no_grad if step is None else contextlib.nullcontext  # forward only: no graph kept
            start = time.perf_counter()
            with mode():
                (step or forward)()
            sync(device)
            row["first_s"] = time.perf_counter() - start
            reset()
            if check is not None:
                with mode():
                    row["max_abs_diff"] = check()
            fwd, full, peaks = [], [], []
            for _ in range(repeats):
                with mode():
                    ms, peak = timed(forward, device)
                fwd.append(ms)
                if step is not None:
                    ms, peak = timed(step, device)
                    reset()
                    full.append(ms)
                peaks.append(peak)
                if ms > SLOW_MS:
                    break
        row["fwd_ms"] = median(fwd)
        row["ms"] = median(full) if full else None
        row["bwd_ms"] = row["ms"] - row["fwd_ms"] if full else None
        row["readings"] = len(fwd)
        row["peak_mib"] = max(peaks) if peaks and peaks[0] is not None else None
        row["chosen"] = sorted(set(chosen))
    except torch.cuda.OutOfMemoryError:
        row = {"failed": "out of GPU memory"}
    except Exception as exc:  # a path that cannot run here: said in its row, the others still run
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row = {"failed": f"{type(exc).__name__}: {message}"[:300]}
    return row


def kernels(opts, device) -> dict:
    """Part ``kernels``: every row, printed as it finishes and written to ``--json`` after each."""
    from fairseq_alibi.core import positions as P

    dtype = kernel_dtype(device, opts.dtype)
    heads, head_dim = opts.heads, opts.head_dim
    methods = opts.methods or list(P.POSITIONS)
    unknown = [m for m in methods if m not in P.POSITIONS]
    if unknown:
        raise SystemExit(f"error: --methods {' '.join(unknown)}: not registered; allowed: {', '.join(P.POSITIONS)}")
    backward = device.type == "cuda"  # torch's compiled FlexAttention has no CPU backward
    config = {"dtype": str(dtype).replace("torch.", ""), "heads": heads, "head_dim": head_dim,
              "tokens": opts.tokens, "repeats": opts.repeats, "lengths": opts.lengths, "methods": methods,
              "diagnose_lengths": opts.diagnose_lengths, "shapes": opts.shapes, "layers": LAYERS,
              "kernel_options": KERNEL_OPTIONS}
    result = {"device": device_name(device), "torch": torch.__version__, "machine": machine_description(),
              "config": config, "rows": [], "complete": False}
    flash: Dict[int, dict] = {}
    print("| T | batch | shapes | path | kernel (auto's choice) | fwd ms | fwd+bwd ms | x flash | first call s | "
          "peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def run(path: str, make: Callable, length: int, batch: int, shapes: str, **extra) -> dict:
        row = dict(path=path, length=length, batch=batch, shapes=shapes, device=result["device"],
                   torch=result["torch"], dtype=config["dtype"], heads=heads, head_dim=head_dim, tokens=batch * length,
                   **extra, **measure(make, device, opts.repeats))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the row's tensors, freed with measure's frame, back to the driver
        base = flash.get(length)
        if base and "failed" not in row:
            row["ratio"] = row["ms"] / base["ms"] if row["ms"] and base.get("ms") else None
            row["fwd_ratio"] = row["fwd_ms"] / base["fwd_ms"]
        result["rows"].append(row)
        write_json(opts.json, result)
        print(row_line(row), flush=True)
        return row

    def baseline(length: int, batch: int, again: bool = False) -> None:
        row = run("flash-causal" + (" (again)" if again else ""), lambda: flash_call(length, batch, heads, head_dim,
                  device, dtype), length, batch, "static")
        if not again and "failed" not in row:
            flash[length] = row

    configure_dynamo("static")
    for length in opts.lengths:
        batch = max(1, opts.tokens // length)
        baseline(length, batch)
        for p in method_paths(methods, length, heads, head_dim):
            run(p["path"], lambda p=p: layer_call(p["method"], p["index"], p["kernel"], length, batch, heads,
                                                  head_dim, device, dtype),
                length, batch, "static", method=p["method"], kernel=p["kernel"])
        baseline(length, batch, again=True)
    if opts.shapes == "both" and "alibi" in methods:
        from torch._dynamo import reset

        reset()  # every graph compiled so far dropped: ALiBi's flex compiles afresh, dynamic
        configure_dynamo("dynamic")
        for length in opts.lengths:
            batch = max(1, opts.tokens // length)
            run("alibi, dynamic shapes", lambda: layer_call("alibi", 0, "auto", length, batch, heads, head_dim,
                                                           device, dtype),
                length, batch, "dynamic", method="alibi", kernel="auto")
        configure_dynamo("static")
    for length in opts.diagnose_lengths:
        batch = max(1, opts.tokens // length)
        if length not in flash:
            baseline(length, batch)
        for key in opts.diagnostics:
            run(DIAGNOSTICS[key], lambda key=key: diagnostic_call(key, length, batch, heads, head_dim, device, dtype,
                                                                  backward),
                length, batch, "static", method="alibi", kernel="flex_attention", diagnostic=key)
    result["complete"] = True
    write_json(opts.json, result)
    return result


def row_line(row: dict) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    head = f"| {row['length']} | {row['batch']} | {row['shapes']} | {row['path']} | "
    if "failed" in row:
        return head + f"{row.get('kernel', '')} | failed: {row['failed']} | | | | |"
    kernel = row.get("kernel", "")
    if row.get("chosen"):
        kernel += f" ({', '.join(row['chosen'])})"
    return head + (f"{kernel} | {number(row['fwd_ms'], '.2f')} | {number(row['ms'], '.2f')} | "
                   f"{number(row.get('ratio'), '.2f')} | {row['first_s']:.2f} | {number(row['peak_mib'], '.0f')} |")


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


def lengths_or_none(text: str):
    """``--diagnose-lengths``: token counts, or ``none``."""
    return None if text == "none" else positive(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["kernels", "train", "both"], default="both")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="of the attention calls (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--lengths", type=positive, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=positive, default=16384, help="tokens per attention call (batch = tokens / T)")
    p.add_argument("--heads", type=positive, default=HEADS)
    p.add_argument("--head-dim", type=positive, default=HEAD_DIM)
    p.add_argument("--repeats", type=positive, default=5)
    p.add_argument("--methods", nargs="+", help="registered position methods to time (default: every one)")
    p.add_argument("--shapes", choices=["static", "both"], default="both",
                   help="both: ALiBi's flex also compiled with dynamic shapes, after the static rows")
    p.add_argument("--diagnose-lengths", type=lengths_or_none, nargs="+", default=[8192],
                   help="lengths of the flex diagnostics (none: no diagnostics)")
    p.add_argument("--diagnostics", nargs="+", choices=list(DIAGNOSTICS), default=list(DIAGNOSTICS),
                   help="which diagnostics, in this order")
    p.add_argument("--arch", default="transformer_lm_wiki103")
    p.add_argument("--vocab", type=int, default=267735)
    p.add_argument("--criterion", default="adaptive_loss", help="adaptive_loss for the wiki103 archs")
    p.add_argument("--length", type=int, default=512, help="training tokens per sample")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the kernel rows here (rewritten after each row)")
    opts = p.parse_args(argv)
    opts.diagnose_lengths = [n for n in opts.diagnose_lengths if n is not None]
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {opts.device}, but torch {torch.__version__} sees no CUDA device here; run it on a "
              "machine with a GPU, or give --device cpu (tiny sizes: the code paths only)", file=sys.stderr)
        return 1
    print(machine_description())
    print(device_name(device))
    if opts.part in ("kernels", "both"):
        kernels(opts, device)
    if opts.part in ("train", "both"):
        train(opts, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
