#!/usr/bin/env python
"""Run every bad input we know of through the console scripts; write docs/errors.md.

    python scripts/collect_errors.py [--output docs/errors.md]

Builds its own fixtures offline in a temporary directory (a tiny corpus, a
tiny ALiBi model trained for a few updates, the same model rewritten in the
ALiBi fork's format, a stock sinusoidal model, broken and hostile files),
runs each case with the working directory set there so that the messages
show short relative paths, and records the exit status and what the command
printed on stderr (the `error:` line, or the last line when there is none).
Takes a few minutes on a CPU.
"""

import argparse
import collections
import copy
import io
import os
import random
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import torch
from omegaconf import OmegaConf

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "4",
]


def tool(name):
    return os.path.join(BIN, name)


def env():
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")
    out.pop("FAIRSEQ_ALIBI_TRACEBACK", None)
    return out


class Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def build_fixtures(work):
    """Everything the cases below refer to, by relative path inside ``work``."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    with open(os.path.join(work, "train.txt"), "w") as handle:
        for _ in range(200):
            handle.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "\n")
    run = dict(cwd=work, env=env(), check=True, capture_output=True)
    subprocess.run([tool("alibi-preprocess"), "--only-source", "--trainpref", "train.txt",
                    "--validpref", "train.txt", "--destdir", "data", "--workers", "1"], **run)
    common = ["--task", "language_modeling", "--tokens-per-sample", "32", "--batch-size", "8",
              "--max-update", "4", "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
              "--no-progress-bar", "--disable-validation"]
    subprocess.run([tool("alibi-train"), "data", "--arch", "transformer_lm_alibi", "--save-dir", "alibi"]
                   + MODEL + common, **run)
    subprocess.run([tool("alibi-train"), "data", "--arch", "transformer_lm", "--save-dir", "stock"]
                   + MODEL + common, **run)

    def path(name):
        return os.path.join(work, name)

    alibi = torch.load(path("alibi/checkpoint_last.pt"), weights_only=True)
    stock = torch.load(path("stock/checkpoint_last.pt"), weights_only=True)

    fork = copy.deepcopy(alibi)
    model = fork["cfg"]["model"]
    for key in [k for k in model if k.startswith("alibi_")]:
        del model[key]
    model.update(_name="transformer_lm", no_token_positional_embeddings=False,
                 tokens_per_sample="${task.tokens_per_sample}", max_tokens="${task.max_tokens}")
    fork["model"] = collections.OrderedDict(fork["model"])
    fork["model"]["decoder.embed_positions._float_tensor"] = torch.zeros(1)
    no_length = copy.deepcopy(fork)
    fork["cfg"] = OmegaConf.create(fork["cfg"])
    os.makedirs(path("fork"))
    torch.save(fork, path("fork/alibi_wt103_L32.pt"))
    del no_length["cfg"]["task"]["tokens_per_sample"]
    torch.save(no_length, path("fork/no_train_length.pt"))

    other = copy.deepcopy(stock)
    other["cfg"]["model"]["_name"] = "roberta_base"
    torch.save(other, path("roberta.pt"))
    mismatch = copy.deepcopy(alibi)
    mismatch["cfg"]["model"]["decoder_layers"] = 3
    torch.save(mismatch, path("three_layers.pt"))
    torch.save({"model": {}, "cfg": None, "extra_state": Payload(path("PWNED"))}, path("hostile.pt"))
    torch.save({"model": {}, "val_loss": np.float64(1.0)}, path("numpy_scalar.pt"))

    data = open(path("alibi/checkpoint_last.pt"), "rb").read()
    open(path("truncated.pt"), "wb").write(data[: len(data) // 2])
    open(path("empty.pt"), "wb").close()
    open(path("notes.pt"), "w").write("not a checkpoint\n")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("readme.txt", "just a zip")
    open(path("archive.pt"), "wb").write(buf.getvalue())
    os.makedirs(path("no_dict"))
    for name in os.listdir(path("data")):
        if name.startswith("train."):
            os.link(path(f"data/{name}"), path(f"no_dict/{name}"))
    os.makedirs(path("resume"))
    open(path("resume/checkpoint_last.pt"), "wb").write(data[:20000])


CONVERT = "alibi-convert-checkpoint"
EVAL = ["alibi-eval-lm", "data", "--cpu", "--gen-subset", "train"]
TRAIN = ["alibi-train", "data", "--task", "language_modeling", "--arch", "transformer_lm_alibi",
         "--tokens-per-sample", "32", "--batch-size", "8", "--max-update", "2", "--optimizer", "adam",
         "--lr", "1e-3", "--cpu", "--num-workers", "0", "--no-progress-bar"] + MODEL

CASES = [
    ("alibi-convert-checkpoint", [
        ("input file does not exist", [CONVERT, "missing.pt", "out.pt"]),
        ("input is a directory", [CONVERT, "data", "out.pt"]),
        ("empty file", [CONVERT, "empty.pt", "out.pt"]),
        ("truncated checkpoint (first half of a real one)", [CONVERT, "truncated.pt", "out.pt"]),
        ("a text file", [CONVERT, "notes.pt", "out.pt"]),
        ("a zip archive that is not a checkpoint", [CONVERT, "archive.pt", "out.pt"]),
        ("hostile pickle (`__reduce__` calling `open`)", [CONVERT, "hostile.pt", "out.pt"]),
        ("a checkpoint holding a numpy scalar (not on the allowlist)", [CONVERT, "numpy_scalar.pt", "out.pt"]),
        ("a genuine stock sinusoidal `transformer_lm` checkpoint", [CONVERT, "stock/checkpoint_last.pt", "out.pt"]),
        ("an ALiBi checkpoint of this plugin (or an already converted one)", [CONVERT, "alibi/checkpoint_last.pt", "out.pt"]),
        ("a checkpoint of another model family (`roberta_base`)", [CONVERT, "roberta.pt", "out.pt"]),
        ("fork checkpoint whose training length cannot be resolved", [CONVERT, "fork/no_train_length.pt", "out.pt"]),
        ("output directory does not exist", [CONVERT, "fork/alibi_wt103_L32.pt", "nowhere/out.pt"]),
        ("missing argument", [CONVERT, "fork/alibi_wt103_L32.pt"]),
    ]),
    ("alibi-eval-lm", [
        ("unconverted fork checkpoint", EVAL + ["--path", "fork/alibi_wt103_L32.pt"]),
        ("hostile pickle", EVAL + ["--path", "hostile.pt"]),
        ("truncated checkpoint", EVAL + ["--path", "truncated.pt"]),
        ("checkpoint file does not exist", EVAL + ["--path", "missing.pt"]),
        ("data directory without dict.txt", ["alibi-eval-lm", "no_dict", "--cpu", "--gen-subset", "train",
                                             "--path", "alibi/checkpoint_last.pt"]),
        ("checkpoint of another model family (`roberta_base`)", EVAL + ["--path", "roberta.pt"]),
        ("config and weights disagree (3 layers in the config, 2 in the weights)", EVAL + ["--path", "three_layers.pt"]),
    ]),
    ("alibi-train", [
        ("`--restore-file` an unconverted fork checkpoint", TRAIN + ["--save-dir", "restore_fork",
                                                                  "--restore-file", "fork/alibi_wt103_L32.pt"]),
        ("resuming from a truncated `checkpoint_last.pt`", TRAIN + ["--save-dir", "resume"]),
    ]),
    ("stock `fairseq-eval-lm --user-dir \"$(alibi-user-dir)\"` (no one-line wrapper: last line of its traceback)", [
        ("unconverted fork checkpoint", ["fairseq-eval-lm", "data", "--cpu", "--gen-subset", "train",
                                         "--path", "fork/alibi_wt103_L32.pt", "--user-dir", "USER_DIR"]),
        ("hostile pickle", ["fairseq-eval-lm", "data", "--cpu", "--gen-subset", "train",
                            "--path", "hostile.pt", "--user-dir", "USER_DIR"]),
    ]),
    ("checkpoints/download.sh", [
        ("no argument", ["DOWNLOAD"]),
        ("a training length that was not published", ["DOWNLOAD", "100"]),
        ("offline (here: a refused connection)", ["env", "ALIBI_CHECKPOINT_URL=http://127.0.0.1:9", "DOWNLOAD", "64", "dl"]),
    ]),
]


def run_case(cmd, work, user_dir):
    shown = " ".join(a if " " not in a else repr(a) for a in cmd).replace("USER_DIR", '"$(alibi-user-dir)"')
    shown = shown.replace("DOWNLOAD", "checkpoints/download.sh")
    real = [user_dir if a == "USER_DIR" else a for a in cmd]
    real = [os.path.join(ROOT, "checkpoints", "download.sh") if a == "DOWNLOAD" else a for a in real]
    if real[0] not in ("env",) and not os.path.isabs(real[0]):
        real[0] = tool(real[0])
    result = subprocess.run(real, cwd=work, env=env(), capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line or line.startswith("usage:")]
    if result.returncode != 0 and not errors and lines:
        errors = [lines[-1]]
    return shown, result.returncode, errors, "Traceback" in result.stderr


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "errors.md"))
    args = parser.parse_args(argv)
    user_dir = subprocess.run([tool("alibi-user-dir")], capture_output=True, text=True, check=True).stdout.strip()
    out = [
        "# Errors: every bad input we tried, and what it prints",
        "",
        "Generated by `python scripts/collect_errors.py` (fixtures built offline in a",
        "temporary directory; paths are relative to it). Each entry: the command, its",
        "exit status, and its message on stderr. This project's console scripts print",
        "one `error: ...` line and exit with status 1 for these; set",
        "`FAIRSEQ_ALIBI_TRACEBACK=1` to see the traceback as well. A hostile file's",
        "code never runs (the marker file it would create is checked below).",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="alibi-errors-") as work:
        build_fixtures(work)
        for group, cases in CASES:
            out += [f"## {group}", ""]
            for title, cmd in cases:
                shown, code, errors, traceback = run_case(cmd, work, user_dir)
                sys.stderr.write(f"[{code}] {shown}\n")
                out += [f"**{title}**", "", "```console", f"$ {shown}"]
                out += errors or ["(no message)"]
                out += [f"[exit status {code}{', with traceback' if traceback else ''}]", "```", ""]
        pwned = os.path.exists(os.path.join(work, "PWNED"))
    out += ["## Hostile file", "", f"Marker file created by the hostile pickle: **{'YES' if pwned else 'no'}**.", ""]
    text = "\n".join(out).replace(work + os.sep, "").replace(work, ".")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        handle.write(text)
    sys.stderr.write(f"wrote {args.output}\n")
    return 1 if pwned else 0


if __name__ == "__main__":
    sys.exit(main())
