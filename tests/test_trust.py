"""What a user can trust, by class (issue 40): every position method's option
checked against its one declaration (``core.params``) at every entry point;
model overrides that apply or are refused naming the key; no perplexity over
part of a split with exit status 0.

The tables are generated from the registry (``core.positions.POSITIONS``), so
a method added later, with its ``Param`` declarations, is covered without
editing this file.
"""

from __future__ import annotations

import math
import re
from argparse import Namespace

import pytest
from fairseq import tasks

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from fairseq_alibi import cli, facts
from fairseq_alibi.core import positions as P
from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
from fairseq_alibi.core.positions import exported_methods
from fairseq_alibi.core.errors import ConfigError
from fairseq_alibi.core.params import LEARNED, SETTING, SHAPE
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.errors import UserError
from fairseq_alibi.models.config import check_override_keys
from fairseq_alibi.models.transformer_lm import build_positions

from conftest import error_lines, fairseq_config, run_cli, tool, train_args

#: No extension, a known training length (rnope_window=0 means half of it, as every model has).
TRAINED = Scaling("none", 1.0, 16)
HEADS, HEAD_DIM = 4, 8
#: The depth of the decoder the config fields describe (fairseq always hands decoder_layers over).
LAYERS = 8
#: Params whose largest valid value is the model's number of heads (checked by the build, not the registry).
HEAD_BOUND = {"rotary_alibi_heads"}
PARAMS = P.params_of()
PARAM_IDS = [f"{m}.{p.name}" for m, p in PARAMS]


def allowed_by_hand(param, value) -> bool:
    """The declared range read here, independently of ``Range.allows``."""
    valid = param.valid
    if type(value) is bool or not isinstance(value, (int, float)):
        return False
    if any(value == special for special, _ in valid.special):
        return True
    if valid.kind is int and not isinstance(value, int):
        return False
    if value != value or value in (math.inf, -math.inf):
        return False
    low_ok = value > valid.low if valid.open_low else value >= valid.low
    high_ok = value < valid.high if valid.open_high else value <= valid.high
    return low_ok and high_ok


def boundary_values(param):
    """0, negative, NaN, infinite, huge, both ends and just past them, a wrong type."""
    valid = param.valid
    if valid.kind is int:
        low, high = int(valid.low), int(valid.high)
        values = [0, -1, -3, low, low - 1, high, high + 1, 10 * high + 7, 2**40, param.default, 2.5, True, math.nan]
    else:
        values = [0.0, -1.0, -3.0, valid.low, valid.low - 1e-6 * max(abs(valid.low), 1.0), valid.high,
                  valid.high * (1 + 1e-6) + 1, 1e300, math.nan, math.inf, -math.inf, param.default, 0.5, "3"]
    unique = {}
    for value in values:
        unique.setdefault((type(value), repr(value)), value)
    return list(unique.values())


def defaults(method):
    return {p.name: p.default for p in P.position(method).params}


def cases():
    for method, param in PARAMS:
        for value in boundary_values(param):
            yield pytest.param(method, param, value, id=f"{method}.{param.name}={value!r}")


# ------------------------------------------------------------ the declarations
@pytest.mark.parametrize("method,param", PARAMS, ids=PARAM_IDS)
def test_every_param_declares_its_range_role_and_help(method, param):
    assert param.role in (SETTING, SHAPE, LEARNED)
    assert allowed_by_hand(param, param.default)
    for value in (math.nan, -1e30, 1e30):  # no method takes these: NaN, a negative or an absurd size
        assert not allowed_by_hand(param, value) and param.problem(value) is not None, (param.name, value)
    # --help gives what it is, the values it takes and the default, from the declaration
    assert param.summary in param.help and param.valid.text in param.help
    assert param.help.endswith(f"default {param.default!r}")


def test_the_issue_s_cases_are_refused_and_the_learned_and_shape_params_are_declared_so():
    fire, t5 = {p.name: p for p in P.position("fire").params}, {p.name: p for p in P.position("t5bias").params}
    assert fire["fire_hidden"].problem(0) and fire["fire_hidden"].problem(-1)  # 0: NoPE under FIRE's name
    assert fire["fire_threshold"].problem(-3) and fire["fire_threshold"].problem(math.nan)
    assert fire["fire_threshold"].problem(0) is None  # 0 means the training length
    assert (fire["fire_hidden"].role, fire["fire_threshold"].role, t5["t5_buckets"].role) == (SHAPE, LEARNED, SHAPE)


# ------------------------------------------------------------- every entry point
@pytest.mark.parametrize("method,param,value", list(cases()))
def test_every_option_at_its_limits_through_every_entry_point(method, param, value):
    """The build, the training flag, the model config (hub, Hydra), the exported
    model's HF config: each refuses exactly the values outside the declared
    range, in one line naming the option and the range."""
    refused = not allowed_by_hand(param, value)
    params = dict(defaults(method), **{param.name: value})
    cross = P.position(method).check(params) if P.position(method).check and not refused else None
    # bounded by the model's heads, which the registry does not hold: the build refuses more than HEADS
    head_bound = param.name in HEAD_BOUND and not refused and value > HEADS
    cross = cross or head_bound

    # the stack's build (every fairseq model, the hub API and Hydra build through it)
    if refused or cross:
        with pytest.raises(ConfigError) as built:
            P.build(method, HEADS, HEAD_DIM, params, TRAINED)
        assert param.name in str(built.value) and "\n" not in str(built.value)
        if refused:
            assert param.valid.text in str(built.value)
    else:
        P.build(method, HEADS, HEAD_DIM, params, TRAINED)

    # the model's config fields, as fairseq hands them to the decoder
    args = Namespace(decoder_attention_heads=HEADS, decoder_embed_dim=HEADS * HEAD_DIM, decoder_layers=LAYERS, **params)
    entry = P.position(method)
    too_deep = entry.depth_check(params, LAYERS) if entry.depth_check and not (refused or cross) else None
    if refused or cross or too_deep:
        with pytest.raises(ConfigError, match=re.escape(param.name)):
            build_positions(args, method)

    # the training flag, checked by every console script before fairseq loads data (argparse refuses
    # what is no number of the flag's type)
    text = repr(value) if isinstance(value, float) else str(value)
    parses = type(value) is not bool and not isinstance(value, str) and (
        param.valid.kind is float or isinstance(value, int))
    if parses and refused:
        with pytest.raises(UserError, match=re.escape(f"{param.flag} {text} is not valid: it must be "
                                                      f"{param.valid.text}")):
            cli.check_position_flags([param.flag, text])
    elif parses:
        cli.check_position_flags([param.flag, text])

    # the exported model's Hugging Face config (methods the exported model computes)
    if method not in exported_methods() or head_bound:  # an exported config holds no heads to check against
        return
    if refused or cross or too_deep:
        with pytest.raises(ConfigError, match=re.escape(param.name)):
            hf_config(method, params)
    else:
        assert hf_config(method, params).position_settings()[param.name] == value


#: Where an exported rotary config keeps the rotary parameters (transformers' names).
ROPE_KEYS = {"rotary_base": "rope_theta", "rotary_fraction": "partial_rotary_factor"}


def hf_config(method, params):
    """The exported model's config of ``method`` with ``params``, spelled as the export writes it."""
    if method == "rotary":  # rotary's own parameters in transformers' rope_parameters, the others as any method's
        rope = {"rope_type": "default", **{ROPE_KEYS[name]: value for name, value in params.items() if name in ROPE_KEYS}}
        others = {name: value for name, value in params.items() if name not in ROPE_KEYS}
        return AlibiLMConfig(position_method=method, rope_parameters=rope, position_params=others or None,
                             layers=LAYERS)
    return AlibiLMConfig(position_method=method, position_params=params, layers=LAYERS)


@pytest.mark.slow
def test_a_training_flag_out_of_range_is_one_line_before_fairseq_loads(lm_data_bin, tmp_path):
    """The wiring, once per method with options: ``alibi-train`` refuses the first
    option of each at 0 / -1 in one ``error:`` line and writes nothing."""
    for method, param in {m: p for m, p in reversed(PARAMS)}.items():
        value = next(v for v in (0, -1) if not allowed_by_hand(param, v))
        save = tmp_path / method
        result = run_cli([tool("alibi-train"), lm_data_bin, "--arch", facts.position_model(method), param.flag,
                          str(value), "--save-dir", save, "--cpu", "--max-update", "1"], expect_ok=False)
        lines = error_lines(result)
        assert result.returncode == 1 and "Traceback" not in result.output, result.output[-2000:]
        assert len(lines) == 1 and f"{param.flag} {value} is not valid" in lines[0], lines
        assert param.valid.text in lines[0]
        assert not save.exists()


# ------------------------------------------------------------------ overrides
@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dict")
    (path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    return path


_CFGS = {}


def checkpoint_cfg(dict_dir, method):
    """The config a checkpoint of ``method`` holds (fairseq's own, built from flags; composed once)."""
    import copy

    if method not in _CFGS:
        _CFGS[method] = _composed_cfg(dict_dir, method)
    return copy.deepcopy(_CFGS[method])


def _composed_cfg(dict_dir, method):
    argv = [str(dict_dir), "--task", "language_modeling", "--arch", facts.position_model(method),
            "--tokens-per-sample", "16", "--decoder-layers", "2", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4"]
    return fairseq_config(argv)


def other_valid_value(param):
    """A value in range that differs from the default."""
    for value in (param.default * 2, param.default + 1, param.default / 2, (param.valid.low + param.valid.high) / 2):
        value = param.valid.kind(value) if param.valid.kind is int else float(value)
        if value != param.default and param.problem(value) is None:
            return value
    raise AssertionError(param)


#: Factor spellings every tool refuses (core.scaling): empty, not finite, negative, past int32 tokens.
BAD_FACTORS = ("", "nan", "inf", "-1", "1e308")


def override_cases():
    """Every key kind on every method: its own params (each role: another valid
    value, an invalid one, the trained one), another method's params, a
    shape-setting fairseq option, and a setting (an ``alibi_*`` key)."""
    for method in P.POSITIONS:
        own = P.position(method).params
        for param in own:
            yield method, param.name, param.default, None
            yield method, param.name, other_valid_value(param), {
                SETTING: None, SHAPE: "it sets the model's shape",
                LEARNED: "the initial value of a quantity the model learns"}[param.role]
            yield method, param.name, -1, "cannot apply" if param.role != SETTING else "is not valid"
        for other, param in PARAMS:
            if other != method and param.name not in {p.name for p in own}:
                owners = [name for name, p in PARAMS if p.name == param.name]
                yield method, param.name, param.default, f"is a parameter of {' and '.join(owners)} models"
        yield method, "decoder_layers", 3, "it sets the model's shape"
        yield method, "decoder_layers", 2, None
        yield method, "alibi_attention", "sdpa", None
        # the logit keys: SSMax adds weights (either way refused; ssmax+ is a checkpoint trained with
        # --ssmax), logn is a spelling of position_scaling on every method, its factor checked as any
        yield method, "ssmax", True, "SSMax's scales are weights learned in training, and this checkpoint has none"
        yield method, "ssmax", False, None
        yield method + "+ssmax", "ssmax", False, "it holds SSMax's learned scales"
        yield method + "+ssmax", "ssmax", True, None
        yield method, "position_scaling", "logn", None
        for spelling in BAD_FACTORS:
            yield method, "position_scaling", f"logn:{spelling}", "is not valid"


@pytest.mark.parametrize("method,key,value,refused", list(override_cases()),
                         ids=lambda v: str(v)[:40] if not isinstance(v, str) or len(v) < 40 else v[:40])
@pytest.mark.fast_cases(8)
def test_overrides_of_every_key_kind_on_every_method(dict_dir, method, key, value, refused):
    cfg = checkpoint_cfg(dict_dir, method.split("+")[0])
    if method.endswith("+ssmax"):
        cfg.model.ssmax = True
    if refused is None:
        check_override_keys({key: value}, cfg)
        return
    with pytest.raises(ConfigError) as error:
        check_override_keys({key: value}, cfg)
    message = str(error.value)
    assert refused in message and repr(key) in message or f"{key}=" in message, message
    assert "\n" not in message


@pytest.mark.slow
def test_a_learned_or_shape_override_is_refused_by_the_console_script_and_the_hub(lm_data_bin, tmp_path):
    """The issue's cases on trained models: ``{'fire_threshold': -3}`` and
    ``{'t5_buckets': 16}`` through ``--model-overrides`` and the hub API's
    keywords, refused before the weights are read, naming the key."""
    from fairseq.models.transformer_lm import TransformerLanguageModel

    from conftest import train_args

    for method, key, value, expected in (("fire", "fire_threshold", -3, "initial value of a quantity"),
                                         ("t5bias", "t5_buckets", 16, "sets the model's shape")):
        save = tmp_path / method
        args = train_args(lm_data_bin, save, max_update=1)
        args[args.index("transformer_lm_alibi")] = facts.position_model(method)
        run_cli([tool("alibi-train"), *args])
        result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", save / "checkpoint_last.pt", "--cpu",
                          "--gen-subset", "valid", "--model-overrides", repr({key: value})], expect_ok=False)
        lines = error_lines(result)
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output[-2000:]
        assert f"{key}={value}" in lines[0] and expected in lines[0], lines[0]
        with pytest.raises(ConfigError, match=re.escape(expected)):
            TransformerLanguageModel.from_pretrained(str(save), "checkpoint_last.pt",
                                                     data_name_or_path=str(lm_data_bin), **{key: value})


# ---------------------------------------------------- no perplexity over a part
def split_tokens_by_hand(data_bin, subset="valid") -> int:
    """The tokens of a binarized split, read here: every line's tokens plus its eos."""
    from fairseq.data import data_utils, Dictionary

    dictionary = Dictionary.load(str(data_bin / "dict.txt"))
    dataset = data_utils.load_indexed_dataset(str(data_bin / subset), dictionary)
    return int(sum(len(dataset[i]) for i in range(len(dataset))))


EVAL = ["--gen-subset", "valid", "--tokens-per-sample", "128", "--max-tokens", "4096", "--cpu"]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("entry", ["alibi-eval-lm", "fairseq-eval-lm --user-dir"])
def test_eval_lm_refuses_a_split_the_model_s_limit_cuts_then_its_remedy_scores_all(entry, sinusoidal_checkpoint,
                                                                                   lm_data_bin, alibi_user_dir):
    """A sinusoidal model trained at 32 tokens, evaluated at 128: fairseq skips
    every full block; the tool refuses in one line saying how much was scored,
    and the override it names scores every token of the split."""
    command = [tool("alibi-eval-lm")] if entry == "alibi-eval-lm" else [tool("fairseq-eval-lm"), "--user-dir",
                                                                          alibi_user_dir]
    total = split_tokens_by_hand(lm_data_bin)
    result = run_cli([*command, lm_data_bin, "--path", sinusoidal_checkpoint, *EVAL], expect_ok=False)
    # the stock CLI has no one-line wrapper: the error is the last line of its traceback
    lines = error_lines(result) if entry == "alibi-eval-lm" else result.output.strip().splitlines()[-1:]
    assert result.returncode == 1 and "Perplexity" not in result.output, result.output[-2000:]
    assert len(lines) == 1 and f"of the {total:,} tokens of valid were scored" in lines[0], lines
    assert "longer than the model's 32 positions" in lines[0]
    remedy = re.search(r"--model-overrides \"(\{[^}]*\})\"", lines[0]).group(1)
    fixed = run_cli([*command, lm_data_bin, "--path", sinusoidal_checkpoint, *EVAL, "--model-overrides", remedy])
    assert int(re.findall(r"Evaluated ([\d,]+) tokens", fixed.output)[-1].replace(",", "")) == total


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("entry", ["alibi-eval-lm", "fairseq-eval-lm --user-dir", "alibi-sweep"])
def test_a_length_longer_than_the_split_is_refused_by_eval_lm_as_by_the_sweep(entry, alibi_checkpoint, lm_data_bin,
                                                                               alibi_user_dir, tmp_path):
    """alibi-eval-lm --tokens-per-sample beyond the split scored one shorter block (the whole split) under
    that length's name, exit status 0; the sweep refused it. One check (coverage.longer_than_text), one line."""
    total = split_tokens_by_hand(lm_data_bin)
    length = str(total + 1)
    given = {"alibi-eval-lm": [tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint],
             "fairseq-eval-lm --user-dir": [tool("fairseq-eval-lm"), "--user-dir", alibi_user_dir, lm_data_bin,
                                            "--path", alibi_checkpoint],
             "alibi-sweep": [tool("alibi-sweep"), lm_data_bin, "-c", f"a={alibi_checkpoint}", "--methods", "none",
                             "-o", tmp_path / "sweep"]}[entry]
    tail = ["--lengths", f"32,{length}", "--cpu"] if entry == "alibi-sweep" else [*EVAL[:2], "--tokens-per-sample",
                                                                                  length, "--cpu"]
    result = run_cli([*given, *tail], expect_ok=False)
    lines = error_lines(result) if entry != "fairseq-eval-lm --user-dir" else result.output.strip().splitlines()[-1:]
    assert result.returncode == 1 and "Perplexity" not in result.output, result.output[-2000:]
    flag = "evaluation length" if entry == "alibi-sweep" else "--tokens-per-sample"
    assert len(lines) == 1 and f"{flag} {length} exceeds the {total:,} tokens of the evaluated text (valid)" in lines[0]
    assert f"give {'--lengths' if entry == 'alibi-sweep' else '--tokens-per-sample'} up to {total}" in lines[0]
    if entry == "alibi-eval-lm":  # the whole split as one block is not refused
        run_cli([*given, *EVAL[:2], "--tokens-per-sample", str(total), "--cpu"])


@pytest.mark.slow
def test_the_sweep_scores_the_whole_split_of_the_same_model(sinusoidal_checkpoint, lm_data_bin, tmp_path):
    import json

    run_cli([tool("alibi-sweep"), lm_data_bin, "-c", f"s={sinusoidal_checkpoint}", "--lengths", "128",
             "--methods", "none", "--cpu", "--no-progress", "-o", tmp_path / "sweep"])
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    assert [c["tokens"] for c in cells] == [split_tokens_by_hand(lm_data_bin)]


@pytest.mark.slow
def test_a_short_enough_length_scores_everything_with_every_entry_point(sinusoidal_checkpoint, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", sinusoidal_checkpoint, "--gen-subset", "valid",
                      "--tokens-per-sample", "32", "--cpu"])
    assert int(re.findall(r"Evaluated ([\d,]+) tokens", result.output)[-1].replace(",", "")) == \
        split_tokens_by_hand(lm_data_bin)


# ------------------------------------------------------------------ YaRN's ramp
@pytest.mark.parametrize("base", [10.0, 10000.0])
@pytest.mark.parametrize("head_dim, train_length", [(16, 64), (64, 1024), (16, 1024), (128, 700), (32, 10**6),
                                                     (8, 7)])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_yarn_equals_transformers_with_its_cap_at_base_10_and_10000(base, head_dim, train_length, factor):
    """transformers caps the ramp's upper end at ``dim - 1``: at base 10 the cap
    acts (at L = 700 and 1024 inv_freq was 1.6 to 4 % apart before it was
    followed; at L = 10**6 it brings the upper end below the lower), at 10,000
    it never does."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fairseq_alibi.core import rotary

    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=train_length,
                         rope_parameters={"rope_type": "yarn", "factor": factor, "rope_theta": base})
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    got, got_scale = rotary.extended_frequencies("yarn", factor, head_dim, base, train_length)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert got_scale == pytest.approx(scale, rel=1e-12)


def test_the_hub_api_scores_a_whole_sentence_or_refuses_it(sinusoidal_checkpoint, lm_data_bin):
    """fairseq's hub ``score`` on the same model: a sentence within its 32
    positions is scored whole; a longer one is refused, never cut."""
    from fairseq.models.transformer_lm import TransformerLanguageModel

    hub = TransformerLanguageModel.from_pretrained(str(sinusoidal_checkpoint.parent), sinusoidal_checkpoint.name,
                                                   data_name_or_path=str(lm_data_bin))
    short = "one the cat sees the ball ."
    assert hub.score(short)["positional_scores"].numel() == len(short.split())  # every word (no eos appended)
    with pytest.raises(Exception, match="max_positions"):
        hub.score(" ".join([short] * 8))


@pytest.mark.parametrize("method", sorted({m for m, _ in PARAMS}))
def test_alibi_train_help_gives_each_option_s_range_and_default(method, lm_data_bin):
    result = run_cli([tool("alibi-train"), lm_data_bin, "--arch", facts.position_model(method), "--help"])
    shown = " ".join(result.stdout.split())
    for param in P.position(method).params:
        assert f"{param.flag} {param.name.upper()} {param.help}" in shown.replace("%%", "%"), param.help


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("entry", ["alibi-eval-lm", "fairseq-eval-lm --user-dir"])
def test_eval_lm_with_add_bos_token_scores_every_token_of_the_split(entry, lm_data_bin, alibi_user_dir, tmp_path):
    """--add-bos-token: fairseq prepends <s> to each block and does not score it,
    so the split's tokens are all scored, each once: the coverage check counts
    them so (it refused every such run when it took one off per block)."""
    save_dir = tmp_path / "bos"
    run_cli([tool("alibi-train"), *train_args(lm_data_bin, save_dir, max_update=2), "--add-bos-token"])
    command = [tool("alibi-eval-lm")] if entry == "alibi-eval-lm" else [tool("fairseq-eval-lm"), "--user-dir",
                                                                          alibi_user_dir]
    result = run_cli([*command, lm_data_bin, "--path", save_dir / "checkpoint_last.pt", "--add-bos-token",
                      "--gen-subset", "valid", "--tokens-per-sample", "32", "--max-tokens", "4096", "--cpu"])
    assert result.returncode == 0 and re.search(r"Perplexity: [\d.]+", result.output), result.output[-2000:]


def test_the_split_s_count_is_its_tokens_with_or_without_add_bos_token(lm_data_bin):
    """What fairseq's eval-lm scores of a split (each block's targets, less the
    prepended <s> with --add-bos-token) is the count the coverage check expects."""
    from fairseq_alibi.coverage import split_tokens

    for bos in ([], ["--add-bos-token"]):
        cfg = fairseq_config([str(lm_data_bin), "--task", "language_modeling", "--tokens-per-sample", "32",
                              "--arch", "transformer_lm", *bos])
        task = tasks.setup_task(cfg.task)
        task.load_dataset("valid")
        dataset = task.dataset("valid")
        scored = sum(len(dataset[i]["target"]) - len(bos) for i in range(len(dataset)))
        assert split_tokens(dataset) == scored == split_tokens_by_hand(lm_data_bin)
