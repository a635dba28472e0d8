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


@pytest.mark.slow
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
@pytest.mark.fast_cases(1)
def test_bad_config_fails_at_build(data_dir, flags, message):
    with pytest.raises(ValueError) as err:
        build(data_dir, *flags)
    assert message in str(err.value)


@pytest.mark.slow
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


# ------------------------------------------------- the decoder built, not swapped (issue 39)
def swapped_build_model(cls, args, task):
    """How the models were built before issue 39, kept here as the reference:
    stock fairseq's ``TransformerLanguageModel.build_model`` while its module's
    ``TransformerDecoder`` name is ``PositionTransformerDecoder``."""
    from functools import partial

    from fairseq.models import transformer_lm as stock

    from fairseq_alibi import facts
    from fairseq_alibi.models.transformer_lm import PositionTransformerDecoder, _default_io_dims

    _default_io_dims(args)
    facts.resolve_train_length(args, task)
    decoder_class = stock.TransformerDecoder
    stock.TransformerDecoder = partial(PositionTransformerDecoder, position=cls.position)
    try:
        return stock.TransformerLanguageModel.build_model.__func__(cls, args, task)
    finally:
        stock.TransformerDecoder = decoder_class


ADAPTIVE = ["--adaptive-input", "--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20",
            "--adaptive-input-factor", "2", "--adaptive-softmax-factor", "2"]
EMBEDDINGS = {
    "plain": [],
    "tied": ["--share-decoder-input-output-embed"],
    "projections": ["--decoder-input-dim", "24", "--decoder-output-dim", "24"],
    "adaptive-untied": ADAPTIVE,
    "adaptive-tied": ADAPTIVE + ["--tie-adaptive-weights", "--tie-adaptive-proj"],
    "character": ["--character-embeddings", "--character-filters", "[(1, 8), (2, 16)]",
                  "--character-embedding-dim", "8", "--char-embedder-highway-layers", "1"],
    "layers-to-keep": ["--decoder-layers-to-keep", "0,2"],
}


def built_both_ways(data_dir, position, flags, monkeypatch):
    """The same config built the old way and the new way, each from seed 0."""
    from fairseq.models import MODEL_REGISTRY

    from fairseq_alibi import facts

    argv = [str(data_dir), "--task", "language_modeling", "--arch", facts.position_model(position),
            "--tokens-per-sample", "16", "--decoder-layers", "3", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "48", "--decoder-attention-heads", "4", *flags]
    cls = MODEL_REGISTRY[facts.position_model(position)]
    models = {}
    for way in ("swapped", "built"):
        cfg = fairseq_config(argv)
        task = tasks.setup_task(cfg.task)
        with monkeypatch.context() as patch:
            if way == "swapped":
                patch.setattr(cls, "build_model", classmethod(swapped_build_model))
            torch.manual_seed(0)
            models[way] = task.build_model(cfg.model).eval()
    return models["swapped"], models["built"], task


#: Every embedding with ALiBi; the plain and the tied adaptive one with every other position method.
BUILDS = [("alibi", embedding) for embedding in EMBEDDINGS] + [
    (position, embedding) for position in fairseq_alibi.core.positions.POSITIONS if position != "alibi"
    for embedding in ("plain", "adaptive-tied")]


@pytest.mark.parametrize("position,embedding", BUILDS)
@pytest.mark.slow
def test_built_decoder_equals_the_swapped_one(data_dir, position, embedding, monkeypatch):
    """State-dict keys in order, shapes, values, parameter order and the output
    of one batch: identical to the model the class swap built."""
    old, new, _ = built_both_ways(data_dir, position, EMBEDDINGS[embedding], monkeypatch)
    assert type(old.decoder) is type(new.decoder) and type(old.decoder.embed_tokens) is type(new.decoder.embed_tokens)
    assert list(old.state_dict()) == list(new.state_dict())
    for key, value in old.state_dict().items():
        assert value.shape == new.state_dict()[key].shape and value.dtype == new.state_dict()[key].dtype, key
        if not key.endswith("._float_tensor"):  # fairseq's uninitialised one-float buffer: only its dtype counts
            assert torch.equal(value, new.state_dict()[key]), key
    assert [name for name, _ in old.named_parameters()] == [name for name, _ in new.named_parameters()]
    if isinstance(new.decoder.positions, torch.nn.Module):  # learned position parameters: off their init alike
        with torch.no_grad():
            for model in (old, new):
                for parameter in model.decoder.positions.parameters():
                    parameter.add_(torch.linspace(-0.5, 0.5, parameter.numel()).view(parameter.shape))
    tokens = torch.randint(4, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(new(tokens)[0], old(tokens)[0], rtol=0, atol=0)


@pytest.mark.slow
def test_a_checkpoint_of_the_swapped_model_loads_into_the_built_one(data_dir, tmp_path, monkeypatch):
    """A checkpoint written by the old builder (adaptive input, the paper's
    family) loads through fairseq's loader into the new one and scores alike."""
    from fairseq import checkpoint_utils

    old, _, task = built_both_ways(data_dir, "alibi", EMBEDDINGS["adaptive-tied"], monkeypatch)
    with torch.no_grad():
        for parameter in old.parameters():  # away from the seed's init: the loaded weights must be these
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    cfg = fairseq_config([str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_alibi",
                          "--tokens-per-sample", "16", "--decoder-layers", "3", "--decoder-embed-dim", "32",
                          "--decoder-ffn-embed-dim", "48", "--decoder-attention-heads", "4",
                          *EMBEDDINGS["adaptive-tied"]])
    path = tmp_path / "swapped.pt"
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam", "num_updates": 0,
                "lr_scheduler_state": {"best": None}}]
    checkpoint_utils.torch_persistent_save({"cfg": cfg, "model": old.state_dict(), "args": None,
                                            "optimizer_history": history, "extra_state": {}}, str(path))
    (loaded,), _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    assert type(loaded).build_model.__func__ is not swapped_build_model
    tokens = torch.randint(4, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens)[0], old(tokens)[0], rtol=0, atol=0)


@pytest.mark.slow
def test_tied_adaptive_weights_that_cannot_be_shared_are_one_error(data_dir):
    """Stock fairseq asserts these (a bare AssertionError); the built model names them."""
    flags = ADAPTIVE[:-4] + ["--adaptive-input-factor", "2", "--adaptive-softmax-factor", "4", "--tie-adaptive-weights"]
    with pytest.raises(ValueError, match=r"--tie-adaptive-weights .* --adaptive-input-factor 2 != "
                                         r"--adaptive-softmax-factor 4: make them match"):
        build(data_dir, *flags)


def test_old_class_names_are_the_new_classes():
    from fairseq_alibi.models import transformer_lm

    assert transformer_lm.AlibiTransformerLanguageModel is transformer_lm.PositionTransformerLanguageModel
    assert transformer_lm.AlibiLanguageModelConfig is transformer_lm.PositionLanguageModelConfig
