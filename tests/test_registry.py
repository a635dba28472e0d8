"""The registry of position methods (core/positions.py) is the one list of methods:
every list in the code reads it, what the export and the KV cache need is a field
of an entry, no code outside the registry and a method's own module compares a
method's name with a string, and a method registered at run time (a module and an
entry of this file alone) is a model of every tool."""

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from fairseq_alibi.core import positions as P
from fairseq_alibi.core.alibi import get_slopes
from fairseq_alibi.core.bias import ModuleBias
from fairseq_alibi.core.scaling import Scaling

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a toy method, defined here alone
class SqrtBias(torch.nn.Module):
    """A toy static bias: ``-s_h sqrt(i - j)``, ``s_h`` learned per head (ALiBi's slopes at step 0)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.scale = torch.nn.Parameter(get_slopes(num_heads).clone())

    def values(self, query, key):
        distance = (query.to(torch.float32) - key.to(torch.float32)).clamp(min=0)
        return -self.scale[:, None, None] * distance.sqrt()


def build_toy(num_heads, head_dim, params, scaling):
    return ModuleBias(SqrtBias(num_heads), num_heads, toeplitz=True)


TOY = P.Position("toy", "bias", P.PLAIN, "-s_h sqrt(i - j): a test's method", build_toy, colour=None)
#: The toy's module as a plugin writes it: this file's code, its imports of the core relative (it is
#: loaded as a module of the core, ``positions.load_module``, here and in an exported model's directory).
TOY_IMPORTS = "import torch\n\nfrom .alibi import get_slopes\nfrom .bias import ModuleBias\n"


def toy_module(folder: Path, imports: str = TOY_IMPORTS, stem: str = "sqrt_bias") -> Path:
    """The toy's module (its maths and its entry, registered when it is imported) in ``folder``."""
    import inspect

    path = folder / f"{stem}.py"
    path.write_text(
        '"""A test\'s position method (tests/test_registry.py): its maths and its entry."""\n\n' + imports
        + "from .positions import PLAIN, Position, register\n\n\n" + inspect.getsource(SqrtBias) + "\n\n"
        + inspect.getsource(build_toy) + "\n\n"
        + 'register(Position("toy", "bias", PLAIN, "-s_h sqrt(i - j): a test\'s method", build_toy))\n',
        encoding="utf-8")
    return path


def without(name: str) -> None:
    """Take a method registered by a test out of the registry and fairseq's registries."""
    P.POSITIONS.pop(name, None)
    if "fairseq.models" in sys.modules:
        from fairseq import models

        model = f"transformer_lm_{name}"
        for registry in (models.MODEL_REGISTRY, models.MODEL_DATACLASS_REGISTRY, models.ARCH_MODEL_REGISTRY,
                         models.ARCH_CONFIG_REGISTRY, models.ARCH_MODEL_NAME_REGISTRY):
            registry.pop(model, None)
        models.ARCH_MODEL_INV_REGISTRY.pop(model, None)


@pytest.fixture
def toy():
    """The toy method registered for one test (and the fairseq model registered from it)."""
    import fairseq_alibi.models  # noqa: F401  (listens for registrations: transformer_lm_<name>)

    P.register(TOY)
    try:
        yield TOY
    finally:
        without(TOY.name)


def example(path: str):
    """An example script, imported as a module."""
    name = path.replace("/", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- every list is the registry's
def method_lists():
    """Every list of position methods the code holds, by where it is (``sinusoidal``, the
    stock model, taken out): each must be the registry's, in its order."""
    from fairseq import models

    import fairseq_alibi.models  # noqa: F401  (registers the models)
    from fairseq_alibi import facts
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig  # noqa: F401  (the export gate's)
    from fairseq_alibi.evaluation.styles import position_colour

    def registered(name):
        return facts.position_model(name) in models.MODEL_REGISTRY

    stock = {P.SINUSOIDAL}
    return {
        "the exported model's position_method values (the export gate)": [
            m for m in P.exported_methods() if m not in stock],
        "the language models the tools evaluate (facts.language_models)": [
            facts.position_of(m) for m in facts.language_models() if facts.position_of(m)],
        "the recipes' models (examples/registry.py)": [
            m for m in example("examples/registry.py").models() if m not in stock],
        "the fairseq models transformer_lm_<name>": [m for m in P.POSITIONS if registered(m)],
        "the plots' colours": [m for m in P.POSITIONS if position_colour(m)],
    }


@pytest.mark.parametrize("registered", [False, True], ids=["as shipped", "with a method registered at run time"])
def test_every_list_of_methods_is_the_registrys(registered, request):
    if registered:
        request.getfixturevalue("toy")
    expected = list(P.POSITIONS)
    assert ("toy" in expected) == registered
    for where, names in method_lists().items():
        assert names == expected, where


def test_every_entry_says_what_the_export_and_the_cache_need():
    """Each entry: formats it exports to (the default one always), a KV cache or not,
    where the exported config spells its extension, and a colour of its own."""
    colours = [P.position(n).colour for n in P.POSITIONS]
    assert all(colours) and len(set(colours)) == len(colours)
    for entry in P.POSITIONS.values():
        assert P.CUSTOM in entry.exports and set(entry.exports) <= {P.CUSTOM, P.BLOOM, P.NEOX}, entry.name
        assert entry.scaling_key in (P.ALIBI_SCALING, P.ROPE_PARAMETERS), entry.name
        assert isinstance(entry.kv_cache, bool), entry.name
    assert [n for n in P.POSITIONS if not P.position(n).kv_cache] == ["fox", "path"]
    for entry in P.POSITIONS.values():  # a state of its own (layer.attention's own_cache): none in transformers' cache
        params = {p.name: p.default for p in entry.params}
        stack = P.build(entry.name, 4, 8, params, Scaling("none", 0.0, 32), layers=4)
        assert not (stack.at_layer(0).for_layer().own_cache and entry.kv_cache), entry.name
    assert P.holding(P.BLOOM) == ("alibi",) and P.holding(P.NEOX) == ("rotary",)


def test_the_exported_model_reads_the_cache_and_the_scaling_key_from_the_entry(monkeypatch):
    """The KV-cache refusal and the config's spelling follow the entry's fields, not the name:
    NoPE marked without a cache is refused one; marked rope-spelled, its config reads rope_parameters."""
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
    from fairseq_alibi.core.errors import InputError
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM

    config = AlibiLMConfig(vocab_size=12, hidden_size=16, layers=2, attention_heads=2, ffn_dim=32,
                           position_method="nope", alibi_train_length=8)
    model = AlibiForCausalLM(config).eval()
    ids = torch.tensor([[4, 5, 6, 7]])
    model(input_ids=ids, use_cache=True)  # as shipped: NoPE has a cache
    monkeypatch.setitem(P.POSITIONS, "nope", dataclasses.replace(P.POSITIONS["nope"], kv_cache=False))
    with pytest.raises(InputError, match="an exported nope model has no KV cache"):
        model(input_ids=ids, use_cache=True)
    model(input_ids=ids, use_cache=False)
    monkeypatch.setitem(P.POSITIONS, "nope", dataclasses.replace(P.POSITIONS["nope"], kv_cache=True,
                                                                  scaling_key=P.ROPE_PARAMETERS))
    assert config.rope_spelled()
    model.set_alibi_scaling({"rope_type": "default"})
    assert config.rope_parameters["rope_type"] == "default" and config.alibi_scaling is None


# ---------------------------------------------------------------- no name compared outside the registry
#: A comparison of a string with a registered method's name: ``== "fox"``, ``"fox" !=``, ``in ("fox", ...)``.
def comparisons(names):
    quoted = "['\"](?:" + "|".join(map(re.escape, names)) + ")['\"]"
    return re.compile(rf"(?:==|!=)\s*{quoted}|{quoted}\s*(?:==|!=)|(?<!for )\b\w+(?:\.\w+)*\s+(?:not\s+)?in\s+"
                      rf"[(\[{{][^)\]}}]*{quoted}")


def own_files():
    """The files that may name a method: the registry, and each method's own module."""
    core = REPO / "fairseq_alibi" / "core"
    return {core / "positions.py", core / "hybrid.py"} | {core / f"{name}.py" for name in P.POSITIONS}


def test_no_code_compares_a_method_name_with_a_string():
    pattern = comparisons(list(P.POSITIONS))
    assert pattern.search('if source.position != "rotary":') and pattern.search('if m in ("alibi", "x"):')
    assert not pattern.search('for name in ("alibi", "sinusoidal"):')
    found = []
    for folder in ("fairseq_alibi", "examples", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path in own_files():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- the toy method through the stock CLIs
def toy_user_dir(root: Path) -> Path:
    """A ``--user-dir`` package that loads the plugin and the toy's module (this file's code), which
    registers the toy."""
    package = root / "toyplugin"
    package.mkdir()
    toy_module(package)
    (package / "__init__.py").write_text(
        "import os\n\nimport fairseq_alibi.models  # noqa: F401  (the plugin: patches, models)\n"
        "from fairseq_alibi.core.positions import load_module\n\n"
        'load_module(os.path.join(os.path.dirname(__file__), "sqrt_bias.py"))\n', encoding="utf-8")
    return package


@pytest.mark.slow
def test_a_method_defined_here_alone_trains_evaluates_with_a_kv_cache_and_exports(lm_data_bin, tmp_path, toy):
    """fairseq-train and fairseq-eval-lm (stock, --user-dir a package of this file's code) train
    and evaluate transformer_lm_toy; its checkpoint decodes token by token (fairseq's incremental
    state, the KV cache) as the full forward; alibi-export-hf (which imports the checkpoint's user
    dir) writes it in the default format with the toy's module beside the core, and the exported
    model, loaded with transformers alone, computes the checkpoint's log-probs, its KV cache too."""
    from conftest import parse_eval, run_cli, tool, train_args

    user_dir = toy_user_dir(tmp_path)
    argv = train_args(lm_data_bin, tmp_path / "ckpt", max_update=10)
    argv[argv.index("transformer_lm_alibi")] = "transformer_lm_toy"
    run_cli([tool("fairseq-train"), *argv, "--user-dir", user_dir], fresh=True)
    checkpoint = tmp_path / "ckpt" / "checkpoint_best.pt"
    evaluated = run_cli([tool("fairseq-eval-lm"), lm_data_bin, "--path", checkpoint, "--user-dir", user_dir,
                         "--cpu", "--tokens-per-sample", "32", "--batch-size", "4"], fresh=True)
    assert parse_eval(evaluated.output).ppl < 1e4

    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([str(checkpoint)])
    model = models[0].eval()
    assert type(model.decoder.positions.method).__name__ == "SqrtBias"
    tokens = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        full = model(tokens)[0]
        state, steps = {}, []
        for i in range(tokens.size(1)):
            steps.append(model.decoder(tokens[:, : i + 1], incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)

    exported = run_cli([tool("alibi-export-hf"), checkpoint, tmp_path / "hf"], fresh=True)
    assert "AlibiForCausalLM (trust_remote_code=True)" in exported.output, exported.output
    code = {p.name for p in (tmp_path / "hf").glob("*.py")}
    assert {"sqrt_bias.py", "methods.py", "modeling_alibi.py"} <= code
    assert "from .sqrt_bias import build_toy" in (tmp_path / "hf" / "methods.py").read_text()
    loaded = load_without_fairseq(tmp_path / "hf", tokens[0].tolist(), tmp_path)
    torch.testing.assert_close(torch.tensor(loaded["logp"]), full.float().log_softmax(-1)[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(loaded["cached"]), torch.tensor(loaded["logp"]), rtol=0, atol=1e-5)
    assert loaded["position"] == "SqrtBias" and loaded["imported"] == []


#: Loads an exported model with transformers alone (after test_export's guard: importing fairseq or this
#: package fails), as a user does: its log-probs on the given ids, the ids decoded one by one through its KV cache.
LOAD_ALONE = """
import torch
from transformers import AutoModelForCausalLM
out, ids = sys.argv[1], torch.tensor([json.loads(sys.argv[2])])
model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
with torch.no_grad():
    logp = model(input_ids=ids, use_cache=False).logits.log_softmax(-1)
    past, steps = None, []
    for i in range(ids.size(1)):
        step = model(input_ids=ids[:, i:i + 1], past_key_values=past, use_cache=True)
        past = step.past_key_values
        steps.append(step.logits.log_softmax(-1))
position = next(type(m).__name__ for m in model.modules() if type(m).__name__ == "SqrtBias")
imported = sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_alibi"))
print("RESULT", json.dumps({"logp": logp[0].tolist(), "cached": torch.cat(steps, 1)[0].tolist(),
                            "position": position, "imported": imported}))
"""


def load_without_fairseq(directory: Path, ids, scratch: Path) -> dict:
    """What :data:`LOAD_ALONE` computes on ``directory``, in a fresh process, remote code cached in ``scratch``."""
    import json
    import subprocess

    from conftest import cli_env
    from test_export import GUARD

    env = cli_env(HF_MODULES_CACHE=str(scratch / "modules"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = ""  # not the worktree: fairseq_alibi must not be importable from there
    script = GUARD.split("import torch")[0] + LOAD_ALONE
    result = subprocess.run([sys.executable, "-c", script, str(directory), json.dumps(ids)], capture_output=True,
                            text=True, env=env, cwd=scratch, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULT ", 1)[1])


# ---------------------------------------------------------------- the export of a method from outside the core
@pytest.fixture
def toy_loaded(tmp_path):
    """The toy registered as its plugin registers it: its module loaded as one of the core's
    (``positions.load_module``); its module, and the toy, gone after the test."""
    import fairseq_alibi.models  # noqa: F401  (listens for registrations: transformer_lm_<name>)

    (tmp_path / "plugin").mkdir()
    module = P.load_module(str(toy_module(tmp_path / "plugin")))
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)
        without("toy")


def toy_checkpoint(tmp_path: Path, arch: str = "transformer_lm_toy", user_dir=None) -> Path:
    """A tiny fairseq checkpoint of ``arch`` (random weights), its config's ``common.user_dir`` set."""
    from test_export import build, save

    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    model, cfg = build(tmp_path / "data", ["--arch", arch])
    cfg.common.user_dir = None if user_dir is None else str(user_dir)
    return save(model, cfg, tmp_path / "model.pt")


def test_a_method_loaded_into_the_core_exports_with_its_module_beside_the_core(toy_loaded, tmp_path):
    """The default format writes the method's module beside the core and a methods.py that
    imports it (so transformers' loader copies it and it registers the method); the export's
    check, which loads the written directory back and compares it with fairseq, passes."""
    from test_export import export

    assert P.load_module(toy_loaded.__file__) is toy_loaded  # loaded once: no second registration
    status, output = export(toy_checkpoint(tmp_path), tmp_path / "hf")
    assert status == 0 and "check: the written files loaded back" in output, output
    written = tmp_path / "hf"
    assert (written / "sqrt_bias.py").read_text() == Path(toy_loaded.__file__).read_text()
    assert "from .sqrt_bias import build_toy" in (written / "methods.py").read_text()
    from transformers.dynamic_module_utils import get_relative_import_files

    assert str(written / "sqrt_bias.py") in get_relative_import_files(str(written / "modeling_alibi.py"))


def test_the_core_methods_travel_alone():
    """No built-in method (nor the stock model) has a module outside the core: the core's
    methods.py, which imports none, is what their exports carry."""
    from fairseq_alibi.core import methods
    from fairseq_alibi.export.writer import method_module

    assert methods.REGISTERED == ()
    for name in P.exported_methods():
        assert method_module(name) is None, name


#: What makes a method's module unable to travel -> the refusal's words.
UNTRAVELED = {
    "registered by a module outside the core": "is not a module of fairseq_alibi.core, so an exported model's "
                                               "directory cannot import it: load the method's file with",
    "importing the core by its package's name": "imports fairseq_alibi.core.alibi \\(line 5\\), which an exported "
                                                "model does not have",
}


@pytest.mark.parametrize("case", list(UNTRAVELED))
def test_a_method_whose_module_cannot_travel_is_refused_in_one_line(case, tmp_path):
    """A method registered from a module that is not loaded as one of the core's, or one whose module
    imports this package by name (which runs here, but not where the exported model is loaded), is
    refused before anything is written."""
    from test_export import export, one_error_line

    import fairseq_alibi.models  # noqa: F401  (listens for registrations)

    module = None
    if case == "registered by a module outside the core":
        P.register(TOY)
    else:
        (tmp_path / "plugin").mkdir()
        absolute = TOY_IMPORTS.replace("from .", "from fairseq_alibi.core.")  # runs here, not without the package
        module = P.load_module(str(toy_module(tmp_path / "plugin", absolute)))
    try:
        status, output = export(toy_checkpoint(tmp_path), tmp_path / "hf")
    finally:
        if module is not None:
            sys.modules.pop(module.__name__, None)
        without("toy")
    assert status == 1 and re.search(UNTRAVELED[case], one_error_line(output)), output
    assert not (tmp_path / "hf").exists()


def test_the_export_imports_the_checkpoints_user_dir_and_refuses_one_that_is_not_here(tmp_path):
    """The checkpoint's common.user_dir is imported as fairseq imports --user-dir (its method
    registered); one that is not here is refused in one line; this plugin's own directory,
    recorded on another machine, is the plugin loaded already."""
    from test_export import export, one_error_line

    from fairseq_alibi.export.source import import_user_dir
    from omegaconf import OmegaConf

    missing = tmp_path / "elsewhere" / "toyplugin"
    status, output = export(toy_checkpoint(tmp_path, "transformer_lm_alibi", missing), tmp_path / "hf")
    assert status == 1 and re.search(f"was trained with --user-dir {missing} .*which is not here",
                                     one_error_line(output)), output
    assert not (tmp_path / "hf").exists()
    import_user_dir("m.pt", {"cfg": OmegaConf.create({"common": {"user_dir": "/another/machine/fairseq_alibi"}})})
    package = tmp_path / "userdirtoy"
    package.mkdir()
    (package / "__init__.py").write_text("LOADED = True\n")
    try:
        import_user_dir("m.pt", {"cfg": OmegaConf.create({"common": {"user_dir": str(package)}})})
        assert sys.modules["userdirtoy"].LOADED
    finally:
        sys.modules.pop("userdirtoy", None)


def test_a_methods_module_may_not_take_a_core_modules_name(tmp_path):
    from fairseq_alibi.core.errors import ConfigError

    path = tmp_path / "bias.py"
    path.write_text("X = 1\n")
    with pytest.raises(ConfigError, match="a method's module cannot be named bias.py, a core module's name"):
        P.load_module(str(path))
