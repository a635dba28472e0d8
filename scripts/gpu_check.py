"""One command for a lent GPU: ``make gpu-check`` (or ``python scripts/gpu_check.py``).

On a machine with a CUDA GPU, in about 10 minutes (``--budget``), each step a
subprocess with its own share of the time:

* ``tests``: the CUDA tests (``pytest -n 4 tests/test_attention.py tests/test_flex.py -k cuda``:
  flex and sdpa against the reference kernel, forward and backward, fp32 and bf16, padding);
* ``kernels``: one attention call, forward + backward, bf16, 2K-16K tokens:
  ALiBi's compiled FlexAttention and dense-bias SDPA against bias-free causal
  flash attention (``benchmarks/gpu_attention.py --part kernels``);
* ``compile``: graphs and seconds of compilation over 10 lengths, then per
  method (``benchmarks/flex_compile.py --device cuda``);
* ``train``: paired stock ``fairseq-train`` runs, ALiBi against sinusoidal,
  fp16, at 512 and 2048 tokens (``benchmarks/fairseq_train_wps.py --device cuda``);
* ``eval``: 16K-32K tokens scored in one forward, time and peak GPU memory,
  ALiBi against sinusoidal (``benchmarks/eval_memory.py --device cuda``).

It then writes the numbers, with the device named, between the ``gpu-check``
markers of docs/results/gpu-check.md, its own results file (``--no-write``: print them only).  A step that
fails or runs out of time is written as such; the others still run.  Without
CUDA it stops at once, in one line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
DOCS = os.path.join(ROOT, "docs", "results", "gpu-check.md")
BEGIN, END = "<!-- gpu-check: begin -->", "<!-- gpu-check: end -->"

#: name -> (weight: the step's share of the budget, command after the interpreter; {json} is the output file).
#: The weights are the seconds each step took in one whole run on an H200 (2026-11-27: tests 124,
#: kernels 53, compile 46, train about 280 from an empty inductor cache, eval 83); the default
#: budget leaves a lent machine's 10-minute command limit room for installing the wheels.
STEPS: Dict[str, tuple] = {
    "tests": (130, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "tests/test_attention.py",
                    "tests/test_flex.py", "-k", "cuda"]),
    "kernels": (55, ["benchmarks/gpu_attention.py", "--part", "kernels", "--device", "cuda",
                     "--lengths", "2048", "4096", "8192", "16384", "--repeats", "3", "--json", "{json}"]),
    "compile": (50, ["benchmarks/flex_compile.py", "--device", "cuda", "--dtype", "bfloat16",
                     "--methods", "ntk", "cap", "capnorm", "--json", "{json}"]),
    "train": (280, ["benchmarks/fairseq_train_wps.py", "--device", "cuda", "--attention-dropout", "0",
                    "--repeats", "1", "--layers", "6", "--embed-dim", "1024", "--heads", "16", "--ffn", "4096",
                    "--updates", "25", "--skip", "10", "--json", "{json}"]),
    "eval": (85, ["benchmarks/eval_memory.py", "--device", "cuda", "--dtype", "bfloat16", "--lengths", "16384",
                   "32768", "--methods", "alibi", "sinusoidal", "--repeats", "1", "--json", "{json}"]),
}
#: Training lengths of the ``train`` step, and sequences per update at each (32K tokens per update).
TRAIN_LENGTHS = {512: 64, 2048: 16}


def outputs(step: str) -> List[str]:
    """The JSON files a step writes (``train``: one per training length); ``tests`` writes none."""
    if step == "tests":
        return []
    return [f"train_{length}.json" for length in TRAIN_LENGTHS] if step == "train" else [f"{step}.json"]


def commands(step: str, out_dir: str) -> List[List[str]]:
    """The command lines of one step (``train`` runs once per training length)."""
    _, args = STEPS[step]
    if step != "train":
        return [[sys.executable] + [a.replace("{json}", os.path.join(out_dir, f"{step}.json")) for a in args]]
    return [[sys.executable] + [a.replace("{json}", os.path.join(out_dir, name)) for a in args]
            + ["--length", str(length), "--batch", str(batch)]
            for name, (length, batch) in zip(outputs("train"), TRAIN_LENGTHS.items())]


def run_step(step: str, out_dir: str, seconds: float) -> dict:
    """Run a step within ``seconds``: {"status": ok | failed | timed out, "seconds", "tail"}."""
    start, tail = time.monotonic(), ""
    for cmd in commands(step, out_dir):
        left = seconds - (time.monotonic() - start)
        if left <= 0:
            return {"status": "timed out", "seconds": time.monotonic() - start, "tail": tail}
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left, env=env)
        except subprocess.TimeoutExpired:
            return {"status": f"timed out after {seconds:.0f} s", "seconds": seconds, "tail": tail}
        tail = (proc.stdout + proc.stderr)[-3000:]
        with open(os.path.join(out_dir, f"{step}.log"), "a") as log:
            log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
        if proc.returncode != 0 and step != "tests":
            return {"status": f"failed (exit {proc.returncode})", "seconds": time.monotonic() - start, "tail": tail}
    status = "ok"
    if step == "tests":
        status = _pytest_summary(tail) or f"failed (exit {proc.returncode})"
    return {"status": status, "seconds": time.monotonic() - start, "tail": tail}


def _pytest_summary(output: str) -> Optional[str]:
    """``"9 passed, 1 skipped"`` from pytest's last line, or None."""
    found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", output, re.MULTILINE)
    return found[-1].strip() if found else None


def _load(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- Markdown
# Every caption says what its step's own output records (dtype, sizes, repeats,
# device), never what this script meant to run: a changed STEPS entry or a
# benchmark that fell back to other settings is described as it ran.


def kernels_section(results: List[dict]) -> List[str]:
    (result,) = results
    config = result["config"]
    lines = [f"One attention call, forward + backward, {config['dtype']}, {config['heads']} heads of "
             f"{config['head_dim']}, {config['tokens']:,} tokens per call (`benchmarks/gpu_attention.py --part "
             f"kernels`); median of {config['repeats']}:", "",
             "| T | batch | flash causal, no bias: ms | ALiBi flex: ms (x flash) | ALiBi sdpa: ms (x flash) | "
             "peak MiB: flash / flex / sdpa |", "|---|---|---|---|---|---|"]
    by = {(r["length"], r["path"]): r for r in result["rows"]}
    for length in sorted({r["length"] for r in result["rows"]}):
        flash = by[(length, "flash-causal")]
        cells = []
        for path in ("alibi-flex", "alibi-sdpa"):
            r = by.get((length, path))
            cells.append(f"{r['ms']:.2f} ({r['ratio']:.2f})" if r else "not run")
        peaks = " / ".join(f"{by[(length, p)]['peak_mib']:.0f}" if (length, p) in by else "-"
                           for p in ("flash-causal", "alibi-flex", "alibi-sdpa"))
        lines.append(f"| {length} | {flash['batch']} | {flash['ms']:.2f} | {cells[0]} | {cells[1]} | {peaks} |")
    return lines


def compile_section(results: List[dict]) -> List[str]:
    from flex_compile import markdown as compile_table

    (result,) = results
    config = result["config"]
    cache = "the usual inductor cache" if config.get("warm_cache") else "an empty inductor cache"
    return [f"Compilation of the `flex` kernel, {config['dtype']}, from {cache} "
            "(`benchmarks/flex_compile.py --device cuda`):", "", *compile_table(result).splitlines()]


def train_section(results: List[dict]) -> List[str]:
    from common import median

    config = results[0]["config"]
    lines = [f"Stock `fairseq-train`, {results[0]['dtype']}, {config['layers']} layers, d={config['embed_dim']}, "
             f"{config['heads']} heads, ALiBi (`auto`: compiled FlexAttention) against sinusoidal, median words/s "
             f"after {config['skip']} warm-up updates (`benchmarks/fairseq_train_wps.py --device cuda`):", "",
             "| tokens per sample | sequences per update | sinusoidal wps | ALiBi wps | ALiBi / sinusoidal |",
             "|---|---|---|---|---|"]
    for result in sorted(results, key=lambda r: r["config"]["length"]):
        config = result["config"]
        run = result["runs"][str(float(config["attention_dropout"][0]))]
        wps = {name: median(values) for name, values in run["median_wps"].items()}
        lines.append(f"| {config['length']} | {config['batch']} | {wps['sinusoidal']:.0f} | {wps['alibi']:.0f} | "
                     f"{run['median_ratio']:.3f} |")
    return lines


def eval_section(results: List[dict]) -> List[str]:
    (result,) = results
    config = result["config"]
    lines = [f"One sequence scored in one forward (`SequenceScorer`), {config['dtype']}, {config['layers']} layers, "
             f"d={config['embed_dim']}, vocabulary {config['vocab']:,} (`benchmarks/eval_memory.py --device cuda`):",
             "", "| tokens | ALiBi s | ALiBi peak MiB | sinusoidal s | sinusoidal peak MiB |", "|---|---|---|---|---|"]
    for length in sorted({c["length"] for c in result["cells"]}):
        row = [str(length)]
        for method in ("alibi", "sinusoidal"):
            cell = next((c for c in result["cells"] if c["method"] == method and c["length"] == length), {})
            if "seconds" in cell:
                row += [f"{cell['seconds']:.2f}", f"{cell['peak_mib']:.0f}"]
            else:
                row += ["-", cell.get("failed") or cell.get("skipped") or "not run"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


SECTIONS = {"kernels": kernels_section, "compile": compile_section, "train": train_section, "eval": eval_section}


def elsewhere(results: List[dict], device: str, torch_version: str) -> List[str]:
    """A line for outputs that record another device or torch than the section's header."""
    seen = sorted({(r.get("device") or device, r.get("torch") or torch_version) for r in results} -
                  {(device, torch_version)})
    return [f"(its output records {', '.join(f'{d}, torch {t}' for d, t in seen)}, not the header's)"] if seen else []


def step_section(step: str, out_dir: str, device: str, torch_version: str) -> List[str]:
    """A finished step's caption and table, from the JSON it wrote."""
    results = [_load(os.path.join(out_dir, name)) for name in outputs(step)]
    results = [r for r in results if r is not None]
    if not results:
        return [f"({step} wrote no output to read)"]
    try:
        return SECTIONS[step](results) + elsewhere(results, device, torch_version)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return [f"({step}: its output could not be read: {type(exc).__name__}: {exc})"]


def render(device: str, torch_version: str, statuses: Dict[str, dict], out_dir: str, when: str) -> str:
    """The docs section: what ran where, and each step's table (or why there is none)."""
    lines = [BEGIN, f"### Measured by `make gpu-check` on {device} ({when}, torch {torch_version})", ""]
    lines.append("| step | result | seconds |")
    lines.append("|---|---|---|")
    for step, status in statuses.items():
        lines.append(f"| {step} | {status['status']} | {status['seconds']:.0f} |")
    for step in SECTIONS:
        if statuses.get(step, {}).get("status") == "ok":
            lines += ["", *step_section(step, out_dir, device, torch_version)]
    lines.append(END)
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """``text`` with the part between the markers (the markers included) replaced by ``section``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOCS} has no '{BEGIN}' ... '{END}' section to write into")
    return text[:start] + section + text[end + len(END):]


def step_share(steps_left: List[str], seconds_left: float) -> float:
    """The first of ``steps_left``'s seconds: the time left shared by the steps' weights in ``STEPS``.

    Shared again before each step, so that a step that ends early hands its unused time to
    the later ones (the training step, the longest, is near its share on an H100)."""
    weights = [STEPS[step][0] for step in steps_left]
    return max(0.0, seconds_left) * weights[0] / sum(weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", default=list(STEPS), metavar="STEP",
                   help=f"which steps, in this order (default all: {' '.join(STEPS)})")
    p.add_argument("--budget", type=float, default=560.0,
                   help="seconds for all steps (shared in proportion; a step's unused time goes to the later ones)")
    p.add_argument("--out", help="keep the steps' JSON and logs in this directory (default: a temporary one)")
    p.add_argument("--no-write", action="store_true", help=f"print the section; do not write {DOCS}")
    opts = p.parse_args(argv)
    unknown = [s for s in opts.steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; allowed: {', '.join(STEPS)}")
    if not opts.budget > 0:
        p.error(f"--budget must be a positive number of seconds, got {opts.budget:g}")

    import torch

    if not torch.cuda.is_available():
        print(f"error: gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none here "
              "(torch.cuda.is_available() is False); run it on a machine with one", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0)
    out_dir = opts.out or tempfile.mkdtemp(prefix="alibi_gpu_check_")
    os.makedirs(out_dir, exist_ok=True)
    statuses, deadline = {}, time.monotonic() + opts.budget
    for index, step in enumerate(opts.steps):
        share = step_share(opts.steps[index:], deadline - time.monotonic())
        print(f"gpu-check: {step} (up to {share:.0f} s)", flush=True)
        statuses[step] = run_step(step, out_dir, share)
        print(f"gpu-check: {step}: {statuses[step]['status']} in {statuses[step]['seconds']:.0f} s", flush=True)
        if statuses[step]["status"] != "ok" and step != "tests":
            print(statuses[step]["tail"], flush=True)
    section = render(device, torch.__version__, statuses, out_dir, datetime.date.today().isoformat())
    print(section)
    if not opts.no_write:
        with open(DOCS) as f:
            text = f.read()
        with open(DOCS, "w") as f:
            f.write(replace_section(text, section))
        print(f"gpu-check: written into {os.path.relpath(DOCS, ROOT)}; outputs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
