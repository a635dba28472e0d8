"""transformer_lm_alibi built in-process: structure, config resolution, errors."""

import pytest
import torch
from fairseq import options, tasks

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from fairseq_alibi.facts import UNBOUNDED_POSITIONS
from fairseq_alibi.core.scaling import METHODS

from conftest import fairseq_config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dict")
    (path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    return path


def build(data_dir, *extra, arch="transformer_lm_alibi"):
    argv = [
        str(data_dir), "--task", "language_modeling", "--arch", arch,
        "--tokens-per-sample", "128", "--decoder-layers", "3",
        "--decoder-embed-dim", "48", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "6", *extra,
    ]
    cfg = fairseq_config(argv)
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model), cfg


def test_no_positions_and_one_shared_bias(data_dir):
    model, _ = build(data_dir)
    assert model.decoder.embed_positions is None
    assert not [k for k in model.state_dict() if "pos" in k]
    biases = {id(layer.self_attn.positions) for layer in model.decoder.layers}
    assert biases == {id(model.decoder.positions)}
    assert model.decoder.positions.num_heads == 6
    assert model.max_positions() == UNBOUNDED_POSITIONS


def test_io_dims_follow_embed_dim(data_dir):
    """No silent 512-wide input/output projections on a 48-wide model."""
    model, cfg = build(data_dir)
    assert model.decoder.project_in_dim is None and model.decoder.project_out_dim is None
    assert model.decoder.embed_tokens.weight.shape == (len(model.decoder.dictionary), 48)


def test_train_length_defaults_to_tokens_per_sample(data_dir):
    _, cfg = build(data_dir)
    assert cfg.model.alibi_train_length == 128
    model, cfg = build(data_dir, "--alibi-train-length", "64", "--alibi-interpolation", "linear")
    assert model.decoder.positions.scaling.train_length == 64
    # dynamic linear: trained at 64, a 256-token forward divides slopes by 4
    slopes = model.decoder.positions.slopes(256)
    torch.testing.assert_close(slopes, fairseq_alibi.core.alibi.get_slopes(6) / 4)


def test_forward_runs_longer_than_training(data_dir):
    model, _ = build(data_dir)
    model.eval()
    tokens = torch.randint(4, 40, (2, 300))  # > tokens_per_sample=128
    with torch.no_grad():
        logits, _ = model(tokens)
    assert logits.shape == (2, 300, len(model.decoder.dictionary))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--alibi-interpolation", "cubic"], "alibi_interpolation='cubic' is not valid; allowed values: " + ", ".join(METHODS)),
        (["--alibi-interpolation", "linear", "--alibi-scale-factor", "0.5"], "alibi_scale_factor=0.5 is not valid"),
        (["--alibi-attention", "magic"], "alibi_attention='magic' is not valid; allowed values: auto"),
        (["--alibi-train-length", "-4"], "alibi_train_length=-4 is not valid"),
    ],
)
def test_bad_config_fails_at_build(data_dir, flags, message):
    with pytest.raises(ValueError) as err:
        build(data_dir, *flags)
    assert message in str(err.value)


@pytest.mark.parametrize("stock_arch", ["transformer_lm", "transformer_lm_gpt2_tiny"])
def test_twin_has_stock_parameter_count(data_dir, stock_arch):
    """Same architecture, same size as the stock model (positions are sinusoidal
    there, so parameter-free), when the io dims are given explicitly."""
    dims = ["--decoder-input-dim", "48", "--decoder-output-dim", "48"]
    stock, _ = build(data_dir, *dims, arch=stock_arch)
    twin, _ = build(data_dir, *dims, arch=stock_arch + "_alibi")
    assert stock.decoder.embed_positions is not None
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(twin) == count(stock)
    assert twin.decoder.layers[0].normalize_before == stock.decoder.layers[0].normalize_before


def test_builds_from_argparse_namespace(data_dir):
    """Without the hydra conversion the train length default is an unresolved
    "${task.tokens_per_sample}" string; the model takes tokens_per_sample."""
    argv = [str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_alibi",
            "--tokens-per-sample", "96", "--decoder-layers", "1", "--decoder-embed-dim", "32",
            "--decoder-attention-heads", "4"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = tasks.setup_task(args)
    model = task.build_model(args)
    assert model.decoder.positions.scaling.train_length == 96


def test_fairseq_imports_without_loading_the_metrics_it_never_uses_here():
    """patches.deferred_metric_imports: importing the plugin loads neither
    scikit-learn nor SciPy's statistics, and fairseq's names from them still
    compute what the real functions compute (loading them on first use)."""
    import subprocess
    import sys

    code = (
        "import sys, json, fairseq_alibi.models\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy'))\n"
        "from fairseq.criterions import sentence_prediction as sp\n"
        "from fairseq.tasks import audio_classification as ac\n"
        "import sklearn.metrics, scipy.stats\n"
        "print(json.dumps({'loaded': loaded,\n"
        "  'f1': [sp.f1_score([0, 1, 1, 0], [0, 1, 0, 0]), sklearn.metrics.f1_score([0, 1, 1, 0], [0, 1, 0, 0])],\n"
        "  'mcc': [sp._matthews_corrcoef([0, 1, 1, 0], [0, 1, 0, 0]),\n"
        "          sklearn.metrics.matthews_corrcoef([0, 1, 1, 0], [0, 1, 0, 0])],\n"
        "  'pearson': [float(sp.pearsonr([1, 2, 3], [1, 2, 4])[0]), float(scipy.stats.pearsonr([1, 2, 3], [1, 2, 4])[0])],\n"
        "  'spearman': [float(sp.spearmanr([1, 2, 3], [3, 1, 2])[0]), float(scipy.stats.spearmanr([1, 2, 3], [3, 1, 2])[0])],\n"
        "  'roc_curve_is_real': ac.sklearn_metrics.roc_curve is sklearn.metrics.roc_curve,\n"
        "  'real_modules': [sys.modules['sklearn'].__file__ is not None, sys.modules['scipy'].__file__ is not None]}))\n"
    )
    import json

    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    for name in ("f1", "mcc", "pearson", "spearman"):
        deferred, real = out[name]
        assert deferred == real, (name, deferred, real)
    assert out["f1"][0] == pytest.approx(2 / 3)
    assert out["roc_curve_is_real"] and out["real_modules"] == [True, True]


def test_the_loader_thread_is_stopped_before_the_interpreter_exits():
    """patches.loader_threads_stop_at_exit: a run that stops consuming batches while
    fairseq's loader thread is busy with torch operations exits with status 0, and
    no loader thread is alive when the interpreter finalizes (a daemon killed in a
    torch op aborts the process: "terminate called without an active exception")."""
    import subprocess
    import sys

    code = (
        "import atexit, threading\n"
        "alive = []\n"
        "atexit.register(lambda: print('alive at exit:', sum(type(t).__name__ == 'BackgroundConsumer'\n"
        "                                                  and t.is_alive() for t in threading.enumerate())))\n"
        "import torch, fairseq_alibi.models\n"
        "from fairseq.data import iterators\n"
        "def batches():\n"
        "    while True:\n"
        "        yield torch.randn(64, 64) @ torch.randn(64, 64)  # torch work in the loader thread\n"
        "class Source:\n"
        "    def __len__(self): return 10 ** 6\n"
        "    def __iter__(self): return batches()\n"
        "it = iterators.BufferedIterator(2, Source())\n"
        "print('first batch', tuple(next(it).shape))\n"
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.splitlines()[-2:] == ["first batch (64, 64)", "alive at exit: 0"], result.stdout
