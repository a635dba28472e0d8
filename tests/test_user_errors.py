"""User mistakes by class, across the console scripts and the Python API: one
``error:`` line, a non-zero exit, no traceback, the real cause named; never a
number printed from nothing (zero tokens, NaN), never an input overwritten.

Each test is driven by a table, so a new entry point or option gets the
class's checks by adding a row.
"""

from __future__ import annotations

import os
import shutil
import zipfile

import pytest
import torch

from conftest import error_lines, run_cli, tool, train_args

from fairseq_alibi import errors, safe_load
from fairseq_alibi.core.scaling import METHODS


def assert_one_error(result, *expected: str, status: int = 1) -> str:
    """Exit ``status``, exactly one ``error:`` line containing every ``expected`` text, no traceback."""
    lines = error_lines(result)
    assert result.returncode == status, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert len(lines) == 1, result.output[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- numeric flags
NUMERIC_CASES = [
    ("alibi-eval-lm", "--tokens-per-sample", "0", "a positive integer"),
    ("alibi-eval-lm", "--context-window", "-1", "an integer >= 0"),
    ("alibi-train", "--max-tokens", "-5", "a positive integer"),
    ("alibi-train", "--decoder-attention-heads", "0", "a positive integer"),
    ("alibi-generate", "--beam", "0", "a positive integer"),
    ("alibi-preprocess", "--workers", "0", "a positive integer"),
    # beyond what fairseq's C code counts (an OverflowError traceback), below numpy's seeds (a ValueError)
    ("alibi-eval-lm", "--tokens-per-sample", "2147483648", "at most 2147483647"),
    ("alibi-eval-lm", "--max-tokens", "99999999999999999999", "a positive integer"),
    ("alibi-train", "--seed", "-1", "an integer >= 0 (at most 4294967295)"),
    # real options: NaN or a negative dropout trained with none (fairseq tests p > 0), 2 crashed after a
    # crash checkpoint, a NaN weight decay saved NaN weights; a temperature of 0 was fairseq's assertion
    ("alibi-train", "--dropout", "nan", "a number in [0, 1)"),
    ("alibi-train", "--dropout", "-1", "a number in [0, 1)"),
    ("alibi-train", "--attention-dropout", "2", "a number in [0, 1)"),
    ("alibi-train", "--weight-decay", "nan", "a finite number >= 0"),
    ("alibi-generate", "--temperature", "0", "a finite number > 0"),
    ("alibi-train", "--decoder-input-dim", "0", "a positive integer"),  # was a ZeroDivisionError
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("script,flag,value,allowed", NUMERIC_CASES)
def test_impossible_numbers_are_refused_before_fairseq_runs(script, flag, value, allowed, lm_data_bin, tmp_path):
    result = run_cli([tool(script), lm_data_bin, flag, value, "--cpu"], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, f"{flag} {value} is not valid", allowed)


# ------------------------------------------------------------ --model-overrides
OVERRIDE_CASES = [
    ("[1, 2]", "must be a dict"),
    ("{'alibi_interpolation': ntk}", "not a Python dict literal"),
    ("__import__('os').getcwd()", "not a Python dict literal"),
    ("{'alibi_scale_factor': 'x'}", "'alibi_scale_factor': 'x' is not valid; alibi_scale_factor takes a number"),
    ("{'alibi_interpolation': 'ntkk'}", "takes one of " + ", ".join(map(repr, METHODS))),
    ("{'alibi_train_length': 1.5}", "alibi_train_length takes an integer"),
    ("{'alibi_interpolation': 'cap', 'alibi_scale_factor': -1}", "alibi_scale_factor"),
    # fairseq's own integer options are checked as their flags are (it took -5 tokens per sample silently)
    ("{'tokens_per_sample': -5}", "model override 'tokens_per_sample': -5 is not valid; tokens_per_sample takes a "
                                  "positive integer"),
    ("{'max_tokens': 'x'}", "max_tokens takes a positive integer"),
    ("{'dropout': float('nan')}", "not a Python dict literal"),  # a call is not a literal
    ("{'dropout': 1.5}", "model override 'dropout': 1.5 is not valid; dropout takes a number in [0, 1)"),
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("text,expected", OVERRIDE_CASES)
def test_bad_model_overrides_name_the_key(text, expected, alibi_checkpoint, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--model-overrides", text], expect_ok=False)
    assert_one_error(result, expected)


@pytest.mark.parametrize("overrides,expected", [
    (dict(alibi_scale_factor="x"), "alibi_scale_factor takes a number"),
    (dict(alibi_attention="fast"), "alibi_attention takes one of"),
    (dict(tokens_per_sample=0), "tokens_per_sample takes a positive integer"),
])
def test_python_api_checks_override_values_too(overrides, expected, alibi_checkpoint, lm_data_bin):
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    with pytest.raises(errors.ConfigError, match=expected):
        AlibiTransformerLanguageModel.from_pretrained(str(alibi_checkpoint.parent), alibi_checkpoint.name,
                                                      data_name_or_path=str(lm_data_bin), **overrides)


@pytest.mark.slow
def test_alibi_overrides_on_a_model_without_alibi_are_refused(sinusoidal_checkpoint, lm_data_bin):
    """They would leave the model as trained and print its perplexity as if extended."""
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", sinusoidal_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", "32",
                      "--model-overrides", "{'alibi_interpolation': 'ntk'}"], expect_ok=False)
    assert_one_error(result, "model overrides alibi_interpolation would have no effect", "has no ALiBi")
    assert "Perplexity" not in result.output


# ------------------------------------------------------ checkpoints named by a flag
def other_torch_files(directory):
    """PyTorch files that are not fairseq checkpoints: a bare state dict, a list, a tensor."""
    made = {}
    for name, obj in (("state_dict", {"weight": torch.zeros(2)}), ("list", [1, 2, 3]), ("tensor", torch.zeros(3))):
        made[name] = str(directory / f"{name}.pt")
        torch.save(obj, made[name])
    return made


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("kind", ["state_dict", "list", "tensor"])
@pytest.mark.parametrize("how", ["alibi-eval-lm", "alibi-sweep", "--restore-file", "--finetune-from-model"])
def test_a_torch_file_that_is_not_a_fairseq_checkpoint_is_named(how, kind, lm_data_bin, tmp_path):
    """Each was a KeyError or TypeError traceback from inside fairseq's loader."""
    path = other_torch_files(tmp_path)[kind]
    if how == "alibi-eval-lm":
        command = [tool(how), lm_data_bin, "--path", path, "--cpu", "--gen-subset", "valid"]
    elif how == "alibi-sweep":
        command = [tool(how), lm_data_bin, "-c", f"m={path}", "--lengths", "32", "--methods", "none", "--cpu",
                   "--no-progress", "-o", tmp_path / "sweep"]
    else:
        command = [tool("alibi-train"), *train_args(lm_data_bin, tmp_path / "save", max_update=1), how, path]
    result = run_cli(command, expect_ok=False, cwd=tmp_path)
    assert_one_error(result, f"{path} is not a fairseq checkpoint")


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("flag,given,expected", [
    ("--restore-file", "missing.pt", "--restore-file: checkpoint file not found: missing.pt (read as given, from the "
                                     "current directory: not under --save-dir)"),
    ("--restore-file", "ckpt", "--restore-file: ckpt is a directory; give a checkpoint file in it, e.g. "
                               "ckpt/checkpoint_last.pt"),
    ("--finetune-from-model", "missing.pt", "--finetune-from-model: checkpoint file not found: missing.pt"),
])
def test_a_checkpoint_flag_that_names_no_file_is_refused(flag, given, expected, lm_data_bin, tmp_path):
    """A --restore-file that was missing or a directory trained from scratch with exit
    status 0; a missing --finetune-from-model was a ValueError traceback."""
    (tmp_path / "ckpt").mkdir()
    torch.save({}, tmp_path / "ckpt" / "checkpoint_last.pt")
    result = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path / "save", max_update=1), flag, given],
                     expect_ok=False, cwd=tmp_path)
    assert_one_error(result, expected)
    assert not (tmp_path / "save").exists()


def save_directory(path):
    """A save directory as fairseq-train leaves it: epoch and update checkpoints beside best and last."""
    path.mkdir()
    for name in ("checkpoint1.pt", "checkpoint2.pt", "checkpoint10.pt", "checkpoint_2_300.pt", "checkpoint_best.pt",
                 "checkpoint_last.pt"):
        torch.save({}, path / name)
    return path


#: Every tool that takes a checkpoint path: how to give it one, in-process.
CHECKPOINT_TOOLS = {
    "alibi-eval-lm": None,  # fairseq's loader: a real run (below)
    "alibi-sweep": lambda data, ckpt, out: ("fairseq_alibi.evaluation.perplexity", [data, "-c", ckpt, "-o", out]),
    "alibi-retrieval": lambda data, ckpt, out: ("fairseq_alibi.evaluation.retrieval", [data, "-c", ckpt, "-o", out]),
    "alibi-export-hf": lambda data, ckpt, out: ("fairseq_alibi.export", [ckpt, out]),
}


@pytest.mark.parametrize("script", CHECKPOINT_TOOLS)
def test_a_save_directory_given_as_a_checkpoint_suggests_best_and_last_first(script, lm_data_bin, tmp_path, capsys):
    """The files there, checkpoint_best.pt and checkpoint_last.pt first, then the newest (the first epochs'
    were suggested, in the order of their names)."""
    import importlib

    ckpt = save_directory(tmp_path / "ckpt")
    expected = (f"{ckpt} is a directory; give a checkpoint file in it, e.g. {ckpt}/checkpoint_best.pt, "
                f"{ckpt}/checkpoint_last.pt, {ckpt}/checkpoint10.pt, {ckpt}/checkpoint2.pt (2 more .pt files there)")
    if CHECKPOINT_TOOLS[script] is None:
        result = run_cli([tool(script), lm_data_bin, "--path", ckpt, "--cpu"], expect_ok=False, cwd=tmp_path)
        assert_one_error(result, expected)
        return
    module, argv = CHECKPOINT_TOOLS[script](str(lm_data_bin), str(ckpt), str(tmp_path / "out"))
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stopped.value.code == 1 and len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize("script,extra,expected", [
    ("alibi-eval-lm", ["--gen-subset", "valid"], "--path CHECKPOINT is required"),
    ("alibi-generate", ["--sampling"], "--sampling draws one sequence per beam, so --nbest (1) must equal --beam (5)"),
])
def test_a_missing_path_and_sampling_with_beams_are_one_line(script, extra, expected, lm_data_bin, tmp_path):
    result = run_cli([tool(script), lm_data_bin, "--cpu", *extra], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, expected)


# ------------------------------------------------- no number from nothing
def damaged(source, directory) -> str:
    """A copy of ``source`` with 400 bytes overwritten inside its largest tensor record."""
    path = str(directory / "damaged.pt")
    shutil.copyfile(source, path)
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 30 + len(info.filename.encode()) + len(info.extra))
        f.seek(info.file_size // 2, os.SEEK_CUR)
        f.write(bytes(range(200)) * 2)
    return path


def with_nan_weight(source, directory) -> str:
    path = str(directory / "nan.pt")
    state = safe_load.load(source)
    name = next(k for k in state["model"] if k.endswith("embed_tokens.weight"))
    state["model"][name] = state["model"][name].clone()
    state["model"][name].view(-1)[0] = float("nan")
    torch.save(state, path)
    return path


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("make,expected", [(damaged, "fails its checksum"), (with_nan_weight, "NaN/inf")])
@pytest.mark.parametrize("script", ["alibi-eval-lm", "alibi-sweep", "alibi-export-hf"])
def test_damaged_checkpoints_give_no_number(make, expected, script, alibi_checkpoint, lm_data_bin, tmp_path):
    path = make(alibi_checkpoint, tmp_path)
    args = {
        "alibi-eval-lm": [lm_data_bin, "--path", path, "--cpu", "--gen-subset", "valid"],
        "alibi-sweep": [lm_data_bin, "-c", f"m={path}", "--lengths", "1x", "--methods", "none", "--cpu",
                        "--no-progress", "-o", tmp_path / "sweep"],
        "alibi-export-hf": [path, tmp_path / "hf"],
    }[script]
    result = run_cli([tool(script), *args], expect_ok=False)
    assert_one_error(result, expected)
    assert "Perplexity" not in result.output and "ppl=" not in result.output


def test_the_python_api_refuses_damaged_checkpoints_alike(alibi_checkpoint, tmp_path):
    with pytest.raises(errors.CorruptCheckpointError, match="fails its checksum"):
        safe_load.load(damaged(alibi_checkpoint, tmp_path))
    with pytest.raises(errors.CorruptCheckpointError, match="NaN/inf"):
        safe_load.load(with_nan_weight(alibi_checkpoint, tmp_path))


@pytest.mark.slow
def test_zero_evaluated_tokens_is_an_error(sinusoidal_checkpoint, lm_data_bin):
    """A sinusoidal model trained at 32 tokens cannot read blocks of 256: fairseq
    scores nothing and would print perplexity 1.00 (a split cut in part:
    tests/test_trust.py)."""
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", sinusoidal_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", "256"], expect_ok=False)
    assert_one_error(result, "only 0 of the", "longer than the model's 32 positions", "'max_target_positions': 256")
    assert "Perplexity" not in result.output


# ------------------------------------------------------------ inputs kept
def test_converter_never_overwrites_its_input(alibi_checkpoint, tmp_path):
    original = tmp_path / "fork.pt"
    shutil.copyfile(alibi_checkpoint, original)
    before = original.read_bytes()
    link = tmp_path / "link.pt"
    link.symlink_to(original)
    for output, expected in [(original, "is the input file"), (link, "is the input file"),
                             (tmp_path, "is a directory")]:
        result = run_cli([tool("alibi-convert-checkpoint"), original, output], expect_ok=False)
        assert_one_error(result, expected)
    assert original.read_bytes() == before


# ------------------------------------------------------------ data files
def data_copy(source, directory):
    target = directory / "data"
    shutil.copytree(source, target)
    return target


def as_file(source, directory):
    (directory / "data.txt").write_text("one the cat sees a tree .\n")
    return directory / "data.txt"


def bad_dictionary(source, directory):
    target = data_copy(source, directory)
    (target / "dict.txt").write_text("a line without a count\n")
    return target


def empty_split(source, directory):
    """valid.bin/.idx as fairseq-preprocess writes them for an empty text."""
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    target = data_copy(source, directory)
    MMapIndexedDatasetBuilder(str(target / "valid.bin")).finalize(str(target / "valid.idx"))
    return target


def truncated_bin(source, directory):
    target = data_copy(source, directory)
    with open(target / "valid.bin", "r+b") as f:
        f.truncate(100)
    return target


def empty_idx(source, directory):
    target = data_copy(source, directory)
    (target / "valid.idx").write_bytes(b"")
    return target


def damaged_idx(source, directory):
    """valid.idx with an element type code fairseq has no type for (a KeyError traceback)."""
    target = data_copy(source, directory)
    with open(target / "valid.idx", "r+b") as f:
        f.seek(9 + 8)  # past the magic and the version
        f.write(bytes([99]))
    return target


DATA_CASES = [
    (as_file, "is a file, not a"),  # eval-lm: a NotADirectoryError traceback
    (bad_dictionary, "data/dict.txt is not a fairseq dictionary"),  # a ValueError traceback
    (empty_split, "data/valid (.bin/.idx) holds no sentence"),  # "cannot mmap an empty file", twice
    (truncated_bin, "data holds a half split 'valid' (valid.bin has 100 bytes"),  # a DataLoader worker crash mid-run
    (empty_idx, "data holds a half split 'valid' (valid.idx is cut short or damaged: 0 bytes)"),  # an AssertionError traceback
    (damaged_idx, "valid.idx is cut short or damaged: a header fairseq cannot read (version 1, element type code 99"),
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("make,expected", DATA_CASES, ids=[c[0].__name__ for c in DATA_CASES])
@pytest.mark.parametrize("script", ["alibi-eval-lm", "alibi-sweep"])
def test_unreadable_data_files_are_named(make, expected, script, alibi_checkpoint, lm_data_bin, tmp_path):
    data = make(lm_data_bin, tmp_path)
    args = {"alibi-eval-lm": ["--path", alibi_checkpoint, "--gen-subset", "valid"],
            "alibi-sweep": ["-c", f"m={alibi_checkpoint}", "--lengths", "1x", "--methods", "none", "--no-progress",
                            "-o", tmp_path / "sweep"]}[script]
    result = run_cli([tool(script), data, "--cpu", *args], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, expected)
    assert "Exception ignored" not in result.output and "ppl=" not in result.output


# ------------------------------------------------------------ values that do not fit
BATCH_CASES = [
    # fairseq puts one whole sample in a batch: an AssertionError (eval) or IndexError (train) otherwise
    ("alibi-eval-lm", ["--tokens-per-sample", "64", "--max-tokens", "10"],
     "a sample is longer than the batch limit of 10 tokens (--max-tokens)"),
    ("alibi-train", ["--max-tokens", "10"], "--max-tokens 10 is smaller than one training sample"),
    # paths of the wrong kind
    ("alibi-train", ["--save-dir", "FILE"], "FILE is a file, not a directory"),
    ("alibi-sweep", ["-c", "LOOP"], "LOOP is a broken symbolic link"),
    ("alibi-hydra-train", ["--config-dir", "DIR", "--config-name", "wikitext103_alibi_L51"],
     "did you mean wikitext103_alibi_L512"),
    ("alibi-hydra-train", ["--config-dir", "FILE", "--config-name", "x"], "--config-dir FILE is a file"),
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("script,extra,expected", BATCH_CASES, ids=[f"{c[0]} {c[1][0]}" for c in BATCH_CASES])
def test_values_that_cannot_work_are_refused(script, extra, expected, alibi_checkpoint, lm_data_bin, tmp_path):
    from conftest import EXAMPLES, train_args

    (tmp_path / "FILE").write_text("")
    (tmp_path / "LOOP").symlink_to("LOOP")
    extra = [str(EXAMPLES / "language_model" / "config") if a == "DIR" else a for a in extra]
    args = {"alibi-eval-lm": [lm_data_bin, "--path", alibi_checkpoint, "--gen-subset", "valid", "--cpu"],
            "alibi-train": train_args(lm_data_bin, tmp_path / "ckpt", max_update=1),
            "alibi-sweep": [lm_data_bin, "--cpu", "--no-progress"], "alibi-hydra-train": []}[script]
    if "--max-tokens" in extra and "--batch-size" in args:
        del args[args.index("--batch-size"):args.index("--batch-size") + 2]
    result = run_cli([tool(script), *args, *extra], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, expected)
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


# ------------------------------------------------------------ the Python API alike
def test_python_api_refuses_alike(tmp_path, monkeypatch):
    """A full disk while fairseq saves a checkpoint: one error, no retries, no
    half-written .tmp; an HF directory without config.json; a fork conversion
    with an impossible training length."""
    import errno

    from fairseq import checkpoint_utils

    from fairseq_alibi import fork, hf

    def full(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    target = tmp_path / "checkpoint_last.pt"
    with pytest.raises(errors.UserError, match="cannot write .*checkpoint_last.pt: No space left on device"):
        checkpoint_utils.torch_persistent_save({"x": 1}, str(target))
    assert os.listdir(tmp_path) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.HFLoadError, match="holds no config.json"):
        hf.load_hf_model(str(tmp_path / "empty"))
    with pytest.raises(errors.CheckpointError, match="--train-length -1 is not valid"):
        fork.convert_fork_state({"model": {}}, train_length=-1)


HUB_PATH_CASES = [
    # fairseq answered a TypeError about None, or unpacked a text file as an archive (CompressionError)
    ("missing", "CK", "DATA", "model directory .*missing not found"),
    ("CKDIR", "nope.pt", "DATA", "checkpoint file not found: .*nope.pt"),
    ("CKDIR", "CK", "missing", "data directory .*missing not found"),
    ("CKDIR", "CK", "FILE", "data directory .*notes.txt is a file, not a directory"),
]


@pytest.mark.parametrize("model_dir,checkpoint,data,expected", HUB_PATH_CASES)
def test_hub_paths_are_named(model_dir, checkpoint, data, expected, alibi_checkpoint, lm_data_bin, tmp_path):
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    (tmp_path / "notes.txt").write_text("not a data directory\n")
    named = {"CKDIR": str(alibi_checkpoint.parent), "CK": alibi_checkpoint.name, "DATA": str(lm_data_bin),
             "FILE": str(tmp_path / "notes.txt"), "missing": str(tmp_path / "missing")}
    with pytest.raises(errors.UserError, match=expected):
        AlibiTransformerLanguageModel.from_pretrained(named.get(model_dir, model_dir), named.get(checkpoint, checkpoint),
                                                      data_name_or_path=named.get(data, data))


# ------------------------------------------------------------ fairseq's own checks while building
BUILD_CASES = [
    # fairseq's AssertionError, 59 lines of traceback
    ("alibi-train", ["--decoder-embed-dim", "30", "--decoder-attention-heads", "4"],
     "embed_dim must be divisible by num_heads (fairseq/modules/multihead_attention.py"),
    ("alibi-train", ["--arch", "transformer_lm", "--decoder-embed-dim", "30", "--decoder-attention-heads", "4"],
     "embed_dim must be divisible by num_heads"),
    ("alibi-train", ["--arch", "transformer_lm_wiki103_alibi", "--adaptive-input-cutoff", "10,200",
                     "--adaptive-softmax-cutoff", "10,200"], "cannot specify cutoff larger than vocab size"),
    # torch's error on a size fairseq computed from the options
    ("alibi-train", ["--arch", "transformer_lm_wiki103_alibi", "--adaptive-input-cutoff", "20,10",
                     "--adaptive-softmax-cutoff", "20,10"], "negative dimension -10: [-10, 12] (fairseq/modules/adaptive_input.py"),
    # the paper's config on a 32-word dictionary: Hydra printed its own traceback
    ("alibi-hydra-train", ["model.decoder_layers=1"], "cannot specify cutoff larger than vocab size"),
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("script,extra,expected", BUILD_CASES, ids=[" ".join(c[1][:2]) for c in BUILD_CASES])
def test_options_fairseq_cannot_build_from_are_one_line(script, extra, expected, alibi_checkpoint, lm_data_bin,
                                                         tmp_path):
    from conftest import train_args

    from conftest import EXAMPLES

    args = {"alibi-train": train_args(lm_data_bin, tmp_path / "ckpt", max_update=1),
            "alibi-eval-lm": [lm_data_bin, "--path", alibi_checkpoint, "--gen-subset", "valid", "--cpu"],
            "alibi-hydra-train": ["--config-dir", EXAMPLES / "language_model" / "config", "--config-name",
                                  "wikitext103_alibi_L512", f"task.data={lm_data_bin}", "common.cpu=true",
                                  f"hydra.run.dir={tmp_path}", f"checkpoint.save_dir={tmp_path / 'ckpt'}"]}[script]
    result = run_cli([tool(script), *args, *extra], expect_ok=False, cwd=tmp_path)
    line = assert_one_error(result, "fairseq cannot build the model from the options given", expected)
    assert "model family" not in line and not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


def test_the_hub_api_raises_the_same_error_and_bugs_keep_their_traceback(alibi_checkpoint, lm_data_bin):
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel
    from fairseq_alibi.patches import build_errors

    # a trained model's shape is refused as such before fairseq builds anything (tests/test_trust.py)
    with pytest.raises(errors.ConfigError, match="decoder_attention_heads=5 cannot apply to this checkpoint"):
        AlibiTransformerLanguageModel.from_pretrained(str(alibi_checkpoint.parent), alibi_checkpoint.name,
                                                      data_name_or_path=str(lm_data_bin), decoder_attention_heads=5)

    def ours():  # raised here, not in fairseq: a bug, left as it is
        raise AssertionError("a bug of this package")

    with pytest.raises(AssertionError, match="a bug of this package"):
        build_errors._checked(ours, "build_model")()


@pytest.mark.slow
def test_alibi_train_defaults_are_those_its_help_shows(lm_data_bin, tmp_path):
    """No --task: language_modeling (stock fairseq-train's translation rejected --tokens-per-sample);
    no --arch: transformer_lm_alibi for that task (a bare RuntimeError before), named for another."""
    from conftest import train_args

    args = train_args(lm_data_bin, tmp_path / "ckpt", max_update=1)
    for flag in ("--task", "--arch"):
        del args[args.index(flag):args.index(flag) + 2]
    result = run_cli([tool("alibi-train"), *args])
    assert "'_name': 'transformer_lm_alibi'" in result.output and "'_name': 'language_modeling'" in result.output
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()
    result = run_cli([tool("alibi-train"), lm_data_bin, "--task", "masked_lm", "--cpu"], expect_ok=False)
    assert_one_error(result, "--task masked_lm needs an --arch")


@pytest.mark.parametrize("given,added", [
    ([], []),  # fairseq-eval-lm's 36000 holds a default block
    (["--tokens-per-sample", "100000", "--batch-size", "1"], ["--max-tokens", "100000"]),  # refused before
    (["--tokens-per-sample", "40000"], ["--max-tokens", "40000"]),
    (["--tokens-per-sample", "1024", "--batch-size", "64"], ["--max-tokens", "65536"]),
    (["--batch-size", "4"], []),
    (["--tokens-per-sample", "2147483647", "--batch-size", "2"], ["--max-tokens", "2147483647"]),
    (["--tokens-per-sample", "100000", "--max-tokens", "10"], []),  # the user's limit is the user's
])
def test_eval_lm_batch_size_alone_has_no_hidden_token_limit(given, added):
    from fairseq_alibi import cli

    assert cli.eval_lm_batches(list(given)) == given + added


# ------------------------------------------------------------ what a log receives
@pytest.mark.slow
def test_a_redirected_sweep_has_no_bars_and_each_cell_says_the_time_left(alibi_checkpoint, lm_data_bin, tmp_path):
    result = run_cli([tool("alibi-sweep"), lm_data_bin, "-c", f"m={alibi_checkpoint}", "--lengths", "1x,2x",
                      "--methods", "none", "--cpu", "-o", tmp_path / "sweep"])  # stdout and stderr are pipes
    assert "\r" not in result.output and "cell/s" not in result.output, result.output[-2000:]
    cells = [line for line in result.output.splitlines() if "ppl=" in line]
    assert len(cells) == 2 and "[cell 1/2, " in cells[0] and cells[0].endswith(" left]"), cells
    assert "[cell 2/2, " in cells[1] and cells[1].endswith(", done]"), cells


def test_the_hub_keeps_its_whole_config_for_debug(alibi_checkpoint, lm_data_bin, caplog):
    import logging

    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    def load():
        AlibiTransformerLanguageModel.from_pretrained(str(alibi_checkpoint.parent), alibi_checkpoint.name,
                                                      data_name_or_path=str(lm_data_bin))
        return [r for r in caplog.records if r.name == "fairseq.models.fairseq_model" and not isinstance(r.msg, str)]

    with caplog.at_level(logging.INFO):
        assert load() == []
    with caplog.at_level(logging.DEBUG, logger="fairseq.models.fairseq_model"):
        assert len(load()) == 1  # still there for DEBUG: the filter drops what it should only


@pytest.mark.parametrize("data,models,expected", [
    ("FILE", ["-c", "m=CK", "--hf", "x=HF"], "DATA must be the checkpoints' fairseq-preprocess directory"),
    ("DATA", ["-c", "m=CK", "--hf", "m=HF"], "a checkpoint and a --hf model are both named m"),
])
def test_checkpoints_beside_hf_models_need_one_directory_and_distinct_names(data, models, expected, alibi_checkpoint,
                                                                             lm_data_bin, tmp_path, capsys):
    from fairseq_alibi.evaluation import perplexity

    (tmp_path / "text.txt").write_text("one the cat sees a tree .\n")
    named = {"FILE": str(tmp_path / "text.txt"), "DATA": str(lm_data_bin), "CK": str(alibi_checkpoint),
             "HF": str(tmp_path)}
    argv = [named[data]] + [a.replace("CK", named["CK"]).replace("HF", named["HF"]) for a in models]
    with pytest.raises(SystemExit) as exit_status:
        perplexity.main(argv + ["--cpu", "--no-progress", "-o", str(tmp_path / "out")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_status.value.code == 1 and len(lines) == 1 and expected in lines[0], lines
