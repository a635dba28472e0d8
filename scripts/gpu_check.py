"""One command for a lent GPU: ``make gpu-check`` (or ``python scripts/gpu_check.py``).

On a machine with a CUDA GPU, within ``--budget`` seconds (470 by default: one
command of a lent machine may run 10 minutes, installing the package
included), each step a subprocess with its own share of the time:

* ``tests``: the CUDA tests, wherever they are (``pytest -n 4 tests -k cuda``: every test or
  case with ``cuda`` in its name, also where a module the machine cannot import is left out;
  now flex and sdpa against the reference kernel, forward and
  backward, fp32 and bf16, padding);
* ``kernels``: one attention call, forward and forward + backward, bf16, 2K-16K
  tokens, of every registered position method (its attention layer, ``auto``'s
  kernel) and ALiBi's dense-bias ``sdpa`` beside bias-free causal flash
  attention; ALiBi's flex compiled with dynamic shapes too; at 8K, flex
  diagnostics that split ALiBi's time (the block mask alone, a slopes-only
  ``score_mod``, two sets of block sizes, no block mask, the package's
  ``score_mod`` and block mask apart) (``benchmarks/gpu_attention.py --part kernels``);
* ``eval``: 16K-32K tokens scored in one forward, ALiBi against sinusoidal,
  each cell warmed at its length first (the first call, compilation included,
  recorded apart), time and peak GPU memory (``benchmarks/eval_memory.py --device cuda``).

Two more steps run when named (``--steps``), too long for the budget with the others:

* ``compile``: graphs and seconds of compilation over 10 lengths, then per
  method (``benchmarks/flex_compile.py --device cuda``);
* ``train``: paired stock ``fairseq-train`` runs, ALiBi against sinusoidal,
  fp16, at 512 and 2048 tokens (``benchmarks/fairseq_train_wps.py --device cuda``).

Every number goes into a results file of its own, with the device, torch and
the code's commit named: ``docs/results/gpu-check-<date>.md`` (``--results``),
and a copy in ``--out``, which also keeps each step's JSON and log.  The file
is rewritten after every step and the benchmarks rewrite their JSON after
every row, so a step that runs out of its time keeps the rows it finished
(its table says it is partial) and a run stopped from outside keeps the steps
done.  A step that fails or runs out of time is written as such; the others
still run.  Without CUDA it stops at once, in one line.

On a GPU machine without network access (``make install`` cannot reach the
package index), install the wheels of fairseq-fixed, hydra-core, omegaconf,
antlr4-python3-runtime, sacremoses and bitarray for its Python, then run
``PYTHONPATH=$PWD python3 scripts/gpu_check.py --out DIR --commit SHA``
(``--commit``: a copied working tree has no git to ask).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")

#: name -> (weight: the step's share of the budget, command after the interpreter; {json} is the output file).
#: The weights are the seconds each step is expected to take on an H100 or H200 from an empty inductor cache:
#: tests 124 on the H200 (2026-11-27) for two files, and about 20 s to collect the whole suite; kernels about 230 (an estimate: 4 static flex compilations of forward +
#: backward, one dynamic, 7 diagnostics, about 12 s each, and the uncompiled rows' seconds); eval about 90 (4
#: cells of about 20 s: a process, a model, a compilation, 4 forwards).  compile (46 s) and train (about 280 s)
#: run only when named.
STEPS: Dict[str, tuple] = {
    "tests": (140, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "--continue-on-collection-errors",
                    "tests", "-k", "cuda"]),
    "kernels": (230, ["benchmarks/gpu_attention.py", "--part", "kernels", "--device", "cuda",
                      "--lengths", "2048", "4096", "8192", "16384", "--diagnose-lengths", "8192", "--repeats", "5",
                      "--json", "{json}"]),
    "eval": (90, ["benchmarks/eval_memory.py", "--device", "cuda", "--dtype", "bfloat16", "--lengths", "16384",
                   "32768", "--methods", "alibi", "sinusoidal", "--repeats", "1", "--timed", "3", "--json", "{json}"]),
    "compile": (50, ["benchmarks/flex_compile.py", "--device", "cuda", "--dtype", "bfloat16",
                     "--methods", "ntk", "cap", "capnorm", "--json", "{json}"]),
    "train": (280, ["benchmarks/fairseq_train_wps.py", "--device", "cuda", "--attention-dropout", "0",
                    "--repeats", "1", "--layers", "6", "--embed-dim", "1024", "--heads", "16", "--ffn", "4096",
                    "--updates", "25", "--skip", "10", "--json", "{json}"]),
}
#: The steps of a plain ``make gpu-check``, in this order.
DEFAULT_STEPS = ("tests", "kernels", "eval")
#: Training lengths of the ``train`` step, and sequences per update at each (32K tokens per update).
TRAIN_LENGTHS = {512: 64, 2048: 16}
#: The default ``--budget``: a lent machine's one command runs at most 600 s, ``make install`` first.
BUDGET = 470.0


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
    """Run a step within ``seconds``: {"status": ok | failed | timed out, "seconds", "tail"}.

    Its output goes straight into ``<out_dir>/<step>.log`` (kept when it is stopped);
    each command runs in a process group of its own, which is killed whole when the
    time is up (the benchmarks' own subprocesses and pytest's workers too)."""
    start, tail, code = time.monotonic(), "", 0
    log_path = os.path.join(out_dir, f"{step}.log")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    for cmd in commands(step, out_dir):
        left = seconds - (time.monotonic() - start)
        if left <= 0:
            return {"status": f"timed out after {seconds:.0f} s", "seconds": time.monotonic() - start,
                    "tail": tail}
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            offset = log.tell()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        tail = _read_from(log_path, offset)[-3000:]
        if code is None:
            return {"status": f"timed out after {seconds:.0f} s", "seconds": seconds, "tail": tail}
        if code != 0 and step != "tests":
            return {"status": f"failed (exit {code})", "seconds": time.monotonic() - start, "tail": tail}
    status = "ok"
    if step == "tests":
        status = _pytest_summary(tail) or f"failed (exit {code})"
    return {"status": status, "seconds": time.monotonic() - start, "tail": tail}


def _read_from(path: str, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


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


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def kernels_section(results: List[dict]) -> List[str]:
    (result,) = results
    config, rows = result["config"], result["rows"]
    lengths = sorted({r["length"] for r in rows})
    flash = {r["length"]: r for r in rows if r["path"] == "flash-causal" and "failed" not in r}
    lines = [f"One attention call, {config['dtype']}, {config['heads']} heads of {config['head_dim']}, "
             f"{config['tokens']:,} tokens per call (batch = tokens / T), on {result['device']}, torch "
             f"{result['torch']} (`benchmarks/gpu_attention.py --part kernels`); median of {config['repeats']} "
             "readings (CUDA events). Forward + backward, ms (x bias-free causal flash attention of the same "
             "length); a method's row is its attention layer with identity projections, its kernel `auto`'s "
             "choice unless named:", "",
             "| path | shapes | " + " | ".join(f"T={n}" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    order: List[tuple] = []
    for r in rows:
        if (r["path"], r["shapes"]) not in order:
            order.append((r["path"], r["shapes"]))
    by = {(r["path"], r["shapes"], r["length"]): r for r in rows}
    for path, shapes in order:
        cells = []
        for length in lengths:
            r = by.get((path, shapes, length))
            if r is None:
                cells.append("")
            elif "failed" in r:
                cells.append(f"failed: {r['failed']}")
            elif r.get("ms") is None:
                cells.append(f"fwd {r['fwd_ms']:.2f}")
            else:
                ratio = f" ({r['ratio']:.2f}x)" if r.get("ratio") is not None else ""
                cells.append(f"{r['ms']:.2f}{ratio}")
        lines.append(f"| {path} | {shapes} | " + " | ".join(cells) + " |")
    lines += ["", "Every row: the forward alone and the backward (forward + backward less the forward), each "
              "x flash's; the first call (compilation included where the path compiles); the kernels `auto` "
              "chose; peak memory of one forward + backward above its inputs; a diagnostic's largest difference "
              "from a dense-bias SDPA of the same inputs:", "",
              "| T | batch | path | shapes | kernel (chosen) | fwd ms (x) | bwd ms (x) | fwd+bwd ms (x) | first call s "
              "| peak MiB | max abs diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['length']} | {r['batch']} | {r['path']} | {r['shapes']} | "
        kernel = r.get("kernel", "") + (f" ({', '.join(r['chosen'])})" if r.get("chosen") else "")
        if "failed" in r:
            lines.append(head + f"{kernel} | failed: {r['failed']} | | | | | |")
            continue
        base = flash.get(r["length"], {})

        def times(key):
            value, ref = r.get(key), base.get(key)
            if value is None:
                return "-"
            return f"{value:.2f}" + (f" ({value / ref:.2f})" if ref else "")

        lines.append(head + f"{kernel} | {times('fwd_ms')} | {times('bwd_ms')} | {times('ms')} | "
                     f"{r['first_s']:.2f} | {_num(r.get('peak_mib'), '.0f')} | {_num(r.get('max_abs_diff'), '.3g')} |")
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
    timed = config.get("timed", 1)
    lines = [f"One sequence scored in one forward (`SequenceScorer`), {config['dtype']}, {config['layers']} layers, "
             f"d={config['embed_dim']}, vocabulary {config['vocab']:,}, on {result['device']}, torch {result['torch']} "
             f"(`benchmarks/eval_memory.py --device cuda`); each cell a process of its own, warmed by a first "
             f"forward at its length (compilation included), then timed: the median of {timed} forwards:", "",
             "| tokens | method | s | first call s | graphs compiled: warming / timed | peak MiB |",
             "|---|---|---|---|---|---|"]
    for cell in sorted(result["cells"], key=lambda c: (c["length"], c["method"], c.get("pass", 0))):
        head = f"| {cell['length']} | {cell['method']} | "
        if "seconds" in cell:
            lines.append(head + f"{cell['seconds']:.3f} | {_num(cell.get('first_s'), '.2f')} | "
                         f"{cell.get('warm_graphs', '-')} / {cell.get('timed_graphs', '-')} | {cell['peak_mib']:.0f} |")
        else:
            lines.append(head + f"- | - | - | {cell.get('failed') or cell.get('skipped') or 'not run'} |")
    return lines


SECTIONS = {"kernels": kernels_section, "eval": eval_section, "compile": compile_section, "train": train_section}


def elsewhere(results: List[dict], device: str, torch_version: str) -> List[str]:
    """A line for outputs that record another device or torch than the section's header."""
    seen = sorted({(r.get("device") or device, r.get("torch") or torch_version) for r in results} -
                  {(device, torch_version)})
    return [f"(its output records {', '.join(f'{d}, torch {t}' for d, t in seen)}, not the header's)"] if seen else []


def step_section(step: str, out_dir: str, device: str, torch_version: str) -> List[str]:
    """A step's caption and table, from the JSON it wrote (a partial one: the rows it finished)."""
    results = [_load(os.path.join(out_dir, name)) for name in outputs(step)]
    results = [r for r in results if r is not None]
    if not results:
        return [f"({step} wrote no output to read)"]
    try:
        lines = SECTIONS[step](results) + elsewhere(results, device, torch_version)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return [f"({step}: its output could not be read: {type(exc).__name__}: {exc})"]
    if any(r.get("complete") is False for r in results):
        lines = [f"Partial: the {step} step stopped before its end; the rows it finished:", ""] + lines
    return lines


def render(device: str, torch_version: str, statuses: Dict[str, dict], out_dir: str, when: str,
           steps: List[str], command: str = "python scripts/gpu_check.py", commit: str = "not known") -> str:
    """The results file: its header (date, machine, torch, commit, command, status), what
    ran and how long, and each step's tables (or why there are none)."""
    left = [step for step in steps if step not in statuses]
    failed = [step for step, s in statuses.items() if not finished(step, s["status"])]
    if left:
        status = (f"partial: written after the {list(statuses)[-1] if statuses else 'first'} step; "
                  f"not run (yet): {', '.join(left)}")
    elif failed:
        status = f"every step ran; {', '.join(failed)} did not finish or failed (below)"
    else:
        status = "complete: every step ran to its end"
    lines = [f"# GPU: `make gpu-check` on {device}, {when}", "",
             f"- **Date, machine, torch:** {when}; {device}; torch {torch_version}; the code at commit {commit}",
             "- **Corpus:** none: attention calls and models at their initial weights (timings)",
             f"- **Command:** `{command}`",
             f"- **Status:** {status}; timings are one run's, each ratio from readings taken side by side", "",
             "| step | result | seconds |", "|---|---|---|"]
    for step in steps:
        s = statuses.get(step)
        lines.append(f"| {step} | {s['status']} | {s['seconds']:.0f} |" if s else f"| {step} | not run | - |")
    for step in SECTIONS:
        if step in statuses and step != "tests" and (statuses[step]["status"] == "ok"
                                                       or statuses[step]["status"].startswith("timed out")):
            lines += ["", f"## {step}", "", *step_section(step, out_dir, device, torch_version)]
    return "\n".join(lines) + "\n"


def finished(step: str, status: str) -> bool:
    """Whether a step ran to its end: ``ok``, or pytest's summary for ``tests`` (a failed test is counted there)."""
    if step == "tests":
        return not status.startswith(("timed out", "failed"))
    return status == "ok"


def step_share(steps_left: List[str], seconds_left: float) -> float:
    """The first of ``steps_left``'s seconds: the time left shared by the steps' weights in ``STEPS``.

    Shared again before each step, so that a step that ends early hands its unused time to
    the later ones."""
    weights = [STEPS[step][0] for step in steps_left]
    return max(0.0, seconds_left) * weights[0] / sum(weights)


def results_path(when: str) -> str:
    """``docs/results/gpu-check-<date>.md``, or ``-2``, ``-3``... where a run of that day is there."""
    path, n = os.path.join(RESULTS_DIR, f"gpu-check-{when}.md"), 2
    while os.path.exists(path):
        path, n = os.path.join(RESULTS_DIR, f"gpu-check-{when}-{n}.md"), n + 1
    return path


def commit_of_checkout() -> str:
    """The checkout's commit (``+ changes`` where files differ from it), or why it is not known."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "not known (no git checkout here)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "not known (no git here)"


def write_file(path: str, text: str) -> None:
    """``text`` to ``path`` (a new file renamed over it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", default=list(DEFAULT_STEPS), metavar="STEP",
                   help=f"which steps, in this order (default: {' '.join(DEFAULT_STEPS)}; also: "
                        f"{' '.join(s for s in STEPS if s not in DEFAULT_STEPS)})")
    p.add_argument("--budget", type=float, default=BUDGET,
                   help="seconds for all steps (shared in proportion; a step's unused time goes to the later ones)")
    p.add_argument("--out", help="keep the steps' JSON, logs and a copy of the results file here "
                                 "(default: a temporary directory)")
    p.add_argument("--results", help="the results file (default: docs/results/gpu-check-<date>.md)")
    p.add_argument("--commit", help="the code's commit, where this checkout has no git (a lent machine's copy of "
                                    "the working tree): written into the results file's header")
    p.add_argument("--no-write", action="store_true", help="print the results; write no results file "
                                                           "(the copy in --out is still written)")
    opts = p.parse_args(argv)
    unknown = [s for s in opts.steps if s not in STEPS]
    if unknown:
        p.error(f"unknown {'step' if len(unknown) == 1 else 'steps'} {', '.join(unknown)}; allowed: {', '.join(STEPS)}")
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
    when = datetime.date.today().isoformat()
    results = opts.results or results_path(when)
    copy = os.path.join(out_dir, os.path.basename(results))
    command = "python scripts/gpu_check.py" + ("" if argv is None and len(sys.argv) < 2 else " " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    commit = opts.commit or commit_of_checkout()
    statuses: Dict[str, dict] = {}
    deadline = time.monotonic() + opts.budget

    def write() -> str:
        text = render(device, torch.__version__, statuses, out_dir, when, opts.steps, command, commit)
        write_file(copy, text)
        if not opts.no_write:
            write_file(results, text)
        return text

    write()
    for index, step in enumerate(opts.steps):
        share = step_share(opts.steps[index:], deadline - time.monotonic())
        print(f"gpu-check: {step} (up to {share:.0f} s)", flush=True)
        statuses[step] = run_step(step, out_dir, share)
        print(f"gpu-check: {step}: {statuses[step]['status']} in {statuses[step]['seconds']:.0f} s", flush=True)
        if statuses[step]["status"] != "ok" and step != "tests":
            print(statuses[step]["tail"], flush=True)
        write()  # after every step: a run stopped from outside keeps what finished
    print(write())
    print(f"gpu-check: written into {copy}" + ("" if opts.no_write else f" and {os.path.relpath(results, ROOT)}")
          + f"; the steps' outputs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
