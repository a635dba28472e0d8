"""alibi-export-hf for every position method: rotary as stock GPT-NeoX (no
remote code), the others exact through the exported custom model.

Every number is checked against the fairseq model of the same checkpoint,
built in this process; the exports are loaded in one process where importing
``fairseq`` or ``fairseq_alibi`` fails (``LOAD_ALL``).  Rotary's context
extension through transformers' own ``rope_parameters`` is checked against
``alibi-sweep``'s cells of the fairseq checkpoint under our spelling of the
same method, on the same windows; where transformers defines a method
otherwise (dynamic NTK's factor and its memory of the longest input, YaRN's
ramp end) the test pins what transformers computes.  Tiny models with random
weights (N(0, 0.4), layer norms near 1), d=32, 4 heads, trained length 16.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, fairseq_config, run_cli, tool
from fairseq_alibi.core import rotary
from fairseq_alibi.core.positions import POSITIONS, attention_entry
from fairseq_alibi.core.scaling import NO_SCALING, Scaling
from fairseq_alibi.models import attention
from test_export import captured, hf_log_probs, max_diff, one_error_line, save, window_loss
from fairseq_alibi.export import main as export_main

L = 16
WORDS = 40
DIM, HEADS = 32, 4
COMMON = ["--decoder-layers", "2", "--decoder-embed-dim", str(DIM), "--decoder-attention-heads", str(HEADS),
          "--decoder-ffn-embed-dim", "48", "--dropout", "0", "--attention-dropout", "0"]
#: The comparison's shape (examples/positions/compare.sh): pre-norm, tied, sqrt(d)-scaled embedding.
COMPARE = ["--decoder-normalize-before", "--share-decoder-input-output-embed"]
ROTARY = ["--arch", "transformer_lm_rotary", *COMPARE, "--rotary-fraction", "0.5", "--rotary-base", "500"]
#: Every method the custom format holds: name -> fairseq training flags.
CUSTOM = {
    "sinusoidal": ["--arch", "transformer_lm", *COMPARE],
    "rotary-postnorm": ["--arch", "transformer_lm_rotary", "--activation-fn", "gelu"],
    "t5bias": ["--arch", "transformer_lm_t5bias", *COMPARE, "--t5-buckets", "8", "--t5-max-distance", "24"],
    "kerple": ["--arch", "transformer_lm_kerple", *COMPARE],
    "fire": ["--arch", "transformer_lm_fire", *COMPARE, "--fire-hidden", "8"],
    "nope": ["--arch", "transformer_lm_nope", "--layernorm-embedding"],
    "fox": ["--arch", "transformer_lm_fox", *COMPARE],
    "rnope": ["--arch", "transformer_lm_rnope", *COMPARE, "--rnope-window", "6"],  # a NoPE layer; 6 < 3 L keys
    "alibi-ssmax": ["--arch", "transformer_lm_alibi", *COMPARE, "--ssmax"],
    "stickbreaking": ["--arch", "transformer_lm_stickbreaking", *COMPARE],
    "path": ["--arch", "transformer_lm_path", *COMPARE, "--path-short-conv", "0"],
    "path-fox": ["--arch", "transformer_lm_path", *COMPARE, "--path-forget-gate", "1"],
    "path-fox-scaled": ["--arch", "transformer_lm_path", *COMPARE, "--path-forget-gate", "2"],
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The half-precision export of a model (both dtypes over the methods; an export costs seconds):
#: the learned biases, FoX, RNoPE, SSMax, fairseq's sinusoidal table (a buffer the files do not hold) and rotary.
HALF = {"sinusoidal": "bfloat16", "rotary-postnorm": "float16", "t5bias": "bfloat16", "fire": "float16",
        "fox": "bfloat16", "rnope": "float16", "alibi-ssmax": "bfloat16", "neox": "bfloat16"}


def build(data_dir: Path, extra, seed: int = 0):
    """(fairseq model in eval mode, cfg) as fairseq-train builds them, random weights."""
    import fairseq_alibi.models  # noqa: F401  (registers the models)
    from fairseq import tasks

    cfg = fairseq_config([str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_alibi",
                          "--tokens-per-sample", str(L), "--cpu", *COMMON, *extra])
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.4
            parameter.copy_(1 + noise / 4 if "norm" in name else noise)
    return model.eval(), cfg


def export(*args) -> tuple:
    return captured(export_main, *args)


def fairseq_log_probs(model, ids, scaling=NO_SCALING) -> torch.Tensor:
    if attention.biases(model):
        attention.rescale(model, scaling)
    with torch.no_grad():
        return model.get_normalized_probs(model(ids), log_probs=True).float()


def tokens(length: int, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(4, 4 + WORDS, (1, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 2
    return ids


#: Loads every export given in a process where fairseq and fairseq_alibi cannot be
#: imported: transformers alone (trust_remote_code only where the export needs it).
LOAD_ALL = """
import importlib.abc, json, sys
class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq_alibi", "fairseq"):
            raise ImportError("guard: " + name)
sys.meta_path.insert(0, Guard())
import torch
from transformers import AutoModelForCausalLM
jobs, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
found = {}
for name, (out, remote) in jobs.items():
    model = (AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True) if remote
             else AutoModelForCausalLM.from_pretrained(out)).eval()
    with torch.no_grad():
        own = model(input_ids=torch.tensor([ids])).logits.float().log_softmax(-1)
        wide = model.float()(input_ids=torch.tensor([ids])).logits.log_softmax(-1)
    found[name] = {"class": type(model).__name__, "module": type(model).__module__, "own": own[0].tolist(),
                   "float32": wide[0].tolist()}
found["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_alibi"))
print("RESULT", json.dumps(found))
"""


def load_all_bare(jobs: dict, ids: torch.Tensor, tmp_path: Path) -> dict:
    env = cli_env(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = ""  # not the worktree: fairseq_alibi must not be importable from there
    result = subprocess.run([sys.executable, "-c", LOAD_ALL, json.dumps(jobs), json.dumps(ids[0].tolist())],
                            capture_output=True, text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULT ", 1)[1])


# ------------------------------------------------------------------ fixtures: models, checkpoints, exports
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A 40-word dict.txt, and a valid split of 127 words on one line (128 tokens
    with its </s>: whole windows of 16 and 64 tokens) binarized by fairseq-preprocess."""
    path = tmp_path_factory.mktemp("positions_data")
    (path / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(WORDS)))
    words = [f"w{(7 * i + i // 5) % WORDS}" for i in range(127)]
    (path / "valid.txt").write_text(" ".join(words) + "\n")
    run_cli([tool("fairseq-preprocess"), "--only-source", "--srcdict", path / "dict.txt", "--validpref",
             path / "valid.txt", "--destdir", path / "bin", "--workers", "1"])
    return path


@pytest.fixture(scope="module")
def exports(data_dir, tmp_path_factory) -> dict:
    """name-dtype -> (fairseq model, checkpoint, export directory, printed output):
    every custom method and the comparison's rotary model (GPT-NeoX) in float32,
    and :data:`HALF`'s in half precision."""
    root = tmp_path_factory.mktemp("positions_exports")
    made = {}
    for name, flags in [*CUSTOM.items(), ("neox", ROTARY)]:
        model, cfg = build(data_dir / "bin", flags)
        checkpoint = save(model, cfg, root / f"{name}.pt")
        state = torch.load(checkpoint, weights_only=True)  # fairseq's loader (alibi-sweep) reads the last entry
        state["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 0}]
        torch.save(state, checkpoint)
        for dtype in ("float32", *([HALF[name]] if name in HALF else [])):
            key = f"{name}-{dtype}"
            status, output = export(checkpoint, root / key, "--dtype", dtype)
            assert status == 0, output
            made[key] = (model, checkpoint, root / key, output)
    return made


@pytest.fixture(scope="module")
def bare(exports, tmp_path_factory) -> dict:
    """Every export loaded back without fairseq or this package, on 3 L tokens."""
    jobs = {key: (str(out), not key.startswith("neox")) for key, (_, _, out, _) in exports.items()}
    return load_all_bare(jobs, tokens(3 * L), tmp_path_factory.mktemp("bare"))


# ------------------------------------------------------------------ every method, exactly
@pytest.mark.parametrize("name", list(CUSTOM))
@pytest.mark.slow
def test_every_method_exports_exactly_through_the_custom_model(name, exports, bare):
    """float32: the fairseq log-probs within float32 rounding, up to 3 L; bfloat16 and
    float16: the written weights computed in float32 equal the fairseq model given the
    same rounded weights (what the export's same-precision check claims), and in their
    own dtype they differ by that dtype's rounding, a few percent of the scale at most."""
    assert bare["imported"] == []
    ids = tokens(3 * L)
    for dtype in ("float32", *([HALF[name]] if name in HALF else [])):
        torch_dtype = DTYPES[dtype]
        model, _, out, output = exports[f"{name}-{dtype}"]
        got = bare[f"{name}-{dtype}"]
        assert got["class"] == "AlibiForCausalLM" and got["module"].startswith("transformers_modules.")
        config = json.loads((out / "config.json").read_text())
        assert config["position_method"] == name.split("-")[0]
        reference = fairseq_log_probs(model, ids)[0]
        if dtype == "float32":
            assert max_diff(torch.tensor(got["own"]), reference) < 1e-5, name
            continue
        rounded = fairseq_log_probs(_rounded(model, torch_dtype), ids)[0]
        assert max_diff(torch.tensor(got["float32"]), rounded) < 1e-4, (name, dtype)
        lost = max_diff(torch.tensor(got["own"]), reference)
        assert 0 < lost < 0.03 * reference.abs().max().item(), (name, dtype)  # rounding, not a defect
        assert f"({dtype} rounding); same-precision difference" in output


def test_every_registered_method_has_a_custom_export_case():
    """A method added to the registry is exported here (its case in :data:`CUSTOM`)."""
    archs = {flags[flags.index("--arch") + 1] for flags in CUSTOM.values()}
    assert {f"transformer_lm_{name}" for name in POSITIONS if name not in ("alibi", "rotary")} <= archs


@pytest.mark.parametrize("name", list(CUSTOM))
@pytest.mark.slow
def test_every_export_decodes_with_its_kv_cache_as_fairseq_scores_or_refuses_one(name, exports):
    """Token by token with transformers' cache, a method whose entry has a KV cache
    (``kv_cache``) gives fairseq's log-probs of the whole row; one without refuses the cache in
    one line (its state is not the keys and values alone: FoX's gate sums, PaTH's keys)."""
    from transformers.cache_utils import DynamicCache

    from fairseq_alibi.core.errors import InputError
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    model, _, out, _ = exports[f"{name}-float32"]
    hf = AlibiForCausalLM.from_pretrained(out).eval()
    ids = tokens(2 * L)
    method = json.loads((out / "config.json").read_text())["position_method"]
    if not POSITIONS.get(method, POSITIONS["nope"]).kv_cache:
        with pytest.raises(InputError, match="no KV cache yet .* use_cache=False"):
            hf(input_ids=ids, use_cache=True)
        return
    cache, steps = DynamicCache(), []
    with torch.no_grad():
        steps.append(hf(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits)
        for t in range(5, ids.size(1)):
            steps.append(hf(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    got, reference = torch.cat(steps, dim=1).float().log_softmax(-1), fairseq_log_probs(model, ids)
    assert max_diff(got, reference) < 4e-6 * max(10.0, reference.abs().max().item()), name  # float32 rounding


def _rounded(model, dtype):
    """A copy of ``model`` whose saved weights (its state dict: not fairseq's
    sinusoidal table, a buffer it does not save) are rounded to ``dtype``, in float32."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in rounded.state_dict(keep_vars=True).values():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype).float()
    return rounded


@pytest.mark.slow
def test_the_custom_configs_name_each_methods_settings(exports):
    """rope_parameters for rotary (as transformers spells it), alibi_scaling for none of them,
    the learned biases' parameters; auto chose the custom format for the post-norm rotary
    model and said why in one line."""
    configs = {name: json.loads((exports[f"{name}-float32"][2] / "config.json").read_text()) for name in CUSTOM}
    assert configs["rotary-postnorm"]["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 1.0}
    assert configs["t5bias"]["position_params"] == {"t5_buckets": 8, "t5_max_distance": 24, "t5_init_slopes": 0.0}
    assert configs["fire"]["position_params"]["fire_hidden"] == 8
    assert configs["rnope"]["position_params"] == {"rotary_base": 10000.0, "rnope_window": 6, "rnope_nope_every": 0}
    assert configs["alibi-ssmax"]["ssmax"] is True and configs["fox"]["ssmax"] is False
    assert configs["fox"]["use_cache"] is False and configs["rnope"]["use_cache"] is True
    assert all(c["alibi_scaling"] is None for c in configs.values())
    assert all(c["rope_parameters"] is None for name, c in configs.items() if name != "rotary-postnorm")
    printed = exports["rotary-postnorm-float32"][3]
    assert printed.splitlines()[0] == ("format custom (trust_remote_code=True): GPT-NeoX cannot hold this rotary "
                                       "model: post-norm layers; no final layer norm")
    assert "AlibiForCausalLM (trust_remote_code=True)" in printed.splitlines()[1]


@pytest.mark.slow
def test_a_fox_export_generates_without_a_cache_and_refuses_one_in_one_line(data_dir, tmp_path):
    """FoX's running sums of log gates are not carried in transformers' cache: the export
    says so when asked for one, and generates with use_cache=False (its config's default)
    as fairseq scores the same tokens."""
    from fairseq_alibi.core.errors import InputError
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    model, cfg = build(data_dir / "bin", CUSTOM["fox"])
    status, output = export(save(model, cfg, tmp_path / "fox.pt"), tmp_path / "out")
    assert status == 0, output
    hf = AlibiForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokens(L)
    with pytest.raises(InputError, match="no KV cache yet .* use_cache=False"):
        hf(input_ids=ids, use_cache=True)
    with torch.no_grad():
        generated = hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
        greedy = ids
        for _ in range(4):  # the same greedy tokens from fairseq's full forwards
            greedy = torch.cat([greedy, fairseq_log_probs(model, greedy)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, greedy)


# ------------------------------------------------------------------ rotary as GPT-NeoX
@pytest.mark.slow
def test_rotary_exports_as_stock_gpt_neox_within_float32_rounding(exports, bare):
    """AutoModelForCausalLM.from_pretrained(OUT) alone: GPTNeoXForCausalLM, sequential
    residual, relu, untied (the scaled embedding folded into the input side), log-probs
    within float32 rounding of fairseq's; the bfloat16 and float16 files are the float32
    file's weights rounded (loaded here and rounded alike: the same log-probs)."""
    model, _, out, output = exports["neox-float32"]
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and not list(out.glob("*.py"))
    assert (config["architectures"], config["use_parallel_residual"], config["hidden_act"],
            config["tie_word_embeddings"], config["max_position_embeddings"]) == (
               ["GPTNeoXForCausalLM"], False, "relu", False, L)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    assert "wrote" in output and "GPTNeoXForCausalLM (no custom code)" in output
    ids = tokens(3 * L)
    assert bare["neox-float32"]["class"] == "GPTNeoXForCausalLM"
    assert max_diff(torch.tensor(bare["neox-float32"]["own"]), fairseq_log_probs(model, ids)[0]) < 1e-5
    from transformers import AutoModelForCausalLM

    written = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    dtype = HALF["neox"]
    rounded = _rounded(written, DTYPES[dtype])
    assert max_diff(torch.tensor(bare[f"neox-{dtype}"]["float32"]), hf_log_probs(rounded, ids)[0]) < 1e-6
    assert f"({dtype} rounding); same-precision difference" in exports[f"neox-{dtype}"][3]


def sweep_cells(data_dir: Path, checkpoint: Path, methods: str, tmp_path: Path) -> dict:
    """``alibi-sweep`` of the fairseq checkpoint on the valid split: (label, length) -> loss in bits."""
    from fairseq_alibi.evaluation import perplexity

    assert perplexity.main([str(data_dir / "bin"), "-c", f"fs={checkpoint}", "--lengths", "1x,4x", "--methods",
                            methods, "--modes", "nonoverlapping", "--cpu", "--no-progress", "-o",
                            str(tmp_path / "sweep")]) == 0
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    return {(c["label"], c["length"]): c["loss"] for c in cells}


def text_ids(data_dir: Path) -> torch.Tensor:
    """The valid split as the sweep streams it: </s>, the words, </s>."""
    words = (data_dir / "valid.txt").read_text().split()
    return torch.tensor([2] + [4 + int(w[1:]) for w in words] + [2])


def neox_with(out: Path, **rope):
    """The GPT-NeoX export loaded with transformers' own ``rope_parameters`` (its
    base and rotated share kept, as a user copies them from the config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    stored = dict(AutoConfig.from_pretrained(str(out)).rope_parameters)
    return AutoModelForCausalLM.from_pretrained(str(out), rope_parameters=dict(stored, **rope)).eval()


@pytest.mark.slow
def test_transformers_rope_methods_equal_our_sweep_cells(data_dir, exports, tmp_path):
    """The GPT-NeoX export under transformers' linear, dynamic (factor 1) and yarn, set at
    load time, and under what --alibi-scaling ntk:2 (a base) and yarn:2 write: the
    perplexity of each on the sweep's windows equals the fairseq checkpoint's
    alibi-sweep cell under our spelling of the same method, at L and 4 L."""
    from fairseq_alibi.export.neox import neox_rope_parameters

    model, checkpoint, out, _ = exports["neox-float32"]
    cells = sweep_cells(data_dir, checkpoint, "none,linear:2,ntk,ntk:2,yarn:2", tmp_path)
    ids = text_ids(data_dir)
    assert (len(ids) - 1) % (4 * L) == 0  # whole windows: no short last one (see the dynamic test below)
    runs = {"none": neox_with(out),
            "linear x2": neox_with(out, rope_type="linear", factor=2.0),
            "ntk dynamic": neox_with(out, rope_type="dynamic", factor=1.0),
            "yarn x2": neox_with(out, rope_type="yarn", factor=2.0, original_max_position_embeddings=L),
            "ntk x2": neox_with(out, **neox_rope_parameters(Scaling("ntk", 2.0), 500.0, 4, DIM // HEADS)),
            "yarn x2 (export)": neox_with(out, **neox_rope_parameters(Scaling("yarn", 2.0, L), 500.0, 4,
                                                                      DIM // HEADS))}
    for label, hf_model in runs.items():
        for length in (L, 4 * L):
            ours = cells[(label.split(" (")[0], length)]
            assert window_loss(hf_model, ids, length) == pytest.approx(ours, abs=1e-5), (label, length)
    assert len({round(cells[(label, 4 * L)], 3) for label in ("none", "linear x2", "ntk dynamic", "ntk x2",
                                                              "yarn x2")}) == 5  # past L they differ


@pytest.mark.slow
def test_transformers_dynamic_ntk_is_ours_at_factor_1_stretched_at_f_and_keeps_its_longest_input(exports):
    """transformers' dynamic NTK: at factor 1 our dynamic ntk on a fresh model; at factor F,
    over n > L tokens, our static ntk at F n / L - (F - 1); and it keeps the frequencies of
    the longest input it has seen: a 2 L window after a 4 L one is our static ntk at 4, where
    our dynamic ntk (and a fresh model) takes 2."""
    model = exports["neox-float32"][0]
    out = exports["neox-float32"][2]
    long, short = tokens(4 * L, seed=5), tokens(2 * L, seed=6)
    same = neox_with(out, rope_type="dynamic", factor=1.0)
    assert max_diff(hf_log_probs(same, long)[0], fairseq_log_probs(model, long, Scaling("ntk", 0, L))[0]) < 1e-5
    stretched = neox_with(out, rope_type="dynamic", factor=2.0)
    expected = fairseq_log_probs(model, long, Scaling("ntk", 2 * 4 * L / L - 1))[0]
    assert max_diff(hf_log_probs(stretched, long)[0], expected) < 1e-5
    after_long = hf_log_probs(same, short)[0]  # `same` has seen 4 L tokens
    assert max_diff(after_long, fairseq_log_probs(model, short, Scaling("ntk", 4.0))[0]) < 1e-5
    fresh = hf_log_probs(neox_with(out, rope_type="dynamic", factor=1.0), short)[0]
    assert max_diff(fresh, fairseq_log_probs(model, short, Scaling("ntk", 0, L))[0]) < 1e-5
    assert max_diff(after_long, fresh) > 1e-3


def test_yarn_ramp_end_is_capped_at_d_minus_1_as_in_transformers():
    """YaRN's ramp: ours and transformers' agree at every base, including one so small
    that the slowest pair turns more than once within L (base 1.5, d 8, L 16: the uncapped
    end would be pair 10), where both cap the end at d - 1 = 7 (d the rotated dimensions,
    not the d / 2 pairs the ramp runs over)."""
    from transformers import GPTNeoXConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def theirs(base: float) -> torch.Tensor:
        config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=L, rope_parameters={
            "rope_type": "yarn", "rope_theta": base, "partial_rotary_factor": 1.0, "factor": 2.0,
            "original_max_position_embeddings": L})
        inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        assert scale == pytest.approx(rotary.yarn_attention_scale(2.0))  # 0.1 ln s + 1, the same
        return inv_freq

    for base in (500.0, 1.5):
        torch.testing.assert_close(theirs(base), rotary.extended_frequencies("yarn", 2.0, 8, base, L)[0])
    assert rotary.yarn_ramp(8, 1.5, L) == pytest.approx([0.0, 1 / 7, 2 / 7, 3 / 7])  # low end 0, high end 7
    plain = rotary.inv_frequencies(8, 1.5)
    capped = torch.tensor([min(max(i / 7, 0.0), 1.0) for i in range(4)])
    torch.testing.assert_close(theirs(1.5), plain * ((1 - capped) + capped / 2.0))


@pytest.mark.slow
def test_gpt_neox_refuses_what_it_cannot_hold_in_one_line(data_dir, exports, tmp_path):
    """--format gpt-neox on a post-norm rotary model and on an ALiBi model, and a dynamic
    yarn it has no type for: one line naming each feature, pointing to the default format."""
    post = exports["rotary-postnorm-float32"][1]
    line = one_error_line(export(post, tmp_path / "a", "--format", "gpt-neox")[1])
    assert line == ("error: the GPT-NeoX format cannot hold this model: post-norm layers; no final layer norm; "
                    "export it in the default format (--format custom), which holds every model of this plugin")
    rotary_checkpoint = exports["neox-float32"][1]
    line = one_error_line(export(rotary_checkpoint, tmp_path / "b", "--format", "gpt-neox", "--alibi-scaling",
                                 "yarn")[1])
    assert "dynamic yarn scaling (transformers has static yarn only)" in line
    t5 = exports["t5bias-float32"][1]
    line = one_error_line(export(t5, tmp_path / "c", "--format", "gpt-neox")[1])
    assert "position method t5bias (GPT-NeoX: rotary)" in line
    line = one_error_line(export(t5, tmp_path / "d", "--alibi-scaling", "ntk:2")[1])
    assert line == ("error: --position-scaling ntk:2 does not apply to t5bias models; the methods that do: "
                    + ", ".join(POSITIONS["t5bias"].extensions))
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_a_rotary_model_with_ssmax_is_exported_in_the_default_format_and_gpt_neox_refuses_it(data_dir, tmp_path):
    """GPT-NeoX has no SSMax: ``auto`` writes the default format and says why,
    ``--format gpt-neox`` refuses in one line (it wrote GPT-NeoX without the
    learned scales, then failed its own check as 'a bug')."""
    model, cfg = build(data_dir / "bin", ROTARY + ["--ssmax"])
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    line = one_error_line(export(checkpoint, tmp_path / "a", "--format", "gpt-neox")[1])
    assert line == ("error: the GPT-NeoX format cannot hold this model: SSMax (learned logit scales per head); "
                    "export it in the default format (--format custom), which holds every model of this plugin")
    status, output = export(checkpoint, tmp_path / "b")
    assert status == 0 and "GPT-NeoX cannot hold this rotary model: SSMax" in output, output
    assert json.loads((tmp_path / "b" / "config.json").read_text())["ssmax"] is True


def test_the_check_scores_past_where_a_models_own_position_settings_act(data_dir, tmp_path):
    """RNoPE's window, T5's max distance and FIRE's threshold change what a model
    computes past them: the export's check scores 24 tokens past the farthest (an
    RNoPE window of 40 was never exercised on 24 tokens); methods that act alike at
    every distance keep 24."""
    from fairseq_alibi.export import check

    reaches = {}
    for name, flags in (("rnope", ["--arch", "transformer_lm_rnope", *COMPARE, "--rnope-window", "40"]),
                        ("t5bias", CUSTOM["t5bias"]), ("fire", CUSTOM["fire"]), ("kerple", CUSTOM["kerple"]),
                        ("fox", CUSTOM["fox"])):
        reaches[name] = check.position_reach(build(data_dir / "bin", flags)[0])
    assert reaches == {"rnope": 40, "t5bias": 24, "fire": reaches["fire"], "kerple": None, "fox": None}
    assert isinstance(reaches["fire"], int) and reaches["fire"] >= 1  # the learned threshold, rounded up
    assert check.check_length(NO_SCALING, 40) == 64 and check.check_length(NO_SCALING, None) == check.TOKENS
    assert check.check_length(Scaling.parse("cap:4", L), 40) == 88  # the farther of the two
    model, cfg = build(data_dir / "bin", ["--arch", "transformer_lm_rnope", *COMPARE, "--rnope-window", "40"])
    status, output = export(save(model, cfg, tmp_path / "rnope.pt"), tmp_path / "rnope")
    assert status == 0 and "on 64 random tokens" in output, output


def test_a_rotary_model_under_static_yarn_exports_in_the_default_format(data_dir, tmp_path):
    """``--format custom --position-scaling yarn:2`` on a rotary model: transformers'
    own rope validation, run by save_pretrained, read a field this config lacks
    (an AttributeError traceback); the config's own check runs instead, the export
    equals the fairseq model under yarn:2, and a loaded export set to yarn saves."""
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    model, cfg = build(data_dir / "bin", ROTARY)
    checkpoint = save(model, cfg, tmp_path / "m.pt")
    status, output = export(checkpoint, tmp_path / "yarn", "--format", "custom", "--position-scaling", "yarn:2")
    assert status == 0, output
    ids = tokens(3 * L)
    loaded = AlibiForCausalLM.from_pretrained(tmp_path / "yarn").eval()
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        got = loaded(input_ids=ids).logits.float().log_softmax(-1)[0]
    assert max_diff(got, fairseq_log_probs(model, ids, Scaling("yarn", 2.0, L))[0]) < 1e-5
    plain = AlibiForCausalLM.from_pretrained(tmp_path / "yarn").eval()
    plain.set_alibi_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L})
    plain.save_pretrained(tmp_path / "again")
    assert AlibiForCausalLM.from_pretrained(tmp_path / "again").config.rope_parameters["factor"] == 4.0


# ------------------------------------------------------------------ the evaluation tools on the exports
@pytest.mark.slow
def test_alibi_sweep_hf_scores_every_export_as_its_checkpoint(data_dir, exports, tmp_path):
    """One alibi-sweep: every custom export (--hf) beside its fairseq checkpoint (-c) on the
    same split: the same loss in every cell, at L and past it."""
    from fairseq_alibi.evaluation import perplexity

    names = list(CUSTOM)
    args = [str(data_dir / "bin")]
    for name in names:
        _, checkpoint, out, _ = exports[f"{name}-float32"]
        args += ["-c", f"fs-{name}={checkpoint}", "--hf", f"hf-{name}={out}"]
    assert perplexity.main([*args, "--lengths", "1x,3x", "--methods", "none", "--modes", "nonoverlapping,sliding",
                            "--stride", "8", "--cpu", "--no-progress", "-o", str(tmp_path / "sweep")]) == 0
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    by = {(c["checkpoint"], c["mode"], c["length"]): c for c in cells}
    assert len(by) == 2 * len(names) * 2 * 2
    for (who, mode, length), cell in by.items():
        if who.startswith("fs-"):
            twin = by[("hf-" + who[3:], mode, length)]
            assert twin["tokens"] == cell["tokens"] and twin["loss"] == pytest.approx(cell["loss"], abs=1e-5), who


@pytest.mark.slow
def test_alibi_retrieval_hf_scores_every_export_as_its_checkpoint(data_dir, exports, tmp_path):
    """alibi-retrieval on every custom export (--hf) and on its checkpoint (-c): the same
    answers and log-probs, as trained and under logn (every method has it), at L and past it."""
    from fairseq_alibi.evaluation import retrieval

    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n)),
                                           "answer": f"w{rng.randrange(WORDS)} w{rng.randrange(WORDS)}"}) + "\n"
                               for n in (5, L - 4, 3 * L)))
    common = ["--task", str(prompts), "--methods", "none,logn", "--cpu", "--no-progress"]
    fairseq_args, hf_args = [str(data_dir)], []
    for name in CUSTOM:
        _, checkpoint, out, _ = exports[f"{name}-float32"]
        fairseq_args += ["-c", f"{name}={checkpoint}"]
        hf_args += ["--hf", f"{name}={out}"]
    assert retrieval.main([*fairseq_args, *common, "-o", str(tmp_path / "fs")]) == 0
    assert retrieval.main([*hf_args, *common, "-o", str(tmp_path / "hf")]) == 0
    cells = {side: json.loads((tmp_path / side / "results.json").read_text())["cells"] for side in ("fs", "hf")}
    # 3 lengths x (none, logn) where the model's method takes them: the stock sinusoidal model and
    # stick-breaking (no softmax to scale) take none alone
    from fairseq_alibi.core.positions import extensions

    def method_of(flags):
        arch = flags[flags.index("--arch") + 1]
        return arch[len("transformer_lm_"):] if arch.startswith("transformer_lm_") else None

    expected = 3 * sum(len({"none", "logn"} & set(extensions(method_of(flags)))) for flags in CUSTOM.values())
    assert len(cells["fs"]) == len(cells["hf"]) == expected
    same = ("checkpoint", "label", "length", "n", "correct", "sample_correct")
    for fs, hf_cell in zip(cells["fs"], cells["hf"]):
        assert {k: fs[k] for k in same} == {k: hf_cell[k] for k in same}
        assert fs["sample_logprob"] == pytest.approx(hf_cell["sample_logprob"], abs=1e-4), fs


@pytest.mark.slow
def test_lm_eval_harness_runs_on_every_export(data_dir, exports, tmp_path, monkeypatch):
    """lm_eval's Python API, offline, on a local task (``--model hf``): the GPT-NeoX export
    without trust_remote_code, every custom one with it; each log-likelihood the fairseq
    model's (the harness feeds the tokenizer's </s> first, as fairseq does)."""
    import lm_eval  # requirements-eval.txt: installed by make install
    from lm_eval.tasks import TaskManager
    from transformers import dynamic_module_utils

    from test_export import HARNESS_TASK

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    docs = []
    for n, (context, continuation) in enumerate([(3 * L, 4), (L // 2, 1)]):
        ids = tokens(context + continuation, seed=10 + n)[0, 1:].tolist()
        docs.append({"context": " ".join(f"w{i - 4}" for i in ids[:context - 1]),
                     "continuation": " ".join(f"w{i - 4}" for i in ids[context - 1:]), "ids": ids})
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "check.yaml").write_text(HARNESS_TASK.format(data=tmp_path / "docs.jsonl",
                                                                       cache=tmp_path / "datasets"))
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    for name in ["neox", *CUSTOM]:
        model, _, out, _ = exports[f"{name}-float32"]
        # max_length: GPT-NeoX's max_position_embeddings is the training length, which the harness takes as its limit
        remote = ",max_length=2048" if name == "neox" else ",trust_remote_code=True"
        results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out}{remote},dtype=float32",
                                          tasks=["alibi_export_check"], task_manager=manager, device="cpu",
                                          batch_size=1, log_samples=True, bootstrap_iters=0)
        samples = sorted(results["samples"]["alibi_export_check"], key=lambda s: s["doc_id"])
        assert len(samples) == len(docs), name
        for sample, doc in zip(samples, docs):
            ids = torch.tensor([[2] + doc["ids"]])
            logp = fairseq_log_probs(model, ids[:, :-1])[0]
            scored = len(doc["continuation"].split())
            expected = logp[-scored:].gather(-1, ids[0, -scored:, None]).sum().item()
            assert sample["filtered_resps"][0][0] == pytest.approx(expected, abs=1e-4), name


def test_logn_is_written_and_read_back_for_every_position_method():
    """logn applies to every method: a rotary config holds it in rope_parameters (our
    spelling: transformers has no such type), the others in alibi_scaling; a method
    another position method has not is refused in one line."""
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig, rope_parameters_of, scaling_of_rope
    from fairseq_alibi.core.errors import ScalingError

    logn = Scaling.parse("logn", L)
    rope = rope_parameters_of(logn, 10000.0, 1.0)
    assert rope == {"rope_type": "logn", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "factor": 1.0,
                    "original_max_position_embeddings": L}
    assert scaling_of_rope(rope, None) == logn.complete()
    for method in [m for m in POSITIONS if m not in ("alibi", "rotary")] + ["sinusoidal"]:
        if "logn" not in attention_entry(method).extensions:  # no softmax (stick-breaking): refused, naming what applies
            with pytest.raises(ScalingError, match=f"a {method} model's context extension is one of none$"):
                AlibiLMConfig(position_method=method, alibi_scaling=logn.to_hf(), alibi_train_length=L).scaling()
            continue
        config = AlibiLMConfig(position_method=method, alibi_scaling=logn.to_hf(), alibi_train_length=L)
        assert config.scaling() == logn.complete(), method
    with pytest.raises(ScalingError, match="a t5bias model's context extension is one of none, logn"):
        AlibiLMConfig(position_method="t5bias", alibi_scaling={"type": "ntk", "factor": 2.0}, alibi_train_length=L)
