"""Words/s of stock ``fairseq-train`` runs: transformer_lm_alibi against transformer_lm.

    python benchmarks/fairseq_train_wps.py                  # both at once, one thread each
    python benchmarks/fairseq_train_wps.py --sequential     # one after the other, all threads
    python benchmarks/fairseq_train_wps.py --attention-dropout 0.1 --repeats 5
    python benchmarks/fairseq_train_wps.py --length 2048               # L = 2048, 2 sequences per update
    python benchmarks/fairseq_train_wps.py --device cuda --length 2048 --embed-dim 1024 --heads 16   # a GPU

The attention-bound configuration of ``train_throughput.py`` (6 layers, d=256,
8 heads, FFN 1024, 4096 tokens per update (8 x 512; ``--length`` sets L), dropout 0.1, vocabulary of 504
symbols), trained by the stock ``fairseq-train`` command (the ALiBi model through
``--user-dir``) on a throw-away corpus of random words (``fairseq-preprocess``
binarizes it), ``--log-interval 1``: fairseq prints the words/s (``wps``) of
every update.  By default the two models train at the same time, one process
and one thread each (as ``make demo`` trains them), so that whatever else runs
on the machine slows both alike; ``--sequential`` runs them one after the other
instead (A B, then B A, ...) with the threads the environment gives.  One run
per model and repeat.  A run is summarized by the median ``wps`` of its updates
after ``--skip`` warm-up updates (when both run at once, only those that ended
while the other run was still going), and by the best one (on a shared machine other
jobs only ever slow an update down, so the best update is the least disturbed
estimate); the reported ratios are medians over repeats of ALiBi / sinusoidal
from the same repeat, for both summaries.  ``--analyze DIR`` recomputes them
from the logs of a run made with ``--keep DIR``.

``--device cuda`` trains on the GPU in fp16 (``--fp16``, fairseq's loss-scaled
mixed precision: stock fairseq 0.12 reads ``--bf16`` as "run on a TPU" and
stops on a GPU without torch_xla), one run after the
other (there is one GPU), without ``--cpu``; ALiBi's ``auto`` kernel is then
compiled FlexAttention (no attention dropout), whose compilation falls in the
``--skip`` warm-up updates.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, machine_description, median  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def make_corpus(workdir: str, words: int, tokens: int) -> str:
    """Random words w0..w{words-1} (fairseq adds 4 specials), binarized."""
    rng = random.Random(0)
    raw = os.path.join(workdir, "train.txt")
    with open(raw, "w") as f:
        for _ in range(tokens // 100):
            f.write(" ".join(f"w{rng.randrange(words)}" for _ in range(100)) + "\n")
    dest = os.path.join(workdir, "bin")
    subprocess.run(
        [os.path.join(BIN, "fairseq-preprocess"), "--only-source", "--trainpref", raw, "--validpref", raw,
         "--destdir", dest, "--workers", "1"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return dest


def train_command(data: str, arch: str, opts, attention_dropout: float):
    dim = str(opts.embed_dim)
    cmd = [
        os.path.join(BIN, "fairseq-train"), data, "--task", "language_modeling", "--arch", arch,
        "--decoder-layers", str(opts.layers), "--decoder-embed-dim", dim, "--decoder-input-dim", dim,
        "--decoder-output-dim", dim, "--decoder-attention-heads", str(opts.heads),
        "--decoder-ffn-embed-dim", str(opts.ffn), "--share-decoder-input-output-embed", "--dropout", "0.1",
        "--attention-dropout", str(attention_dropout),
        "--tokens-per-sample", str(opts.length), "--sample-break-mode", "none", "--batch-size", str(opts.batch),
        "--optimizer", "adam", "--lr", "1e-4", "--max-update", str(opts.updates), "--seed", "1",
        "--log-format", "json", "--log-interval", "1", "--no-save", "--disable-validation",
        "--num-workers", "0",
    ]
    cmd += ["--fp16"] if opts.device == "cuda" else ["--cpu"]
    if arch.endswith("_alibi"):
        cmd += ["--user-dir", os.path.join(ROOT, "fairseq_alibi")]
    return cmd


class RunFailed(RuntimeError):
    """A training run exited with an error: one line naming the run, its own
    last ``error:`` line (or last line) and its log, which the caller keeps."""

    def __init__(self, cmd, returncode: int, log_path: str):
        with open(log_path, errors="replace") as log:
            lines = [line.strip() for line in log if line.strip()]
        said = next((line for line in reversed(lines) if "error:" in line.lower()), lines[-1] if lines else "no output")
        arch = cmd[cmd.index("--arch") + 1] if "--arch" in cmd else "?"
        super().__init__(f"{os.path.basename(cmd[0])} --arch {arch} failed (exit {returncode}): {said} "
                         f"(its log: {log_path})")


def run_all(jobs, parallel: bool):
    """Run ``(cmd, log_path)`` jobs, all at once (one thread each) or in turn."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if parallel:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    for cmd, log_path in jobs:
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not parallel:
            proc.wait()
        procs.append((proc, log, cmd))
    for proc, log, cmd in procs:
        proc.wait()
        log.close()
        if proc.returncode:
            raise RunFailed(cmd, proc.returncode, log.name)


def train_inner_stats(log_path: str) -> List[dict]:
    """The stats of each ``train_inner`` line (one per logged update) of a fairseq JSON log."""
    with open(log_path) as log:
        return [json.loads(line.split("| train_inner |", 1)[1]) for line in log if "| train_inner |" in line]


def read_log(log_path: str):
    """[(wps, wall seconds since start)] of the log's train_inner lines."""
    return [(float(stats["wps"]), float(stats["wall"])) for stats in train_inner_stats(log_path)]


def summarize(rows, skip: int, until: float = float("inf")):
    """(median wps, best wps) of the updates after ``skip`` that ended by ``until``."""
    wps = [w for w, wall in rows[skip:] if wall <= until] or [w for w, _ in rows[skip:]]
    if not wps:
        raise RuntimeError("no train_inner lines after the warm-up updates")
    return median(wps), max(wps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-dropout", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--length", type=int, default=512, help="--tokens-per-sample (the training length L)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per update (default: 4096 tokens per update, 8 at L=512, 2 at L=2048)")
    p.add_argument("--updates", type=int, default=10, help="updates per run")
    p.add_argument("--skip", type=int, default=3, help="warm-up updates not counted")
    p.add_argument("--repeats", type=int, default=3, help="runs per model and attention dropout")
    p.add_argument("--words", type=int, default=500, help="corpus words (+4 fairseq specials)")
    p.add_argument("--sequential", action="store_true",
                   help="train the models one after the other, not at once with one thread each")
    p.add_argument("--keep", help="keep the corpus and logs in this directory")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--analyze", help="only recompute the ratios from the logs kept in this directory")
    opts = p.parse_args()
    if not 1 <= opts.skip < opts.updates:
        p.error(f"--skip must be in 1 .. {opts.updates - 1} (fewer than --updates {opts.updates}; fairseq logs the "
                f"first update's words/s as 0), got {opts.skip}")
    opts.batch = opts.batch or max(1, 4096 // opts.length)
    if opts.device == "cuda":
        opts.sequential = True  # one GPU: one run at a time

    workdir = opts.analyze or opts.keep or tempfile.mkdtemp(prefix="alibi_wps_")
    os.makedirs(workdir, exist_ok=True)
    if not opts.analyze:
        data = make_corpus(workdir, opts.words, tokens=(opts.updates + 2) * opts.batch * opts.length * 2)
    import torch  # its version is fairseq-train's (one environment)

    results = {"machine": machine_description(), "device": device_name(opts.device), "torch": torch.__version__,
               "dtype": "float16" if opts.device == "cuda" else "float32", "config": vars(opts), "runs": {}}
    for drop in opts.attention_dropout:
        runs = {"sinusoidal": [], "alibi": []}
        median_wps = {"sinusoidal": [], "alibi": []}
        ratios, best_ratios = [], []
        for r in range(opts.repeats):
            order = ("sinusoidal", "alibi") if r % 2 == 0 else ("alibi", "sinusoidal")
            wps, best = {}, {}
            logs = {name: os.path.join(workdir, f"{name}_ad{drop}_{r}.log") for name in order}
            if not opts.analyze:
                arch = {"sinusoidal": "transformer_lm", "alibi": "transformer_lm_alibi"}
                jobs = [(train_command(data, arch[name], opts, drop), logs[name]) for name in order]
                try:
                    run_all(jobs, parallel=not opts.sequential)
                except RunFailed as err:  # the run's own error line; the directory stays for its log
                    print(f"error: {err}", file=sys.stderr)
                    return 1
            rows = {name: read_log(logs[name]) for name in order}
            # Both at once: count only the updates that ended while the other
            # run was still going (the slower run's last updates have the
            # machine to themselves).
            until = float("inf") if opts.sequential else min(r[-1][1] for r in rows.values())
            for name in order:
                wps[name], best[name] = summarize(rows[name], opts.skip, until)
                runs[name].append(rows[name])
                median_wps[name].append(wps[name])
            ratios.append(wps["alibi"] / wps["sinusoidal"])
            best_ratios.append(best["alibi"] / best["sinusoidal"])
            print(f"attention dropout {drop}, repeat {r}: median wps sinusoidal {wps['sinusoidal']:.0f}, "
                  f"alibi {wps['alibi']:.0f}, ratio {ratios[-1]:.3f}; best wps sinusoidal "
                  f"{best['sinusoidal']:.0f}, alibi {best['alibi']:.0f}, ratio {best_ratios[-1]:.3f}", flush=True)
        results["runs"][str(drop)] = {"wps_per_update": runs, "median_wps": median_wps, "ratios": ratios,
                                      "median_ratio": median(ratios),
                                      "best_ratios": best_ratios, "median_best_ratio": median(best_ratios)}
        print(f"attention dropout {drop}: ALiBi / sinusoidal fairseq-train wps over {opts.repeats} repeats: "
              f"median-wps ratio {median(ratios):.3f} (range {min(ratios):.3f}..{max(ratios):.3f}), "
              f"best-wps ratio {median(best_ratios):.3f} (range {min(best_ratios):.3f}..{max(best_ratios):.3f})",
              flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    if not (opts.keep or opts.analyze):
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
