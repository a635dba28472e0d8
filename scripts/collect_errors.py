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
import copy
import io
import os
import subprocess
import sys
import shutil
import tempfile
import zipfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import Payload, cli_env, fork_layout, tool, train_args, write_corpus  # noqa: E402


def build_fixtures(work):
    """Everything the cases below refer to, by relative path inside ``work``."""
    from pathlib import Path

    write_corpus(Path(work))
    run = dict(cwd=work, env=cli_env(), check=True, capture_output=True)
    subprocess.run([tool("alibi-preprocess"), "--only-source", "--trainpref", "train.txt",
                    "--validpref", "valid.txt", "--destdir", "data", "--workers", "1"], **run)
    subprocess.run([tool("alibi-train"), *train_args("data", "alibi", max_update=4)], **run)
    stock_args = train_args("data", "stock", max_update=4)
    stock_args[stock_args.index("transformer_lm_alibi")] = "transformer_lm"
    subprocess.run([tool("alibi-train"), *stock_args], **run)
    for method in ("fire", "t5bias", "rotary"):
        method_args = train_args("data", method, max_update=2)
        method_args[method_args.index("transformer_lm_alibi")] = f"transformer_lm_{method}"
        subprocess.run([tool("alibi-train"), *method_args], **run)
    subprocess.run([tool("alibi-preprocess"), "--only-source", "--trainpref", "train.txt",
                    "--destdir", "small_dict_data", "--nwordssrc", "12", "--workers", "1"], **run)

    def path(name):
        return os.path.join(work, name)

    alibi = torch.load(path("alibi/checkpoint_last.pt"), weights_only=True)
    stock = torch.load(path("stock/checkpoint_last.pt"), weights_only=True)

    fork = fork_layout(alibi, 32, stock_arch="transformer_lm")
    os.makedirs(path("fork"))
    torch.save(fork, path("fork/alibi_wt103_L32.pt"))
    no_length = copy.deepcopy(fork)
    del no_length["cfg"]["task"]["tokens_per_sample"]
    del no_length["cfg"]["model"]["tokens_per_sample"]
    torch.save(no_length, path("fork/no_train_length.pt"))

    other = copy.deepcopy(stock)
    other["cfg"]["model"]["_name"] = "roberta_base"
    torch.save(other, path("roberta.pt"))
    mismatch = copy.deepcopy(alibi)
    mismatch["cfg"]["model"]["decoder_layers"] = 3
    torch.save(mismatch, path("three_layers.pt"))
    torch.save({"model": {}, "cfg": None, "extra_state": Payload(path("PWNED"))}, path("hostile.pt"))
    torch.save({"model": {}, "val_loss": np.float64(1.0)}, path("numpy_scalar.pt"))

    nan = copy.deepcopy(alibi)
    first = next(k for k in nan["model"] if k.endswith("embed_tokens.weight"))
    nan["model"][first] = nan["model"][first].clone()
    nan["model"][first].view(-1)[0] = float("nan")
    torch.save(nan, path("nan_weight.pt"))

    data = open(path("alibi/checkpoint_last.pt"), "rb").read()
    open(path("truncated.pt"), "wb").write(data[: len(data) // 2])
    with zipfile.ZipFile(path("alibi/checkpoint_last.pt")) as archive:  # 400 bytes changed inside tensor data
        big = max(archive.infolist(), key=lambda i: i.file_size)
    start = big.header_offset + 30 + len(big.filename.encode()) + len(big.extra) + big.file_size // 2
    open(path("damaged.pt"), "wb").write(data[:start] + bytes(range(200)) * 2 + data[start + 400:])
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
    os.makedirs(path("only_dict"))
    os.link(path("data/dict.txt"), path("only_dict/dict.txt"))
    os.makedirs(path("resume"))
    open(path("resume/checkpoint_last.pt"), "wb").write(data[:20000])
    subprocess.run([tool("alibi-sweep"), "data", "-c", "alibi=alibi/checkpoint_last.pt", "--lengths", "1x",
                    "--methods", "none", "--output-dir", "sweep_out", "--cpu", "--no-progress"], **run)
    for name in ("bad_dict", "empty_split", "truncated_bin", "half_split", "damaged_idx"):
        os.makedirs(path(name))
        for file in os.listdir(path("data")):
            shutil.copyfile(path(f"data/{file}"), path(f"{name}/{file}"))
    open(path("bad_dict/dict.txt"), "w").write("a line without a count\n")
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder  # what an empty text binarizes to

    MMapIndexedDatasetBuilder(path("empty_split/valid.bin")).finalize(path("empty_split/valid.idx"))
    os.truncate(path("truncated_bin/valid.bin"), 100)
    os.remove(path("half_split/valid.idx"))  # what an interrupted stock fairseq-preprocess left
    with open(path("damaged_idx/valid.idx"), "r+b") as index:  # an element type code fairseq has no type for
        index.seek(9 + 8)
        index.write(bytes([99]))
    os.makedirs(path("latin"))
    open(path("latin/valid.txt"), "wb").write("one the caf\u00e9 sees a tree .\n".encode("latin-1"))
    open(path("latin/utf16.txt"), "wb").write("one the cat sees a tree .\n".encode("utf-16"))
    open(path("latin/prompts.jsonl"), "wb").write('{"prompt": "caf\u00e9", "answer": "x"}\n'.encode("latin-1"))
    os.symlink("missing_target.pt", path("dangling.pt"))
    os.makedirs(path("configs"))
    open(path("configs/tiny_lm.yaml"), "w").write("# a Hydra config\n")
    shutil.copy(os.path.join(ROOT, "examples", "language_model", "config", "wikitext103_alibi_L512.yaml"),
                path("configs"))
    open(path("empty.jsonl"), "w").close()
    os.makedirs(path("foreign_results"))
    open(path("foreign_results/results.json"), "w").write('{"accuracy": 0.5}\n')
    open(path("no_answer.jsonl"), "w").write('{"prompt": "one the cat sees"}\n')
    open(path("unknown_words.jsonl"), "w").write('{"prompt": "one the zebra sees", "answer": "a tree"}\n')
    torch.save({"weight": torch.zeros(2)}, path("state_dict.pt"))  # a PyTorch file, not a fairseq checkpoint


CONVERT = "alibi-convert-checkpoint"
READ_ONLY = "/sys/alibi-readonly"  # sysfs refuses new directories, even to root
EVAL = ["alibi-eval-lm", "data", "--cpu", "--gen-subset", "train"]
TRAIN = ["alibi-train", *train_args("data", "SAVE", max_update=2)]
SWEEP = ["alibi-sweep", "data", "--cpu", "--no-progress", "--output-dir", "sweep_bad"]
RETRIEVAL = ["alibi-retrieval", "data", "-c", "alibi/checkpoint_last.pt", "--cpu", "--no-progress",
             "--output-dir", "retrieval_bad"]
MLM = ["alibi-train", "data", "--task", "masked_lm", "--arch", "roberta_alibi", "--encoder-layers", "1",
       "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
       "--tokens-per-sample", "32", "--batch-size", "4", "--max-update", "1", "--optimizer", "adam",
       "--lr", "1e-3", "--cpu", "--num-workers", "0", "--save-dir", "mlm"]


def train(save_dir, *extra):
    """TRAIN with its save directory and extra flags (later flags win in argparse)."""
    return [save_dir if a == "SAVE" else a for a in TRAIN] + list(extra)

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
        ("output is the input file", [CONVERT, "fork/alibi_wt103_L32.pt", "fork/alibi_wt103_L32.pt"]),
        ("output file exists (no `--force`)", [CONVERT, "fork/alibi_wt103_L32.pt", "notes.pt"]),
        ("a `--train-length` that is not positive", [CONVERT, "fork/alibi_wt103_L32.pt", "out.pt", "--train-length", "0"]),
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
        ("a PyTorch file that is not a fairseq checkpoint (a bare state dict)", EVAL + ["--path", "state_dict.pt"]),
        ("no `--path`", EVAL),
        ("config and weights disagree (3 layers in the config, 2 in the weights)", EVAL + ["--path", "three_layers.pt"]),
        ("a typo in an ALiBi `--model-overrides` key",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'alibi_interpolaton': 'linear'}"]),
        ("ALiBi overrides for a model without ALiBi (the stock sinusoidal model)",
         EVAL + ["--path", "stock/checkpoint_last.pt", "--tokens-per-sample", "32",
                 "--model-overrides", "{'alibi_interpolation': 'ntk'}"]),
        ("an override key the checkpoint's config does not have (fairseq would drop it and print the model as trained)",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'dropuot': 0.5}"]),
    ]),
    ("alibi-train", [
        ("`--restore-file` an unconverted fork checkpoint",
         train("restore_fork", "--restore-file", "fork/alibi_wt103_L32.pt")),
        ("resuming from a truncated `checkpoint_last.pt`", train("resume")),
        ("`--restore-file` that does not exist (stock fairseq trains from scratch)",
         train("restore_missing", "--restore-file", "checkpoint_best.pt")),
        ("`--restore-file` a directory", train("restore_dir", "--restore-file", "alibi")),
        ("a NaN dropout (stock fairseq trains with none)", train("nan_dropout", "--dropout", "nan")),
        ("a typo in `--arch`", train("typo", "--arch", "transformer_lm_alibbi")),
        ("a bad ALiBi value", train("bad_value", "--alibi-interpolation", "bogus")),
        ("`--position-scaling` beside an older factor that says otherwise (stock: evaluated at 2, without a word)",
         train("scaling_conflict", "--position-scaling", "linear:2", "--alibi-scale-factor", "4")),
        ("`--criterion adaptive_loss` without `--ddp-backend legacy_ddp` (fairseq's traceback after loading the data)",
         train("adaptive_loss", "--arch", "transformer_lm_wiki103_alibi", "--criterion", "adaptive_loss",
               "--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20")),
        ("a bad ALiBi value in a masked-LM encoder (`roberta_alibi`)", MLM + ["--alibi-interpolation", "bogus"]),
        ("a bad bidirectional mode", MLM + ["--alibi-bidirectional", "diagonal"]),
        ("`--valid-subset` that does not exist", train("no_split", "--valid-subset", "vaild")),
        ("a save directory that cannot be written (here under /sys, read-only even for root)",
         train(READ_ONLY)),
        ("a save directory that is a file", train("train.txt")),
        ("`--max-tokens` smaller than one training sample (`--tokens-per-sample 32`)",
         train("small_batch", "--max-tokens", "10")),
        ("`--seed -1` (numpy takes 0 to 2**32 - 1)", train("seed", "--seed", "-1")),
        ("sizes fairseq cannot build a model from (its own assertion)",
         train("heads", "--decoder-embed-dim", "30", "--decoder-attention-heads", "4")),
        ("adaptive cutoffs out of order (torch's error on a size fairseq computed)",
         train("cutoffs", "--arch", "transformer_lm_wiki103_alibi", "--adaptive-input-cutoff", "20,10",
               "--adaptive-softmax-cutoff", "20,10")),
        ("a position method's option out of its range: FIRE without hidden units (`--fire-hidden 0`)",
         train("fire_hidden", "--arch", "transformer_lm_fire", "--fire-hidden", "0")),
        ("a negative FIRE threshold", train("fire_threshold", "--arch", "transformer_lm_fire",
                                             "--fire-threshold", "-3")),
        ("a NaN RoPE base", train("rotary_base", "--arch", "transformer_lm_rotary", "--rotary-base", "nan")),
        ("a rotary fraction that rotates no pair of a head's dimensions",
         train("rotary_fraction", "--arch", "transformer_lm_rotary", "--rotary-fraction", "0.01")),
        ("T5 buckets whose exact half reaches the maximum distance",
         train("t5", "--arch", "transformer_lm_t5bias", "--t5-buckets", "64", "--t5-max-distance", "16")),
        ("`--task masked_lm` without `--arch` (alibi-train's default arch is for language_modeling)",
         ["alibi-train", "data", "--task", "masked_lm", "--cpu"]),
        ("`alibi-hydra-train` with a config whose model fairseq cannot build (the paper's adaptive cutoffs on "
         "a 32-word dictionary)",
         ["alibi-hydra-train", "--config-dir", "configs", "--config-name", "wikitext103_alibi_L512", "task.data=data",
          "common.cpu=true", "checkpoint.save_dir=hydra_ckpt"]),
        ("`alibi-hydra-train` with a `--config-name` that is not in `--config-dir`",
         ["alibi-hydra-train", "--config-dir", "configs", "--config-name", "tiny"]),
        ("a misspelt key added to an `alibi-hydra-train` config",
         ["alibi-hydra-train", "--config-dir", "configs", "--config-name", "wikitext103_alibi_L512", "task.data=data",
          "+model.alibi_scale_fator=2"]),
        ("a value of the wrong type in an `alibi-hydra-train` override",
         ["alibi-hydra-train", "--config-dir", "configs", "--config-name", "wikitext103_alibi_L512", "task.data=data",
          "model.decoder_layers=x"]),
        ("`alibi-generate --sampling` with fairseq's default beam of 5",
         ["alibi-generate", "data", "--path", "alibi/checkpoint_last.pt", "--cpu", "--sampling"]),
    ]),
    ("alibi-eval-lm, more", [
        ("`--context-window` not below `--tokens-per-sample`",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--tokens-per-sample", "64", "--context-window", "64"]),
        ("`--gen-subset` that does not exist", ["alibi-eval-lm", "data", "--cpu", "--gen-subset", "vaild",
                                                "--path", "alibi/checkpoint_last.pt"]),
        ("a data directory with only dict.txt", ["alibi-eval-lm", "only_dict", "--cpu",
                                                 "--path", "alibi/checkpoint_last.pt"]),
        ("a dictionary of another size than the checkpoint's", ["alibi-eval-lm", "small_dict_data", "--cpu",
                                                                "--gen-subset", "train",
                                                                "--path", "alibi/checkpoint_last.pt"]),
        ("a checkpoint path that is a directory", EVAL + ["--path", "alibi"]),
        ("a checkpoint with bytes changed inside its tensor data (zip checksum)", EVAL + ["--path", "damaged.pt"]),
        ("a checkpoint with a NaN weight", EVAL + ["--path", "nan_weight.pt"]),
        ("blocks longer than a sinusoidal model accepts (nothing would be scored)",
         EVAL + ["--path", "stock/checkpoint_last.pt", "--tokens-per-sample", "256"]),
        ("blocks longer than a sinusoidal model accepts, but for a short last block (a perplexity over part "
         "of the split)", ["alibi-eval-lm", "data", "--cpu", "--gen-subset", "valid", "--path",
                           "stock/checkpoint_last.pt", "--tokens-per-sample", "128", "--max-tokens", "4096"]),
        ("an override of a learned quantity (FIRE's threshold: the checkpoint holds the trained one)",
         EVAL + ["--path", "fire/checkpoint_last.pt", "--model-overrides", "{'fire_threshold': 100000}"]),
        ("an override that would change the shape of the weights (T5's buckets)",
         EVAL + ["--path", "t5bias/checkpoint_last.pt", "--model-overrides", "{'t5_buckets': 16}"]),
        ("an override of another position method's parameter (FIRE's on an ALiBi model)",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'fire_threshold': -3}"]),
        ("an override of a position parameter out of its range",
         EVAL + ["--path", "rotary/checkpoint_last.pt", "--model-overrides", "{'rotary_base': 0.5}"]),
        ("an override of the number of layers", EVAL + ["--path", "alibi/checkpoint_last.pt",
                                                        "--model-overrides", "{'decoder_layers': 3}"]),
        ("`--tokens-per-sample 0`", EVAL + ["--path", "alibi/checkpoint_last.pt", "--tokens-per-sample", "0"]),
        ("`--model-overrides` that is not a dict", EVAL + ["--path", "alibi/checkpoint_last.pt",
                                                          "--model-overrides", "[1, 2]"]),
        ("an ALiBi override of the wrong type", EVAL + ["--path", "alibi/checkpoint_last.pt",
                                                       "--model-overrides", "{'alibi_scale_factor': 'x'}"]),
        ("an override of one of fairseq's integer options out of its range",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'tokens_per_sample': -5}"]),
        ("`--tokens-per-sample` beyond what fairseq counts (int32)",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--tokens-per-sample", "2147483648"]),
        ("`--max-tokens` smaller than one block", EVAL + ["--path", "alibi/checkpoint_last.pt",
                                                          "--tokens-per-sample", "64", "--max-tokens", "10"]),
        ("a model override fairseq cannot build the model from",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'decoder_attention_heads': 5}"]),
        ("DATA that is a file", ["alibi-eval-lm", "train.txt", "--cpu", "--path", "alibi/checkpoint_last.pt"]),
        ("a dict.txt in another format", ["alibi-eval-lm", "bad_dict", "--cpu", "--gen-subset", "valid",
                                          "--path", "alibi/checkpoint_last.pt"]),
        ("a split binarized from an empty text", ["alibi-eval-lm", "empty_split", "--cpu", "--gen-subset", "valid",
                                                  "--path", "alibi/checkpoint_last.pt"]),
        ("a truncated `.bin`", ["alibi-eval-lm", "truncated_bin", "--cpu", "--gen-subset", "valid",
                                "--path", "alibi/checkpoint_last.pt"]),
    ]),
    ("alibi-sweep", [
        ("a checkpoint of another model family (a masked LM)", SWEEP + ["-c", "mlm=roberta.pt"]),
        ("a checkpoint path that is a directory", SWEEP + ["-c", "alibi"]),
        ("a sliding stride not below the evaluation length",
         SWEEP + ["-c", "alibi/checkpoint_last.pt", "--lengths", "32", "--modes", "sliding", "--stride", "64"]),
        ("`--max-tokens` below the longest length", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--lengths", "4x",
                                                             "--max-tokens", "64"]),
        ("an unknown method", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--methods", "cubic"]),
        ("a method of another position method (RoPE's YaRN on an ALiBi model)",
         SWEEP + ["-c", "alibi/checkpoint_last.pt", "--methods", "none,yarn:2"]),
        ("a cap at no distance (`cap:F` takes F > 0)", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--methods", "cap:-1"]),
        ("a negative NTK factor", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--methods", "ntk:-2"]),
        ("a length longer than the evaluated split", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--lengths", "1x,64x"]),
        ("a checkpoint that is a broken symbolic link", SWEEP + ["-c", "dangling.pt"]),
        ("a sliding stride below 1", SWEEP + ["-c", "alibi/checkpoint_last.pt", "--modes", "sliding", "--stride", "0"]),
        ("an output directory whose results.json another program wrote",
         ["alibi-sweep", "data", "-c", "alibi/checkpoint_last.pt", "--output-dir", "foreign_results", "--cpu"]),
        ("`--checkpoint` beside `--hf` with DATA a text file (the two read one data directory's split)",
         ["alibi-sweep", "train.txt", "-c", "alibi/checkpoint_last.pt", "--hf", "hf=hf_out", "--cpu"]),
        ("an output directory that cannot be written", ["alibi-sweep", "data", "-c", "alibi/checkpoint_last.pt",
                                                        "--output-dir", READ_ONLY, "--cpu"]),
    ]),
    ("alibi-retrieval", [
        ("an empty prompt file", RETRIEVAL + ["--task", "empty.jsonl"]),
        ("a prompt without an answer", RETRIEVAL + ["--task", "no_answer.jsonl"]),
        ("words the model's dictionary does not have", RETRIEVAL + ["--task", "unknown_words.jsonl"]),
        ("a built-in task whose words are not in the dictionary", RETRIEVAL + ["--task", "passkey"]),
        ("the lines task with a dictionary that lacks its words", RETRIEVAL + ["--task", "lines", "--digits", "1", "--keys",
                                                            "cat,dog,bird,tree", "--lengths", "8"]),
        ("an unknown task", RETRIEVAL + ["--task", "needle"]),
        ("a template without the placeholder the answer needs",
         RETRIEVAL + ["--task", "lines", "--template", "line=line {key} : REGISTER_CONTENT is ."]),
        ("`--keys` that repeat a key (the question would be ambiguous)",
         RETRIEVAL + ["--task", "lines", "--keys", "cat,cat,dog"]),
    ]),
    ("texts and data folders (checked before anything is written)", [
        ("a Latin-1 text to binarize", ["alibi-preprocess", "--only-source", "--validpref", "latin/valid.txt",
                                        "--srcdict", "data/dict.txt", "--destdir", "latin_bin"]),
        ("a UTF-16 text to binarize", ["alibi-preprocess", "--only-source", "--trainpref", "latin/utf16.txt",
                                       "--destdir", "latin_bin"]),
        ("a new dictionary into a folder that holds one", ["alibi-preprocess", "--only-source", "--trainpref",
                                                           "train.txt", "--destdir", "data"]),
        ("a `--srcdict` other than the dictionary of the splits in `--destdir` (it replaced it: the old splits "
         "then read as other words)", ["alibi-preprocess", "--only-source", "--srcdict", "small_dict_data/dict.txt",
                                       "--validpref", "valid.txt", "--destdir", "data"]),
        ("neither `--trainpref` nor a dictionary", ["alibi-preprocess", "--only-source", "--validpref", "valid.txt",
                                                    "--destdir", "new_bin"]),
        ("a `valid.idx` whose header fairseq cannot read (an element type code it has no type for)",
         ["alibi-eval-lm", "damaged_idx", "--cpu", "--gen-subset", "valid", "--path", "alibi/checkpoint_last.pt"]),
        ("a folder with valid.bin but no valid.idx (an interrupted preprocess)",
         ["alibi-eval-lm", "half_split", "--cpu", "--gen-subset", "valid", "--path", "alibi/checkpoint_last.pt"]),
        ("the same folder to train on", ["half_split" if a == "data" else a for a in train("half_train")]),
        ("the same folder to sweep", ["alibi-sweep", "half_split", "-c", "alibi/checkpoint_last.pt", "--cpu"]),
        ("a Latin-1 text for `--hf` models", ["alibi-sweep", "latin/valid.txt", "--hf", "hf=hf_out", "--cpu"]),
        ("a Latin-1 prompt file", RETRIEVAL + ["--task", "latin/prompts.jsonl"]),
    ]),
    ("alibi-export-hf", [
        ("`--format gpt-neox` for a model GPT-NeoX cannot hold (ALiBi)",
         ["alibi-export-hf", "alibi/checkpoint_last.pt", "hf_out", "--format", "gpt-neox"]),
        ("`--format gpt-neox` for a post-norm rotary model", ["alibi-export-hf", "rotary/checkpoint_last.pt",
                                                               "hf_out", "--format", "gpt-neox"]),
        ("`--format bloom` for a model BLOOM cannot hold (the default post-norm model)",
         ["alibi-export-hf", "alibi/checkpoint_last.pt", "hf_out", "--format", "bloom"]),
        ("an output directory that is not empty", ["alibi-export-hf", "alibi/checkpoint_last.pt", "data"]),
        ("`--force` onto the directory that holds the checkpoint", ["alibi-export-hf", "alibi/checkpoint_last.pt",
                                                                    "alibi", "--force"]),
        ("an unknown `--position-scaling`", ["alibi-export-hf", "alibi/checkpoint_last.pt", "hf_out",
                                          "--position-scaling", "rope:2"]),
    ]),
    ("warnings (the command runs; the warning is on its output)", [
        ("a scale factor without an interpolation method",
         EVAL + ["--path", "alibi/checkpoint_last.pt", "--model-overrides", "{'alibi_scale_factor': 8}"]),
        ("the 2021 fork's `--arch transformer_lm_wiki103` (here the stock sinusoidal model)",
         train("fork_arch", "--arch", "transformer_lm_wiki103", "--adaptive-input-cutoff", "10,20",
               "--adaptive-softmax-cutoff", "10,20", "--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp")),
    ]),
    ("stock `fairseq-eval-lm --user-dir \"$(alibi-user-dir)\"` (no one-line wrapper: last line of its traceback)", [
        ("unconverted fork checkpoint", ["fairseq-eval-lm", "data", "--cpu", "--gen-subset", "train",
                                         "--path", "fork/alibi_wt103_L32.pt", "--user-dir", "USER_DIR"]),
        ("hostile pickle", ["fairseq-eval-lm", "data", "--cpu", "--gen-subset", "train",
                            "--path", "hostile.pt", "--user-dir", "USER_DIR"]),
    ]),
    ("stock `fairseq-eval-lm` without `--user-dir` (fairseq's own message; the fix: add the plugin)", [
        ("an ALiBi checkpoint: fairseq does not know `transformer_lm_alibi` and fails with "
         "`KeyError: \"'_name'\"`; run `alibi-eval-lm`, or add `--user-dir \"$(alibi-user-dir)\"`",
         ["fairseq-eval-lm", "data", "--cpu", "--gen-subset", "train", "--path", "alibi/checkpoint_last.pt"]),
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
    result = subprocess.run(real, cwd=work, env=cli_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line or line.startswith("usage:") or "| WARNING |" in line]
    if result.returncode != 0 and not errors and lines:
        errors = [lines[-1]]
    return shown, result.returncode, errors, "Traceback" in output


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
