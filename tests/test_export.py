"""alibi-export-hf: fairseq ALiBi LMs as Hugging Face models.

The reference for every number is the fairseq model itself (fairseq's own
modules, built in-process from the same checkpoint, rescaled with
``attention.rescale``), plus one forward written out here from the exported
weights with the paper's bias formula (``naive_log_probs``).  The tiny models
are built as fairseq-train builds them (parser, arch, ``task.build_model``)
with random weights large enough that attention, and so ALiBi, shapes the
output; 6 heads (not a power of two), trained length ``L`` = 16.
"""

from __future__ import annotations

import json
import math
import random
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, cli_env, fairseq_config, fork_layout, run_cli, same_bits, tool
from fairseq_alibi import hf
from fairseq_alibi.models import attention
from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import METHODS as SCALING_METHODS, NO_SCALING, Scaling
from fairseq_alibi.core.errors import ScalingError
from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
from fairseq_alibi.errors import ConfigError, ExportError, HFLoadError
from fairseq_alibi.evaluation.hf_backend import token_log_probs
from fairseq_alibi.export import main as export_main
from fairseq_alibi.export import writer
from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

L = 16
WORDS = 40
DIM, HEADS = 24, 6
COMMON = ["--decoder-layers", "2", "--decoder-embed-dim", str(DIM), "--decoder-attention-heads", str(HEADS),
          "--decoder-ffn-embed-dim", "40", "--dropout", "0", "--attention-dropout", "0"]
ADAPTIVE = ["--adaptive-input-cutoff", "12,24", "--adaptive-softmax-cutoff", "12,24",
            "--adaptive-input-factor", "2", "--adaptive-softmax-factor", "2"]
#: Every transformer_lm_alibi variant the default format must reproduce exactly.
VARIANTS = {
    "postnorm-relu-scaled-untied": ["--arch", "transformer_lm_alibi"],
    "prenorm-gelu-tied-lnemb": ["--decoder-normalize-before", "--activation-fn", "gelu",
                                "--share-decoder-input-output-embed", "--layernorm-embedding"],
    "tanh-unscaled-projections-nofinalnorm": ["--decoder-normalize-before", "--activation-fn", "gelu_accurate",
                                              "--no-scale-embedding", "--decoder-input-dim", "16",
                                              "--decoder-output-dim", "20", "--no-decoder-final-norm"],
    "wiki103-adaptive-tied": ["--arch", "transformer_lm_wiki103_alibi", *ADAPTIVE, "--decoder-input-dim", str(DIM),
                              "--decoder-output-dim", str(DIM)],
    "adaptive-untied-input-proj": ["--decoder-normalize-before", "--adaptive-input", *ADAPTIVE,
                                   "--decoder-input-dim", "32", "--decoder-output-dim", "20"],
    "normformer-tanh": ["--decoder-normalize-before", "--scale-attn", "--scale-fc", "--scale-heads",
                        "--scale-resids", "--activation-fn", "tanh"],
}
#: Every context-extension method, static and dynamic.
METHODS = ["none", "linear:2", "linear", "ntk:3", "ntk", "cap", "cap:0.5", "log", "log:0.5:1", "power", "capnorm", "logn"]
BLOOM_ARGS = ["--arch", "transformer_lm_bloom_alibi", "--decoder-ffn-embed-dim", str(4 * DIM)]


# ------------------------------------------------------------------ building fairseq models
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A data directory with a 40-word dict.txt (44 symbols with fairseq's 4 specials)."""
    path = tmp_path_factory.mktemp("export_data")
    (path / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(WORDS)))
    return path


def build(data_dir, extra, seed: int = 0, std: float = 0.4):
    """(fairseq model in eval mode, cfg) as fairseq-train builds them, random weights."""
    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
    from fairseq import tasks

    cfg = fairseq_config([str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_alibi",
                          "--tokens-per-sample", str(L), "--cpu", *COMMON, *extra])
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * std
            parameter.copy_(1 + noise / 4 if "norm" in name or "_ln" in name else noise)
    return model.eval(), cfg


def save(model, cfg, path: Path) -> Path:
    """A checkpoint as fairseq 0.12 writes it (cfg a plain resolved dict)."""
    torch.save({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": model.state_dict(),
                "args": None, "optimizer_history": [], "extra_state": {}}, path)
    return path


def captured(main, *args) -> tuple:
    """(exit status, stdout + stderr) of a console script's ``main(ARGS)`` run in-process."""
    from io import StringIO
    from contextlib import redirect_stderr, redirect_stdout

    out = StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            status = main([str(a) for a in args])
        except SystemExit as exc:
            status = exc.code
    return status, out.getvalue()


def export(*args) -> tuple:
    """(exit status, stdout + stderr) of ``alibi-export-hf ARGS`` run in-process."""
    return captured(export_main, *args)


def exported(model, cfg, tmp_path, *options, name="out") -> Path:
    checkpoint = save(model, cfg, tmp_path / f"{name}.pt")
    status, output = export(checkpoint, tmp_path / name, *options)
    assert status == 0, output
    return tmp_path / name


def checkpoint_and_export(data_dir, tmp_path) -> tuple:
    """(a checkpoint fairseq's own loader reads, its export) of a default model."""
    model, cfg = build(data_dir, [])
    checkpoint = save(model, cfg, tmp_path / "model.pt")
    state = torch.load(checkpoint, weights_only=True)  # fairseq's loader reads the last optimizer history entry
    state["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                   "lr_scheduler_state": {}, "num_updates": 0}]
    torch.save(state, checkpoint)
    return checkpoint, exported(model, cfg, tmp_path)


def tokens(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(4, 4 + WORDS, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 2  # </s> first, as fairseq-eval-lm feeds a block
    return ids


def fairseq_log_probs(model, ids, scaling=NO_SCALING) -> torch.Tensor:
    attention.rescale(model, scaling)
    with torch.no_grad():
        return model.get_normalized_probs(model(ids), log_probs=True).float()


def hf_log_probs(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits.float().log_softmax(-1)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow
def test_every_variant_matches_fairseq_under_every_method(variant, data_dir, tmp_path):
    """fp32 log-probs within 1e-4 at 4 L for each method, static and dynamic."""
    model, cfg = build(data_dir, VARIANTS[variant])
    out = exported(model, cfg, tmp_path)
    loaded, _ = hf.load_hf_model(str(out), progress=False)
    assert type(loaded) is AlibiForCausalLM
    ids = tokens(4 * L)
    for spelling in METHODS:
        scaling = Scaling.parse(spelling, L).complete()
        loaded.set_alibi_scaling(scaling)
        difference = max_diff(hf_log_probs(loaded, ids), fairseq_log_probs(model, ids, scaling))
        assert difference < 1e-4, (spelling, difference)
    assert difference < 1e-4


def naive_log_probs(weights, config: AlibiLMConfig, ids: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """Pre-norm LM forward written out from the exported weights and the paper's
    bias ``-m (i - j)``: no code shared with fairseq_alibi."""
    import math

    w = {k: v.float() for k, v in weights.items()}
    length, heads = ids.shape[1], config.attention_heads
    head_dim = config.hidden_size // heads
    x = w["model.embed_tokens.weight"][ids[0]] * config.embed_scale
    x = torch.nn.functional.layer_norm(x, (config.hidden_size,), w["model.layernorm_embedding.weight"],
                                       w["model.layernorm_embedding.bias"])
    i = torch.arange(length)
    bias = -slopes[:, None, None] * (i[:, None] - i[None, :]).float()
    bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
    for n in range(config.layers):
        p = f"model.layers.{n}."

        def lin(name, y):
            return y @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def norm(name, y):
            return torch.nn.functional.layer_norm(y, (config.hidden_size,), w[p + name + ".weight"], w[p + name + ".bias"])

        h = norm("self_attn_layer_norm", x)
        q, k, v = (lin(f"self_attn.{c}_proj", h).view(length, heads, head_dim).transpose(0, 1) for c in "qkv")
        scores = q @ k.transpose(1, 2) / math.sqrt(head_dim) + bias
        x = x + lin("self_attn.out_proj", (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, -1))
        h = lin("fc1", norm("final_layer_norm", x))
        x = x + lin("fc2", 0.5 * h * (1 + torch.erf(h / math.sqrt(2))))
    x = torch.nn.functional.layer_norm(x, (config.hidden_size,), w["model.layer_norm.weight"], w["model.layer_norm.bias"])
    return (x @ w["model.embed_tokens.weight"].T).log_softmax(-1)


def test_exported_model_matches_a_forward_written_out_by_hand(data_dir, tmp_path):
    from safetensors.torch import load_file

    model, cfg = build(data_dir, VARIANTS["prenorm-gelu-tied-lnemb"])
    out = exported(model, cfg, tmp_path, "--alibi-scaling", "linear:2")
    config = AlibiLMConfig.from_pretrained(out)
    weights = load_file(out / "model.safetensors")
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: saved once
    paper = [2 ** (-8 / 4 * (h + 1)) for h in range(4)] + [2 ** (-8 / 8 * (2 * h + 1)) for h in range(2)]
    ids = tokens(4 * L)
    expected = naive_log_probs(weights, config, ids, torch.tensor(paper) / 2)
    loaded, _ = hf.load_hf_model(str(out), progress=False)
    assert max_diff(hf_log_probs(loaded, ids)[0], expected) < 1e-4


@pytest.mark.slow
def test_converted_fork_checkpoint_exports_and_an_unconverted_one_is_refused(data_dir, tmp_path):
    from fairseq_alibi.fork import convert_fork_state

    model, cfg = build(data_dir, VARIANTS["wiki103-adaptive-tied"])
    state = {"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": model.state_dict(),
             "args": None, "optimizer_history": [], "extra_state": {}}
    fork = tmp_path / "alibi_wt103_L16.pt"
    torch.save(fork_layout(state, L), fork)
    status, output = export(fork, tmp_path / "refused")
    assert status == 1 and "alibi-convert-checkpoint" in one_error_line(output)
    assert not (tmp_path / "refused").exists()
    converted = tmp_path / "converted.pt"
    torch.save(convert_fork_state(torch.load(fork, weights_only=False)), converted)
    status, output = export(converted, tmp_path / "out")
    assert status == 0, output
    loaded, _ = hf.load_hf_model(str(tmp_path / "out"), progress=False)
    assert loaded.config.alibi_train_length == L and loaded.config.adaptive_softmax["tie_proj"]
    ids = tokens(4 * L)
    assert max_diff(hf_log_probs(loaded, ids), fairseq_log_probs(model, ids)) < 1e-4


#: name -> (the fork file's float dtype, a weight changed on its way to the file)
CONVERTED = {"float32": (torch.float32, False), "float16": (torch.float16, False),
             "float32-perturbed-write": (torch.float32, True)}


@pytest.mark.parametrize("name", list(CONVERTED))
def test_alibi_convert_checkpoint_prints_what_the_file_it_wrote_holds(name, data_dir, tmp_path, monkeypatch):
    """alibi-convert-checkpoint reads back the file it wrote before the rename: what it
    prints (arch, training length, weight count and dtype, bit for bit the input's)
    is counted here from the written file; a write that changed a weight is refused
    and leaves nothing."""
    from fairseq_alibi import fork

    dtype, perturbed = CONVERTED[name]
    model, cfg = build(data_dir, VARIANTS["wiki103-adaptive-tied"])
    state = fork_layout({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                         "model": model.state_dict(), "args": None, "optimizer_history": [], "extra_state": {}}, L)
    state["model"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, tmp_path / "fork.pt")
    if perturbed:
        save = torch.save

        def perturbing_save(obj, path, *args, **kwargs):
            weights = dict(obj["model"])
            weights["decoder.layers.0.fc1.weight"] = weights["decoder.layers.0.fc1.weight"] + 1e-3
            return save(dict(obj, model=weights), path, *args, **kwargs)

        monkeypatch.setattr(fork.torch, "save", perturbing_save)
    (tmp_path / "out").mkdir()
    status, output = captured(fork.main, tmp_path / "fork.pt", tmp_path / "out" / "converted.pt")
    if perturbed:
        assert status == 1 and "does not hold the input's weights" in one_error_line(output)
        assert "nothing written" in output and os.listdir(tmp_path / "out") == []
        return
    assert status == 0, output
    print(output)  # docs/export.md quotes it (pytest -s)
    written = torch.load(tmp_path / "out" / "converted.pt", weights_only=True)
    kept = {k: v for k, v in state["model"].items() if "embed_positions" not in k}
    assert len(kept) == len(state["model"]) - 1 and set(written["model"]) == set(kept)
    assert [k for k, v in written["model"].items() if not same_bits(v, kept[k])] == []  # bits, not values
    assert output.splitlines() == [
        f"wrote {tmp_path / 'out' / 'converted.pt'}: arch {written['cfg']['model']['_name']}, alibi_train_length "
        f"{written['cfg']['model']['alibi_train_length']}; read back: {len(written['model'])} weight tensors "
        f"({str(dtype)[6:]}), bit for bit the input's (its unused position buffer dropped)"]
    assert written["cfg"]["model"]["_name"] == "transformer_lm_wiki103_alibi" and \
        written["cfg"]["model"]["alibi_train_length"] == L


@pytest.mark.slow
def test_scaling_set_at_export_and_at_load_time(data_dir, tmp_path):
    model, cfg = build(data_dir, [])
    out = exported(model, cfg, tmp_path, "--alibi-scaling", "ntk")
    assert json.loads((out / "config.json").read_text())["alibi_scaling"] == {"type": "ntk", "train_seq_len": L}
    ids = tokens(4 * L)
    dynamic = Scaling("ntk", 0, L)
    loaded, _ = hf.load_hf_model(str(out), progress=False)
    assert max_diff(hf_log_probs(loaded, ids), fairseq_log_probs(model, ids, dynamic)) < 1e-4
    override = AlibiForCausalLM.from_pretrained(out, alibi_scaling={"type": "cap", "factor": 2.0}).eval()
    assert max_diff(hf_log_probs(override, ids), fairseq_log_probs(model, ids, Scaling("cap", 2.0, L))) < 1e-4
    with pytest.raises(ScalingError, match=r"^alibi_scaling=\{'type': 'ntk'\} is not valid; .*exactly one"):
        AlibiForCausalLM.from_pretrained(out, alibi_scaling={"type": "ntk"})


@pytest.mark.parametrize("spelling", METHODS)
def test_alibi_scaling_dictionary_round_trips(spelling):
    scaling = Scaling.parse(spelling, L).complete()
    assert Scaling.from_hf(scaling.to_hf(), L) == scaling


@pytest.mark.parametrize("value, message", [
    ({"type": "rope", "factor": 2}, "type must be one of " + ", ".join(SCALING_METHODS)),
    ({"type": "cap", "factor": 1, "alpha": 0.5}, "only the tails \\(log, power\\) take alpha"),
    ({"type": "log", "factor": 1, "alpha": 0}, "alpha=0"),
    ({"type": "linear", "factor": 2, "train_seq_len": 8}, "exactly one of them"),
    ({"type": "linear", "factor": 0.5}, "linear takes a static factor >= 1"),
    ({"type": "cap", "train_seq_len": 8}, "cap takes"),
    ({"type": "linear", "factor": 2, "scale": 1}, "unknown key"),
    ({"type": "linear", "train_seq_len": 0}, "train_seq_len=0"),
    ("linear", "give a dictionary"),
])
def test_bad_alibi_scaling_is_one_line_naming_it(value, message):
    with pytest.raises(ScalingError, match=message) as error:
        Scaling.from_hf(value, L)
    assert str(error.value).startswith("alibi_scaling=") and "\n" not in str(error.value)


# ------------------------------------------------------------------ the export's check (what it prints)
#: The check's input, as docs/export.md states it: 24 ids of dict.txt's words (seed 0), </s> first.
CHECK_IDS = torch.randint(4, 4 + WORDS, (1, 24), generator=torch.Generator().manual_seed(0))
CHECK_IDS[0, 0] = 2
CHECK_LINE = re.compile(r"^check: the written files loaded back, against the checkpoint \((\S+) weights, computed in "
                        r"float32\), on 24 random tokens: max \|log-prob difference\| (\S+)(?: \((\w+) rounding\); "
                        r"same-precision difference (\S+) \(against the fairseq model given the same (\w+) weights, "
                        r"both computed in float32\))?$", re.MULTILINE)
#: name -> (build arguments, weight std, the checkpoint's weights in float16, export options, the files' dtype)
CHECKED = {
    "custom-bfloat16": ([], 0.4, False, ["--dtype", "bfloat16"], torch.bfloat16),
    "custom-float16-adaptive": (VARIANTS["wiki103-adaptive-tied"], 0.4, False, ["--dtype", "float16"], torch.float16),
    "bloom-bfloat16": (BLOOM_ARGS, 0.2, False, ["--format", "bloom", "--dtype", "bfloat16"], torch.bfloat16),
    "custom-float32-linear2": (VARIANTS["prenorm-gelu-tied-lnemb"], 0.4, False, ["--alibi-scaling", "linear:2"],
                               torch.float32),
    "float16-checkpoint-float32-export": ([], 0.4, True, [], torch.float32),
}


def read_back(out: Path, custom: bool):
    """The written model as a user loads it with transformers alone (the files'
    dtype): stock BLOOM, or the class ``config.json``'s ``auto_map`` names from the
    directory's code, which ``AutoModelForCausalLM.from_pretrained(out,
    trust_remote_code=True)`` takes in a fresh process (in this one, once
    ``hf.load_hf_model`` has registered this package's class, it would take
    that); its remote code cached away from the user's cache."""
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from fairseq_alibi.export.check import private_module_cache

    with private_module_cache(), hf.quiet_transformers():
        if not custom:
            return AutoModelForCausalLM.from_pretrained(out).eval()
        reference = json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        return get_class_from_dynamic_module(reference, str(out)).from_pretrained(out).eval()


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", list(CHECKED))
def test_the_printed_check_is_what_the_written_files_compute(name, data_dir, tmp_path):
    """Each number alibi-export-hf prints equals one computed here from the files
    it wrote, loaded back with transformers: the precision the files lost against
    the checkpoint as given (nonzero for bfloat16 and float16), and the difference
    left when fairseq is given the same rounded weights (0 up to float32 rounding)."""
    extra, std, half_checkpoint, options, dtype = CHECKED[name]
    model, cfg = build(data_dir, extra, std=std)
    if half_checkpoint:  # a checkpoint saved by --fp16 training: its float16 values are the model
        model.half().float()
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    if half_checkpoint:
        state = torch.load(checkpoint, weights_only=False)
        state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
        torch.save(state, checkpoint)
    status, output = export(checkpoint, tmp_path / "out", *options)
    assert status == 0, output
    print(output)  # docs/export.md quotes these lines (pytest -s)
    printed = CHECK_LINE.search(output)
    assert printed, output
    custom = "bloom" not in options
    loaded = read_back(tmp_path / "out", custom)
    assert loaded.dtype == dtype
    assert type(loaded).__module__.startswith("transformers_modules." if custom else "transformers.models.bloom")
    assert f"wrote {tmp_path / 'out'}: {type(loaded).__name__} " in output and f", {str(dtype)[6:]}, " in output
    scaling = Scaling.parse(options[options.index("--alibi-scaling") + 1], L) if "--alibi-scaling" in options \
        else NO_SCALING
    rounding = max_diff(hf_log_probs(loaded, CHECK_IDS), fairseq_log_probs(model, CHECK_IDS, scaling))
    assert printed[1] == ("float16" if half_checkpoint else "float32")
    assert float(printed[2]) == pytest.approx(rounding, rel=0.05, abs=1e-12)
    if dtype == torch.float32:
        assert printed[3] is None and rounding < 1e-4
        return
    assert printed[3] == printed[5] == str(dtype)[6:] and rounding > 1e-3  # lossy: never printed as 0
    rounded = model.to(dtype).float()
    same = max_diff(hf_log_probs(loaded.float(), CHECK_IDS), fairseq_log_probs(rounded, CHECK_IDS, scaling))
    assert float(printed[4]) == pytest.approx(same, rel=0.05, abs=1e-12) and same < 1e-5


def perturbing_save(cls):
    """``cls.save_pretrained`` that first adds 1 to one weight of the first layer: a conversion bug."""
    original = cls.save_pretrained

    def save_pretrained(self, *args, **kwargs):
        name, weight = next((n, p) for n, p in self.named_parameters() if ".0." in n and p.dim() == 2)
        with torch.no_grad():
            weight[0, 0] += 1
        return original(self, *args, **kwargs)

    return save_pretrained


def tampered_code(tmp_path):
    """The traveling files with a modeling_alibi.py whose logits are off by 0.01 at one id."""
    files = []
    for path in writer.traveling_files():
        if path.endswith("modeling_alibi.py"):
            (tmp_path / "code").mkdir()
            text = Path(path).read_text() + (
                "\n_forward = AlibiForCausalLM.forward\n\n\n"
                "def _tampered(self, *args, **kwargs):\n"
                "    out = _forward(self, *args, **kwargs)\n"
                "    out.logits[..., 5] += 0.01\n"
                "    return out\n\n\nAlibiForCausalLM.forward = _tampered\n")
            path = tmp_path / "code" / "modeling_alibi.py"
            path.write_text(text)
        files.append(str(path))
    return lambda: files


#: name -> (build arguments, weight std, export options, what to break, the error's words)
REFUSED = {
    "custom-float32-perturbed": ([], 0.4, [], "weight", "by .* in log-probabilities beyond float32 rounding"),
    "custom-bfloat16-perturbed": ([], 0.4, ["--dtype", "bfloat16"], "weight", "beyond bfloat16 rounding"),
    "bloom-float16-perturbed": (BLOOM_ARGS, 0.2, ["--format", "bloom", "--dtype", "float16"], "weight",
                                "beyond float16 rounding"),
    "custom-tampered-code": ([], 0.4, [], "code", "beyond float32 rounding .*a bug, please report it"),
    "custom-float16-overflow": ([], 10.0, ["--dtype", "float16"], None,
                                "written float16 model's log-probabilities are not finite .*--dtype bfloat16 or float32"),
    "checkpoint-overflows-float32": ([], 1e20, [], None, "the checkpoint's own log-probabilities are not finite"),
}


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_written_model_that_is_not_the_checkpoint_is_refused_and_nothing_written(name, data_dir, tmp_path,
                                                                                   monkeypatch):
    """The check reads the staged files: a weight changed on its way to the file,
    modeling code that computes something else, float16 activations that
    overflow (or a checkpoint whose own do in float32) are refused in one line,
    and the output directory never appears."""
    from transformers import BloomForCausalLM

    extra, std, options, broken, message = REFUSED[name]
    model, cfg = build(data_dir, extra, std=std)
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    if broken == "weight":
        cls = BloomForCausalLM if "bloom" in options else AlibiForCausalLM
        monkeypatch.setattr(cls, "save_pretrained", perturbing_save(cls))
    elif broken == "code":
        monkeypatch.setattr(writer, "traveling_files", tampered_code(tmp_path))
    status, output = export(checkpoint, tmp_path / "models" / "out", *options)
    assert status == 1 and re.search(message, one_error_line(output)), output
    assert "nothing written" in output and "wrote" not in output
    assert not (tmp_path / "models" / "out").exists() and os.listdir(tmp_path / "models") == []


def test_the_check_leaves_the_users_remote_code_cache_and_modules_alone(data_dir, tmp_path, monkeypatch):
    """Reading back the staged directory runs its code through transformers'
    remote-code cache: none of it lands in the user's cache (a folder named
    after the temporary stage) or stays in ``sys.modules``."""
    from transformers import dynamic_module_utils

    user_cache = tmp_path / "user-modules"
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(user_cache))
    before = {n for n in sys.modules if n.startswith("transformers_modules")}
    model, cfg = build(data_dir, [])
    exported(model, cfg, tmp_path)
    assert not user_cache.exists() and dynamic_module_utils.HF_MODULES_CACHE == str(user_cache)
    assert {n for n in sys.modules if n.startswith("transformers_modules")} == before


# ------------------------------------------------------------------ in use
def test_left_padded_rows_score_as_their_unpadded_runs(data_dir, tmp_path):
    model, cfg = build(data_dir, VARIANTS["prenorm-gelu-tied-lnemb"])
    loaded, _ = hf.load_hf_model(str(exported(model, cfg, tmp_path)), progress=False)
    lengths = [4 * L, 3 * L, 2 * L + 5]
    rows = [tokens(n, seed=n)[0] for n in lengths]
    batch = torch.full((len(rows), max(lengths)), 1)
    mask = torch.zeros_like(batch)
    for r, row in enumerate(rows):
        batch[r, -len(row):], mask[r, -len(row):] = row, 1
    for spelling in ("none", "ntk", "linear:2", "cap:0.5"):
        loaded.set_alibi_scaling(Scaling.parse(spelling, L))
        padded = hf_log_probs(loaded, batch, attention_mask=mask)
        assert torch.isfinite(padded[mask.bool()]).all()
        for r, row in enumerate(rows):
            alone = hf_log_probs(loaded, row[None])[0]
            assert max_diff(padded[r, -len(row):], alone) < 1e-5, (spelling, r)


def fairseq_greedy(model, prompt: torch.Tensor, steps: int) -> list:
    """Greedy decoding with fairseq's incremental state, one token at a time,
    never ``<pad>`` (fairseq's SequenceGenerator sets its log-prob to -inf)."""
    state, out = {}, prompt[0].tolist()
    with torch.no_grad():
        for t in range(len(out) + steps - 1):
            net_output = model.decoder(torch.tensor([out[: t + 1]]), incremental_state=state)
            if t + 1 >= len(out):
                logp = model.get_normalized_probs(net_output, log_probs=True)[0, -1]
                logp[1] = float("-inf")
                out.append(int(logp.argmax()))
    return out


@pytest.mark.slow
def test_generate_equals_fairseq_greedy_decoding_and_the_cache_equals_a_full_forward(data_dir, tmp_path):
    from transformers.cache_utils import DynamicCache

    # pre-norm gelu, untied, weights N(0, 0.2): greedy output that varies and that the scaling
    # changes (a post-norm relu model with larger weights repeats one token, scaled or not)
    model, cfg = build(data_dir, ["--decoder-normalize-before", "--activation-fn", "gelu"], std=0.2)
    out = exported(model, cfg, tmp_path, "--alibi-scaling", "linear:2")
    loaded, _ = hf.load_hf_model(str(out), progress=False)
    prompt = tokens(L)
    steps = 3 * L
    unscaled = fairseq_greedy(model, prompt, steps)
    attention.rescale(model, Scaling("linear", 2.0, L))
    expected = fairseq_greedy(model, prompt, steps)
    assert expected != unscaled and len(set(expected[L:])) > 2  # not vacuous
    assert loaded.generation_config.suppress_tokens == [1]
    generated = loaded.generate(prompt, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                pad_token_id=1, min_new_tokens=steps)
    assert generated[0].tolist() == expected
    cache, pieces = DynamicCache(), []
    with torch.no_grad():
        for start in range(0, generated.shape[1], 7):
            step = loaded(input_ids=generated[:, start : start + 7], past_key_values=cache, use_cache=True)
            pieces.append(step.logits)
    assert max_diff(torch.cat(pieces, 1).log_softmax(-1), hf_log_probs(loaded, generated)) < 1e-5


@pytest.mark.slow
def test_batched_generate_with_left_padding(data_dir, tmp_path):
    model, cfg = build(data_dir, VARIANTS["prenorm-gelu-tied-lnemb"])
    out = exported(model, cfg, tmp_path)
    loaded, tokenizer = hf.load_hf_model(str(out), progress=False)
    texts = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert tokenizer.padding_side == "left"
    together = loaded.generate(**batch, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=1)
    for r, text in enumerate(texts):
        alone = loaded.generate(**tokenizer([text], return_tensors="pt"), max_new_tokens=12, do_sample=False,
                                eos_token_id=None)
        assert together[r, -12:].tolist() == alone[0, -12:].tolist()


@pytest.mark.slow
def test_tokenizer_ids_are_fairseq_dictionary_ids_eos_first(data_dir, tmp_path):
    from fairseq.data import Dictionary
    from transformers import AutoTokenizer

    # Trained on fairseq-preprocess's dict.txt (padded to 48 symbols with madeupwords),
    # exported with a copy of it that lost the padding.
    words = (data_dir / "dict.txt").read_text() + "hello 1\n"
    trained, given = tmp_path / "trained", tmp_path / "given"
    trained.mkdir(), given.mkdir()
    (trained / "dict.txt").write_text(words + "".join(f"madeupword{i:04d} 0\n" for i in range(3)))
    (given / "dict.txt").write_text(words)
    model, cfg = build(trained, [])
    dictionary = Dictionary.load(str(trained / "dict.txt"))
    assert len(model.decoder.embed_tokens.weight) == len(dictionary) == 48
    out = exported(model, cfg, tmp_path, "--dict", given / "dict.txt")
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    # fairseq splits on Python's whitespace (U+001F included) and reads a symbol as a whole word only
    line = ("w3 hello  w39\tnever-seen w0 </s> madeupword0001 <unk> w1</s>w2 w5\x1fw6 x<unk>y <s> w1 </s>. w2 "
            "(</s>) <unk>, <pad>")
    expected = [dictionary.eos()] + dictionary.encode_line(line, add_if_not_exist=False, append_eos=False).tolist()
    assert tokenizer(line).input_ids == expected
    assert tokenizer(line, add_special_tokens=False).input_ids == expected[1:]
    assert [tokenizer.convert_tokens_to_ids(w) for w in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 1
    assert tokenizer.decode(expected[1:3]) == "w3 hello"


def fairseq_generator_greedy(model, cfg, prompt: list, steps: int) -> list:
    """The prompt and ``steps`` greedy tokens of fairseq's own ``SequenceGenerator``
    (beam 1), run as the hub's ``sample(..., beam=1)`` runs it: the task builds the
    batch and picks the token put before the prompt; ``</s>`` barred until the end."""
    from fairseq import tasks
    from fairseq.sequence_generator import SequenceGenerator

    task = tasks.setup_task(cfg.task)
    dataset = task.build_dataset_for_inference([torch.tensor(prompt)], [len(prompt)])
    total = len(prompt) + steps
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_a=0, max_len_b=total,
                                  min_len=total)
    with torch.no_grad():
        hypo = task.inference_step(generator, [model], dataset.collater([dataset[0]]))[0][0]
    return hypo["tokens"][:-1].tolist()  # the </s> forced at max_len dropped


@pytest.mark.slow
@pytest.mark.parametrize("task_flags, spelling", [([], "linear"), (["--add-bos-token"], "ntk:2")])
def test_generate_starts_as_fairseqs_generator_does_also_with_add_bos_token(task_flags, spelling, data_dir, tmp_path):
    """A model trained with --add-bos-token reads <s> before a prompt in fairseq's inference
    (build_dataset_for_inference / inference_step), the others </s>: the tokenizer, the config's
    bos and greedy generate() past the training length follow fairseq's own generator, under
    dynamic scaling too (both take each step's factor from its number of keys)."""
    model, cfg = build(data_dir, task_flags + ["--decoder-normalize-before", "--activation-fn", "gelu"], std=0.15)
    out = exported(model, cfg, tmp_path, "--alibi-scaling", spelling)
    loaded, tokenizer = hf.load_hf_model(str(out), progress=False)
    start = 0 if task_flags else 2  # fairseq's <s> / </s>
    assert loaded.config.bos_token_id == loaded.generation_config.bos_token_id == tokenizer.bos_token_id == start
    text = "w5 w11 w0 w7 w30 w2 w19 w8"
    prompt = tokenizer(text, return_tensors="pt").input_ids
    assert prompt[0].tolist() == [start] + [4 + int(word[1:]) for word in text.split()]
    steps = 3 * L
    unscaled = fairseq_generator_greedy(model, cfg, prompt[0, 1:].tolist(), steps)
    attention.rescale(model, Scaling.parse(spelling, L).complete())
    expected = fairseq_generator_greedy(model, cfg, prompt[0, 1:].tolist(), steps)
    assert expected != unscaled  # past L the scaling changes what fairseq generates: not vacuous
    generated = loaded.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    assert generated[0, 1:].tolist() == expected


def write_gpt2_files(directory: Path):
    """A tiny GPT-2 BPE: byte pieces for a few letters and two merges."""
    pieces = ["Ġ", "a", "b", "c", "Ġa", "ab", "Ġab"]
    (directory / "encoder.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (directory / "vocab.bpe").write_text("#version: 0.2\nĠ a\na b\nĠa b\n")
    return directory / "encoder.json", directory / "vocab.bpe"


@pytest.mark.slow
def test_gpt2_bpe_tokenizer_matches_fairseq_and_missing_files_are_named(tmp_path):
    from fairseq.data import Dictionary
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder_json, vocab_bpe = write_gpt2_files(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dict.txt").write_text("".join(f"{i} {10 - i}\n" for i in (6, 1, 0, 2, 5)))  # GPT-2 ids as words
    model, cfg = build(data, ["--bpe", "gpt2", "--gpt2-encoder-json", str(tmp_path / "gone.json")])
    checkpoint = save(model, cfg, tmp_path / "bpe.pt")
    status, output = export(checkpoint, tmp_path / "missing")
    line = one_error_line(output)
    assert "--bpe gpt2" in line and "--gpt2-encoder-json PATH (recorded:" in line and "--gpt2-vocab-bpe PATH" in line
    status, output = export(checkpoint, tmp_path / "out", "--gpt2-encoder-json", encoder_json,
                            "--gpt2-vocab-bpe", vocab_bpe)
    assert status == 0, output
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", trust_remote_code=False)
    loaded, _ = hf.load_hf_model(str(tmp_path / "out"), progress=False)
    assert loaded.config.unk_aliases == 2  # pieces "Ġ" (id 0) and "c" (id 3) are not in the dictionary
    dictionary, bpe = Dictionary.load(str(data / "dict.txt")), get_encoder(str(encoder_json), str(vocab_bpe))
    for text in ("ab abc", "a b ab", "cab", "ba c"):
        pieces = " ".join(map(str, bpe.encode(text)))
        expected = [2] + dictionary.encode_line(pieces, add_if_not_exist=False, append_eos=False).tolist()
        ids = tokenizer(text, return_tensors="pt").input_ids
        as_unk = ids.masked_fill(ids >= len(dictionary), dictionary.unk())
        assert as_unk[0].tolist() == expected, text
        assert max_diff(hf_log_probs(loaded, ids), fairseq_log_probs(model, torch.tensor([expected]))) < 1e-4


# ------------------------------------------------------------------ BLOOM format
@pytest.mark.slow
def test_bloom_format_loads_as_stock_bloom_and_matches_at_4x_and_10x(data_dir, tmp_path):
    from transformers import BloomForCausalLM

    for tie in ([], ["--share-decoder-input-output-embed"]):
        model, cfg = build(data_dir, BLOOM_ARGS + tie, std=0.2)
        out = exported(model, cfg, tmp_path, "--format", "bloom", name=f"bloom{len(tie)}")
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "bloom" and "auto_map" not in config and config["seq_length"] == L
        assert not list(out.glob("*.py"))
        loaded = BloomForCausalLM.from_pretrained(out).eval()
        for factor in (4, 10):
            ids = tokens(factor * L)
            difference = max_diff(hf_log_probs(loaded, ids), fairseq_log_probs(model, ids))
            print(f"BLOOM format, tie={bool(tie)}, {factor}x L: max |log-prob difference| {difference:.1e}")
            # BLOOM adds its bias as m * (absolute key position) in fp32 (softmax removes the
            # per-row constant): rounding grows with the position, a few 1e-6 at 10x L here
            # and from run to run (2.4e-6 seen with 2e-6 as the bound); a wrong slope or
            # distance would be orders of magnitude larger.
            assert difference < 1e-5


@pytest.mark.parametrize("extra, feature", [
    ([], "post-norm layers"),
    (["--decoder-normalize-before", "--layernorm-embedding", "--activation-fn", "gelu_accurate",
      "--no-scale-embedding", "--decoder-ffn-embed-dim", str(3 * DIM)], "FFN 3x d (BLOOM: 4x d)"),
    (BLOOM_ARGS + ["--decoder-output-dim", str(DIM)], None),
    (["--decoder-normalize-before", "--layernorm-embedding", "--activation-fn", "gelu_accurate",
      "--no-scale-embedding", "--decoder-ffn-embed-dim", str(4 * DIM), "--ssmax"],
     "SSMax (learned logit scales per head)"),
])
@pytest.mark.fast_cases(1)
def test_bloom_format_refuses_what_bloom_cannot_hold_in_one_line(extra, feature, data_dir, tmp_path):
    model, cfg = build(data_dir, extra)
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    options = ["--alibi-scaling", "ntk:2"] if feature is None else []
    status, output = export(checkpoint, tmp_path / "out", "--format", "bloom", *options)
    line = one_error_line(output)
    assert status == 1 and "the BLOOM format cannot hold this model" in line and "--format custom" in line
    assert (feature or "context extension ntk:2") in line
    assert not (tmp_path / "out").exists()


def test_bloom_preset_arch_and_its_refusal(data_dir):
    model, cfg = build(data_dir, BLOOM_ARGS)
    m = cfg.model
    assert (m.decoder_normalize_before, m.layernorm_embedding, m.no_scale_embedding, m.activation_fn) == (
        True, True, True, "gelu_accurate")
    with pytest.raises(ConfigError, match=r"activation relu \(BLOOM: gelu_accurate\).*use --arch transformer_lm_alibi"):
        build(data_dir, BLOOM_ARGS + ["--activation-fn", "relu"])
    with pytest.raises(ConfigError, match=r"SSMax \(learned logit scales per head\)"):
        build(data_dir, BLOOM_ARGS + ["--ssmax"])


# ------------------------------------------------------------------ refusals and writing
def test_bad_inputs_are_one_error_line_each(data_dir, tmp_path):
    model, cfg = build(data_dir, [])
    good = save(model, cfg, tmp_path / "good.pt")
    not_lm = tmp_path / "masked.pt"
    state = torch.load(good, weights_only=False)
    state["cfg"]["task"]["_name"] = "masked_lm"
    torch.save(state, not_lm)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    no_dict = tmp_path / "nodict.pt"
    state = torch.load(good, weights_only=False)
    state["cfg"]["task"]["data"] = str(tmp_path / "moved-away")
    torch.save(state, no_dict)
    wrong_dict = tmp_path / "dict.txt"
    wrong_dict.write_text("a 1\nb 1\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    (tmp_path / "dicts").mkdir()
    (tmp_path / "dicts" / "dict.txt").write_text("a 1\n")
    cases = [
        ((tmp_path / "missing.pt", tmp_path / "o"), "checkpoint file not found"),
        ((corrupt, tmp_path / "o"), "is not a readable PyTorch checkpoint"),
        ((tmp_path, tmp_path / "o"), "is a directory"),
        ((not_lm, tmp_path / "o"), "task 'masked_lm'; alibi-export-hf exports the causal language models "
                                   "transformer_lm, transformer_lm_alibi, transformer_lm_rotary"),
        ((no_dict, tmp_path / "o"), "no dictionary for .*--dict PATH"),
        ((good, tmp_path / "o", "--dict", wrong_dict), "has 6 symbols but the checkpoint's embedding has 44 rows"),
        ((good, tmp_path / "o", "--dict", tmp_path / "none.txt"), r"--dict: dictionary \(the dict.txt .*\) not found"),
        ((good, tmp_path / "o", "--dict", tmp_path), r"--dict: .* is a directory, not a dictionary"),
        ((good, tmp_path / "o", "--alibi-scaling", "rope:2"), "method='rope' is not valid; allowed values: none, linear"),
        ((good, tmp_path / "o", "--alibi-scaling", "ntk:0.5"), "ntk takes a static factor >= 1"),
        ((good, tmp_path / "full"), "is not empty; .*--force"),
        ((good, corrupt), "exists and is not a directory"),
        # --force must never replace a directory that holds an input
        ((good, tmp_path, "--force"), "holds the input .*good.pt"),
        ((good, tmp_path / "dicts", "--dict", tmp_path / "dicts" / "dict.txt", "--force"), "holds the input .*dict.txt"),
        ((good, wrong_dict.parent / "sub" / "..", "--force"), "holds the input"),
    ]
    for args, message in cases:
        status, output = export(*args)
        assert status == 1, (args, output)
        assert re.search(message, one_error_line(output)), (message, output)
    assert (tmp_path / "full" / "keep.txt").read_text() == "x" and not (tmp_path / "o").exists()
    assert good.is_file() and (tmp_path / "dicts" / "dict.txt").is_file()


@pytest.mark.slow
def test_command_line_module_reports_one_error_line(tmp_path):
    """``python -m fairseq_alibi.export`` (what the alibi-export-hf console script runs)."""
    env = cli_env(PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "fairseq_alibi.export", str(tmp_path / "none.pt"),
                             str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert one_error_line(result.stderr) == f"error: checkpoint file not found: {tmp_path / 'none.pt'}"


def test_dynamic_scaling_without_a_training_length_is_refused(data_dir):
    from fairseq_alibi.export import Source, resolve_scaling

    unknown = Source("m.pt", None, None, None, None, NO_SCALING)
    with pytest.raises(ExportError, match="--position-scaling linear needs the training length, which m.pt does not"):
        resolve_scaling("linear", unknown)
    assert resolve_scaling("linear:2", unknown) == Scaling("linear", 2.0)


@pytest.mark.slow
def test_writing_is_atomic_and_force_replaces(data_dir, tmp_path, monkeypatch):
    model, cfg = build(data_dir, [])
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    out = tmp_path / "models" / "out"
    import transformers

    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", crash)
        status, output = export(checkpoint, out)
    assert status == 130 and "nothing written" in output
    assert not out.exists() and os.listdir(out.parent) == []
    assert export(checkpoint, out)[0] == 0
    (out / "stale.txt").write_text("old")
    assert export(checkpoint, out)[0] == 1 and (out / "stale.txt").exists()
    assert export(checkpoint, out, "--force")[0] == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(out.parent)) == ["out"]


def test_the_core_travels_whole_and_imports_nothing_outside_it():
    """An export carries every file of ``core/``; transformers' remote-code
    loader copies what ``modeling_alibi.py`` reaches, which must all be there;
    and the core imports only the standard library, torch, transformers and its
    own siblings (never fairseq, nor the rest of this package)."""
    import ast

    from transformers.dynamic_module_utils import get_relative_import_files

    files = writer.traveling_files()
    assert {os.path.basename(f) for f in files} == {
        n for n in os.listdir(writer.CORE_DIR) if n.endswith(".py") and n != "__init__.py"}
    modeling = os.path.join(writer.CORE_DIR, "modeling_alibi.py")
    assert {modeling, *get_relative_import_files(modeling)} <= set(files)
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for path in [*files, os.path.join(writer.CORE_DIR, "__init__.py")]:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                assert node.level == 1 and node.module, (path, "only 'from .sibling import name' travels")
                assert os.path.exists(os.path.join(writer.CORE_DIR, node.module + ".py")), (path, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] in allowed, (path, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in allowed for a in node.names), (path, [a.name for a in node.names])


@pytest.mark.slow
def test_the_core_imports_without_fairseq(tmp_path):
    """Importing every core module in a process where fairseq cannot be imported."""
    code = GUARD.split("import torch")[0].replace('("fairseq_alibi", "fairseq")', '("fairseq",)') + (
        "import importlib, os, sys\n"
        "import fairseq_alibi.core as core\n"
        "for name in sorted(os.listdir(os.path.dirname(core.__file__))):\n"
        "    if name.endswith('.py'): importlib.import_module('fairseq_alibi.core.' + name[:-3])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fairseq'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(),
                            cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


GUARD = """
import importlib.abc, json, sys
class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq_alibi", "fairseq"):
            raise ImportError("guard: " + name)
sys.meta_path.insert(0, Guard())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
out, ids = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # the two ways docs/export.md gives
stock = PreTrainedTokenizerFast.from_pretrained(out)
assert type(stock) is type(tokenizer) and stock("w1 w2 nope").input_ids == tokenizer("w1 w2 nope").input_ids
model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                             alibi_scaling={"type": "ntk", "train_seq_len": 16}).eval()
with torch.no_grad():
    logp = model(input_ids=torch.tensor([ids])).logits.log_softmax(-1)
    generated = model.generate(torch.tensor([ids[:8]]), max_new_tokens=5, do_sample=False, eos_token_id=None)
print("RESULT", json.dumps({"ids": tokenizer("w1 w2 nope").input_ids, "module": type(model).__module__,
                  "logp": logp[0].tolist(), "generated": generated[0].tolist(),
                  "imported": sorted(m for m in sys.modules if m.startswith(("fairseq", "fairseq_alibi")))}))
"""


@pytest.mark.slow
def test_loads_with_transformers_alone_without_the_package(data_dir, tmp_path):
    model, cfg = build(data_dir, VARIANTS["wiki103-adaptive-tied"])
    out = exported(model, cfg, tmp_path)
    ids = tokens(4 * L)
    env = cli_env(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = ""  # not the worktree: fairseq_alibi must not be importable from there
    result = subprocess.run([sys.executable, "-c", GUARD, str(out), json.dumps(ids[0].tolist())],
                            capture_output=True, text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert "You are using a model of type" not in result.stderr, result.stderr[-2000:]
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert got["module"].startswith("transformers_modules.") and got["imported"] == []
    assert got["ids"] == [2, 5, 6, 3]
    dynamic = Scaling("ntk", 0, L)
    assert max_diff(torch.tensor(got["logp"]), fairseq_log_probs(model, ids, dynamic)[0]) < 1e-4
    assert got["generated"] == fairseq_greedy(model, ids[:, :8], 5)


# ------------------------------------------------------------------ hf.py and the evaluation tools
@pytest.mark.slow
def test_hf_loads_exported_models_with_its_own_class_and_scales_them(data_dir, tmp_path, capfd):
    model, cfg = build(data_dir, VARIANTS["prenorm-gelu-tied-lnemb"])
    out = exported(model, cfg, tmp_path)
    (out / "modeling_alibi.py").write_text("raise RuntimeError('code from the model directory ran')\n")
    capfd.readouterr()
    loaded, tokenizer = hf.load_hf_model(str(out), progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert type(loaded) is AlibiForCausalLM and hf.hf_train_length(loaded.config) == L
    assert torch.equal(hf.base_slopes(loaded), alibi.get_slopes(HEADS))
    ids = tokens(4 * L)
    with hf.alibi_scaling(loaded, "ntk", 0):
        scaled = token_log_probs(loaded, ids[0])
        assert hf.alibi_scaling_settings(loaded)["method"] == "ntk"
    expected = fairseq_log_probs(model, ids, Scaling("ntk", 0, L))[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert max_diff(scaled, expected) < 1e-4
    assert loaded.config.alibi_scaling is None and hf.alibi_scaling_settings(loaded) is None
    with pytest.raises(ValueError, match="bias_form='upstream' applies to BLOOM and Falcon"):
        hf.apply_alibi_scaling(loaded, "ntk", 2.0, bias_form="upstream")


def test_hf_refuses_other_custom_code_models_in_one_line(tmp_path):
    for name, config in (("auto_map", {"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}),
                         ("unknown", {"model_type": "my_secret_lm"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(HFLoadError, match="runs no code from model directories") as error:
            hf.load_hf_model(str(tmp_path / name))
        assert "\n" not in str(error.value)


@pytest.mark.slow
def test_alibi_sweep_hf_accepts_an_exported_model(data_dir, tmp_path):
    from fairseq_alibi.evaluation import perplexity

    model, cfg = build(data_dir, [])
    out = exported(model, cfg, tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % WORDS}" for i in range(7 * L)) + "\n")
    perplexity.main([str(text), "--hf", f"exported={out}", "--lengths", "1x,2x", "--methods", "none,ntk",
                     "--output-dir", str(tmp_path / "sweep"), "--no-progress", "--cpu"])
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    assert {(c["length"], c["method"]) for c in cells} >= {(L, "none"), (2 * L, "ntk")}


@pytest.mark.slow
def test_alibi_sweep_scores_a_checkpoint_and_its_export_alike_on_one_text(data_dir, tmp_path, capsys):
    """One alibi-sweep command, the fairseq checkpoint (--checkpoint) beside its export (--hf)
    on one data directory's split, unknown words and an empty line included: the same
    tokens scored and the same loss in every cell (the export reads the split's text as
    fairseq does: </s> first, each line then </s>, unknown words as <unk>); the raw text
    file the split was binarized from gives the export the same numbers again."""
    from fairseq_alibi.evaluation import perplexity

    checkpoint, out = checkpoint_and_export(data_dir, tmp_path)
    rng = random.Random(3)
    lines = [" ".join(rng.choice([f"w{rng.randrange(WORDS)}"] * 9 + ["zebra"]) for _ in range(rng.randint(3, 12)))
             for _ in range(14)]
    lines[5] = ""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "valid.txt").write_text("\n".join(lines) + "\n")
    shutil.copy(data_dir / "dict.txt", raw / "dict.txt")
    run_cli([tool("fairseq-preprocess"), "--only-source", "--srcdict", raw / "dict.txt", "--validpref",
             raw / "valid.txt", "--destdir", raw / "bin", "--workers", "1"])
    common = ["--lengths", "16,48", "--methods", "none,ntk,cap:0.5", "--modes", "nonoverlapping,sliding",
              "--stride", "8", "--cpu", "--no-progress"]
    # --batch-size 4: fairseq pads the short windows of a batch; a padded row's dynamic
    # factor is its own (docs/evaluating.md, "Padded batches"), as the export's, scored alone
    assert perplexity.main([str(raw / "bin"), "-c", f"fairseq={checkpoint}", "--hf", f"export={out}", *common,
                            "--batch-size", "4", "-o", str(tmp_path / "both")]) == 0
    printed = capsys.readouterr()
    unknown = sum(line.split().count("zebra") for line in lines)
    assert unknown > 3 and f"export: {unknown} of the text's" in printed.err and "scored, as fairseq-eval-lm" in printed.err
    cells = json.loads((tmp_path / "both" / "results.json").read_text())["cells"]
    by = {(c["checkpoint"], c["label"], c["mode"], c["length"]): c for c in cells}
    assert len(by) == 2 * 3 * 2 * 2
    for (name, label, mode, length), fs in by.items():
        if name != "fairseq":
            continue
        hf_cell = by[("export", label, mode, length)]
        assert hf_cell["tokens"] == fs["tokens"] == sum(len(line.split()) + 1 for line in lines)
        assert hf_cell["loss"] == pytest.approx(fs["loss"], abs=1e-5), (label, mode, length)
    assert len({round(by[("fairseq", label, "nonoverlapping", 48)]["loss"], 4)
                for label in ("none", "ntk dynamic", "cap x0.5")}) == 3  # past L the methods differ: not vacuous
    table = (tmp_path / "both" / "results.md").read_text().split("### sliding")[0]
    assert "| fairseq | none |" in table and "| export | none |" in table  # one table, side by side
    assert perplexity.main([str(raw / "valid.txt"), "--hf", f"export={out}", *common,
                            "-o", str(tmp_path / "text")]) == 0
    for c in json.loads((tmp_path / "text" / "results.json").read_text())["cells"]:
        assert c["loss"] == pytest.approx(by[("export", c["label"], c["mode"], c["length"])]["loss"], abs=1e-6)


#: The exports one sweep scores side by side: name -> alibi-export-hf options.
SWEPT = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "float16": ["--dtype", "float16"]}


def window_loss(model, ids: torch.Tensor, length: int) -> float:
    """Bits per token over non-overlapping windows of ``length`` tokens (each
    window's first token from the previous one's last), written out here."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, length):
        window = ids[start: start + length + 1]
        log_probs = hf_log_probs(model, window[None, :-1])[0]
        total -= log_probs.gather(-1, window[1:, None]).sum().item()
        count += len(window) - 1
    return total / count / math.log(2)


@pytest.mark.slow
def test_alibi_sweep_scores_each_export_as_its_files_compute(data_dir, tmp_path, capsys):
    """alibi-sweep over float32, bfloat16 and float16 exports of one checkpoint: each
    row is what that export's files compute in their own dtype (loaded here with
    transformers and scored window by window), the rows differ by the rounding,
    and the log says, per model, the dtype saved and computed in, and that its
    code files are this package's (or which are not: a directory's own code is
    never run, so a changed file is named)."""
    from fairseq_alibi.evaluation import perplexity

    model, cfg = build(data_dir, [])
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    for name, options in SWEPT.items():
        assert export(checkpoint, tmp_path / name, *options)[0] == 0
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "float32", changed)
    with open(changed / "kernels.py", "a") as f:
        f.write("\n# edited after the export\n")
    words = [f"w{i % WORDS}" for i in range(7 * L)]
    (tmp_path / "text.txt").write_text(" ".join(words) + "\n")
    models = [f"--hf={name}={tmp_path / name}" for name in [*SWEPT, "changed"]]
    assert perplexity.main([str(tmp_path / "text.txt"), *models, "--lengths", "1x", "--methods", "none",
                            "--output-dir", str(tmp_path / "sweep"), "--no-progress", "--cpu"]) == 0
    log = capsys.readouterr().err
    cells = {c["checkpoint"]: c for c in json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]}
    ids = torch.tensor([2] + [4 + int(w[1:]) for w in words] + [2])
    losses = {name: window_loss(read_back(tmp_path / name, True), ids, L) for name in SWEPT}
    for name, loss in losses.items():
        assert cells[name]["loss"] == pytest.approx(loss, abs=1e-5), name
        assert f"{name}: {name} weights as saved, computed in {name}; its code files are this package's" in log
    # the rounding moves the mean loss by a few 1e-4 bits (6e-4 and 9e-4 here), far more than the 1e-5 allowed
    assert abs(losses["bfloat16"] - losses["float32"]) > 1e-4 and abs(losses["float16"] - losses["float32"]) > 1e-4
    assert cells["changed"]["loss"] == cells["float32"]["loss"]
    assert "changed: its code files differ from this package's (kernels.py)" in log


def test_unknown_words_are_scored_in_text_and_refused_in_prompts(data_dir, tmp_path):
    from fairseq_alibi.errors import EvaluationError
    from fairseq_alibi.evaluation.hf_backend import HFEncoder

    model, cfg = build(data_dir, [])
    _, tokenizer = hf.load_hf_model(str(exported(model, cfg, tmp_path)), progress=False)
    encoder = HFEncoder(tokenizer, by_lines=True)
    assert encoder.encode_text("w1 zebra\n\nw2\n") == [2, 5, 3, 2, 2, 6, 2]
    assert encoder.unknown(encoder.encode_text("w1 zebra\n\nw2\n")) == 1
    with pytest.raises(EvaluationError, match="1 word.* the model's tokenizer reads as <unk>: zebra"):
        encoder.encode("w1 zebra w2")


# ------------------------------------------------------------------ lm-evaluation-harness
HARNESS_TASK = """task: alibi_export_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.mark.slow
def test_lm_eval_harness_log_likelihoods_equal_fairseq(data_dir, tmp_path, monkeypatch):
    """lm_eval's Python API, offline, on a local task: ``--model hf`` with trust_remote_code."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import dynamic_module_utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    model, cfg = build(data_dir, VARIANTS["prenorm-gelu-tied-lnemb"])
    out = exported(model, cfg, tmp_path)
    docs = []
    for n, (context, continuation) in enumerate([(3 * L, 5), (L // 2, 1), (4 * L - 4, 3)]):
        ids = tokens(context + continuation, seed=n)[0, 1:].tolist()
        docs.append({"context": " ".join(f"w{i - 4}" for i in ids[:context - 1]),
                     "continuation": " ".join(f"w{i - 4}" for i in ids[context - 1:]), "ids": ids})
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "check.yaml").write_text(HARNESS_TASK.format(data=tmp_path / "docs.jsonl",
                                                                       cache=tmp_path / "datasets"))
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={out},trust_remote_code=True,dtype=float32", tasks=["alibi_export_check"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False), device="cpu",
        batch_size=1, log_samples=True, bootstrap_iters=0)
    samples = sorted(results["samples"]["alibi_export_check"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, doc in zip(samples, docs):
        ids = torch.tensor([[2] + doc["ids"]])  # lm_eval feeds the tokenizer's </s> first, as fairseq does
        logp = fairseq_log_probs(model, ids[:, :-1])[0]
        scored = len(doc["continuation"].split())
        expected = logp[-scored:].gather(-1, ids[0, -scored:, None]).sum().item()
        assert sample["filtered_resps"][0][0] == pytest.approx(expected, abs=1e-4), doc["context"][:20]


@pytest.mark.slow
def test_alibi_retrieval_gives_the_same_scores_on_a_checkpoint_and_its_export(data_dir, tmp_path):
    """The same prompts through alibi-retrieval on the fairseq checkpoint (fairseq backend)
    and on its export (--hf backend, this package's own class): equal scores under every
    kind of method, static, dynamic and the cap (the export's bos is fairseq's eos)."""
    from fairseq_alibi.evaluation import retrieval

    checkpoint, out = checkpoint_and_export(data_dir, tmp_path)
    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n)),
                                           "answer": f"w{rng.randrange(WORDS)} w{rng.randrange(WORDS)}"}) + "\n"
                               for n in (5, 3 * L, 3 * L, 5 * L)))
    common = ["--task", str(prompts), "--methods", "none,ntk,cap:0.5", "--cpu", "--no-progress"]
    assert retrieval.main([str(data_dir), "-c", f"m={checkpoint}", *common, "-o", str(tmp_path / "fs")]) == 0
    assert retrieval.main(["--hf", f"m={out}", *common, "-o", str(tmp_path / "hf")]) == 0
    cells = {name: {(c["label"], c["length"]): c for c in json.loads((tmp_path / name / "results.json").read_text())
                    ["cells"]} for name in ("fs", "hf")}
    assert set(cells["fs"]) == set(cells["hf"]) and len(cells["fs"]) == 3 * 3
    for key, fs in cells["fs"].items():
        hf_cell = cells["hf"][key]
        assert fs["sample_correct"] == hf_cell["sample_correct"], key
        assert fs["sample_logprob"] == pytest.approx(hf_cell["sample_logprob"], abs=1e-4), key
    longest = max(length for _, length in cells["fs"])
    assert len({round(cells["fs"][(label, longest)]["answer_logprob"], 5) for label in
                ("none", "ntk dynamic", "cap x0.5")}) == 3  # past L the methods differ: not vacuous


@pytest.mark.slow
def test_exported_model_runs_the_fast_kernels_exactly(data_dir, tmp_path, monkeypatch):
    """The exported model runs the plugin's kernels: chunked (long inference,
    key windows) and blocked (CPU training) give the reference kernel's
    log-probs, and blocked its gradients, over several 16-query blocks."""
    model, cfg = build(data_dir, [])
    loaded, _ = hf.load_hf_model(str(exported(model, cfg, tmp_path)), progress=False)
    package = type(loaded).__module__.rsplit(".", 1)[0]  # the kernels next to the loaded modeling file
    kernels_module, blocks_module = sys.modules[package + ".kernels"], sys.modules[package + ".causal_blocks"]
    monkeypatch.setattr(kernels_module, "CHUNK_SIZE", 16)
    monkeypatch.setattr(blocks_module, "block_size", lambda n: 16)
    calls = []
    for name in ("chunked_kernel", "blocked_kernel"):
        monkeypatch.setitem(kernels_module.KERNELS, name.split("_")[0],
                            lambda *a, _name=name, _fn=getattr(kernels_module, name): calls.append(_name) or _fn(*a))
    holders = [m for m in loaded.modules() if isinstance(getattr(m, "kernel", None), str)]  # each layer's
    assert len(holders) == 2
    ids = tokens(6 * L, batch=2)
    results = {}
    for kernel in ("reference", "chunked", "blocked"):
        for holder in holders:
            holder.kernel = kernel
        loaded.zero_grad()
        with torch.set_grad_enabled(kernel != "chunked"):
            log_probs = loaded(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
        if kernel != "chunked":
            log_probs.gather(-1, ids[..., None]).sum().backward()
        grads = [p.grad.clone() for p in loaded.parameters() if p.grad is not None]
        results[kernel] = (log_probs.detach(), grads)
    assert calls == ["chunked_kernel"] * 2 + ["blocked_kernel"] * 2  # two layers each
    assert max_diff(results["chunked"][0], results["reference"][0]) < 1e-5
    assert max_diff(results["blocked"][0], results["reference"][0]) < 1e-5
    assert len(results["blocked"][1]) == len(results["reference"][1]) > 0
    for got, want in zip(results["blocked"][1], results["reference"][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_check_reads_its_own_staged_code_when_another_remote_code_cache_is_on_the_path(
        data_dir, tmp_path, monkeypatch):
    """A process that loaded remote code before (transformers put its cache's
    ``transformers_modules`` package on ``sys.path``) still reads the staged
    directory back: the check's own cache comes first on the path (it came
    after, and the import of the staged code found the other package)."""
    other = tmp_path / "other-cache"
    (other / "transformers_modules").mkdir(parents=True)
    (other / "transformers_modules" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(other))
    for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
        monkeypatch.delitem(sys.modules, name)
    model, cfg = build(data_dir, [])
    exported(model, cfg, tmp_path)


def test_a_stock_format_refuses_a_weight_it_has_no_place_for():
    """A weight the BLOOM mapping never reads (a part of the model BLOOM has no
    place for, as SSMax's scales were) is refused in one line, not dropped."""
    from fairseq_alibi.export.bloom import bloom_weights
    from fairseq_alibi.export.custom import ReadWeights

    heads, layers, dim = 2, 1, 4
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layernorm_embedding.weight",
             "model.layernorm_embedding.bias", "model.layer_norm.weight", "model.layer_norm.bias"]
    names += [f"model.layers.0.{m}.{kind}" for m in ("self_attn_layer_norm", "final_layer_norm", "self_attn.out_proj",
                                                      "fc1", "fc2", "self_attn.q_proj", "self_attn.k_proj",
                                                      "self_attn.v_proj") for kind in ("weight", "bias")]
    weights = ReadWeights({name: torch.zeros(dim, dim) for name in names})
    bloom_weights(weights, heads, layers)
    weights.check_all_read("BLOOM")  # every weight has its place
    weights = ReadWeights({**weights, "model.layers.0.self_attn.ssmax.scale": torch.zeros(heads)})
    bloom_weights(weights, heads, layers)
    with pytest.raises(ExportError, match=r"^the BLOOM format has no place for 1 weight of this model "
                                          r"\(model\.layers\.0\.self_attn\.ssmax\.scale\); export it in the default "
                                          r"format \(--format custom\)$"):
        weights.check_all_read("BLOOM")


def test_the_check_scores_past_where_an_extension_starts_to_act(data_dir, tmp_path):
    """cap:2 on a model trained at 16 tokens acts past 32: on the 24 tokens the check
    scored before, a model written without it matched the extended checkpoint
    exactly; on check_length's, the difference shows (and the export's own line
    says how many tokens it scored)."""
    from fairseq.data import Dictionary

    from fairseq_alibi.export import check
    from fairseq_alibi.models.attention import rescale

    cap = Scaling.parse("cap:2", L)
    assert check.extension_start(cap) == 32 and check.check_length(cap) == 56
    assert check.check_length(Scaling.parse("ntk:2", L)) == check.TOKENS  # a static factor acts everywhere
    assert check.check_length(Scaling.parse("ntk:dynamic", 4096)) == check.MAX_CHECK_LENGTH
    model, cfg = build(data_dir, [])
    plain = check.load_written(str(exported(model, cfg, tmp_path)), "custom")
    rescale(model, cap)
    for length, differs in ((check.TOKENS, False), (check.check_length(cap), True)):
        measured = check.measure(plain, model, check.check_tokens(Dictionary.load(str(data_dir / "dict.txt")), length))
        assert (measured.same_precision > check.TOLERANCE) == differs, (length, measured)
    output = export(save(model, cfg, tmp_path / "capped.pt"), tmp_path / "capped", "--alibi-scaling", "cap:2")[1]
    assert "on 56 random tokens: max |log-prob difference| 0" in output, output
    line = check.Check("float32", 0.0, 0.0, 2048, unreached=4096).describe("float32")
    assert line.endswith("; the context extension acts past 4096 tokens, beyond the check's 2048: not exercised by it")


def test_the_scaling_flag_is_named_for_every_position_method_and_keeps_its_older_name():
    from fairseq_alibi.export import parser

    for flag in ("--position-scaling", "--alibi-scaling"):
        assert parser().parse_args(["m.pt", "out", flag, "yarn:2"]).position_scaling == "yarn:2"
