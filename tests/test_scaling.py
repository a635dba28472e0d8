"""The scaling spec (``core/scaling.py``): its values, spellings and meaning."""

import pytest

from fairseq_alibi.core.errors import ScalingError
from fairseq_alibi.core.scaling import DEFAULT_ALPHA, METHOD_SYNTAX, METHOD_TABLE, NO_SCALING, Scaling


def test_factor_of_a_forward_pass():
    assert Scaling("none", 0, 64).factor_at(4096) == 1.0
    assert Scaling("linear", 0, 64).factor_at(32) == 1.0
    assert Scaling("linear", 0, 64).factor_at(512) == 8.0
    assert Scaling("ntk", 3.0, 64).factor_at(512) == 3.0
    assert Scaling("log", 2.0, 64).factor_at(512) == 1.0  # distance methods leave slopes alone
    with pytest.raises(ValueError, match="train_length=None is not valid; dynamic scaling"):
        Scaling("linear", 0).factor_at(512)


# --------------------------------------------------------------------- the scaling spec
@pytest.mark.parametrize("text,method,factor,spelling,label", [
    ("none", "none", 1.0, "none", "none"),
    ("linear", "linear", 0.0, "linear", "linear dynamic"),
    ("linear:dynamic", "linear", 0.0, "linear", "linear dynamic"),
    ("ntk:2", "ntk", 2.0, "ntk:2", "ntk x2"),
    (" NTK : 4.5 ", "ntk", 4.5, "ntk:4.5", "ntk x4.5"),
    ("cap", "cap", 1.0, "cap", "cap x1"),
    ("cap:1", "cap", 1.0, "cap", "cap x1"),
    ("cap:0.5", "cap", 0.5, "cap:0.5", "cap x0.5"),
    ("cap:3", "cap", 3.0, "cap:3", "cap x3"),
    ("log", "log", 1.0, "log", f"log x1 a{DEFAULT_ALPHA['log']:g}"),
    ("log:2", "log", 2.0, "log:2", f"log x2 a{DEFAULT_ALPHA['log']:g}"),
    ("log:1:0.25", "log", 1.0, "log:1:0.25", "log x1 a0.25"),
    (f"log:1:{DEFAULT_ALPHA['log']}", "log", 1.0, "log", f"log x1 a{DEFAULT_ALPHA['log']:g}"),
    ("power", "power", 1.0, "power", f"power x1 a{DEFAULT_ALPHA['power']:g}"),
    ("power:2:0.75", "power", 2.0, "power:2:0.75", "power x2 a0.75"),
    ("capnorm", "capnorm", 1.0, "capnorm", "capnorm x1"),
    ("capnorm:0.5", "capnorm", 0.5, "capnorm:0.5", "capnorm x0.5"),
])
def test_scaling_parse_spelling_label(text, method, factor, spelling, label):
    s = Scaling.parse(text)
    assert (s.method, s.factor, s.spelling, s.label) == (method, factor, spelling, label)
    assert Scaling.parse(s.spelling) == s  # the spelling reads back as the same method


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="cubic"), "method"),
    (dict(method="linear", factor=0.5), "factor"),
    (dict(method="ntk", factor=-1), "factor"),
    (dict(method="cap", factor=-0.5), "factor"),
    (dict(method="linear", factor=float("inf")), "factor"),
    (dict(method="linear", factor=float("nan")), "factor"),
    (dict(method="linear", factor="2"), "factor"),
    (dict(method="linear", factor=True), "factor"),
    (dict(method="linear", factor=2, train_length=0), "train_length"),
    (dict(method="linear", factor=2, train_length=12.0), "train_length"),
    (dict(method="linear", factor=2, train_length=True), "train_length"),
    (dict(method="cap", factor=0.01, train_length=64), "factor"),  # C = 0.64 tokens: no cap a user means
    (dict(method="log", factor=1, alpha=0), "alpha"),
    (dict(method="log", factor=1, alpha=-1), "alpha"),
    (dict(method="log", factor=1, alpha="0.5"), "alpha"),
    (dict(method="ntk", factor=2, alpha=0.5), "alpha"),  # only the tails take alpha
    (dict(method="cap", factor=2, alpha=0.5), "alpha"),
    (dict(method="power", factor=1, alpha=0), "alpha"),
])
def test_scaling_refuses_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ScalingError) as error:
        Scaling(**kwargs)
    assert error.value.field == field and "is not valid;" in str(error.value)


@pytest.mark.parametrize("text", ["none:2", "linear:0.5", "ntk:0", "cap:0", "cap:-1", "cap:dynamic", "linear:x",
                                  "log:1:0", "log:1:x", "log:dynamic", "cap:1:2", "capnorm:dynamic", "ntk:2:1", "tail",
                                  "power:dynamic", "power:1:-1"])
def test_scaling_parse_refuses(text):
    with pytest.raises(ScalingError):
        Scaling.parse(text)


def test_a_cap_below_zero_is_refused_like_a_zero_cap():
    """``--methods cap:0`` is refused (the cap must be positive); ``cap:-1`` must
    not answer that 0 is allowed."""
    for text in ("cap:0", "cap:-1"):
        with pytest.raises(ScalingError, match="the cap must be a positive number of training lengths"):
            Scaling.parse(text)


def test_scaling_needs_the_training_length_where_it_uses_it():
    for spec in (Scaling("linear"), Scaling("ntk", 0), Scaling("cap", 2), Scaling("log"),
                 Scaling("capnorm", 3)):
        assert spec.needs_train_length
        with pytest.raises(ScalingError, match="train_length=None"):
            spec.complete()
        assert spec.with_train_length(64).complete().train_length == 64
    for spec in (NO_SCALING, Scaling("linear", 2), Scaling("ntk", 4)):
        assert not spec.needs_train_length and spec.complete() is spec


def test_scaling_factors_and_caps():
    ntk = Scaling("ntk", 0, 64)
    assert [ntk.factor_at(n) for n in (1, 64, 96, 512)] == [1.0, 1.0, 1.5, 8.0]
    assert Scaling("linear", 3, 64).factor_at(10) == 3.0
    cap = Scaling("cap", 0.5, 64)
    assert cap.factor_at(4096) == 1.0 and cap.distance_limit == 32
    assert Scaling("cap", 0, 100).distance_limit == 100  # 0: the training length itself
    assert Scaling("cap", 2.5, 10).distance_limit == 25
    assert Scaling("cap", 0.1, 10).distance_limit == 1  # one token at least
    assert Scaling("log", 0.5, 64).distance_limit == 32 == Scaling("capnorm", 0.5, 64).distance_limit
    assert Scaling("ntk", 2, 64).distance_limit is None


def test_the_method_table_is_the_one_source_of_the_grammar():
    assert [m.name for m in METHOD_TABLE] == [item.split("[")[0] for item in METHOD_SYNTAX.split(", ")]
    for info in METHOD_TABLE:
        spec = Scaling.parse(info.name, 64)
        assert spec.method == info.name and spec.info is info
        assert spec.needs_train_length == (info.kind != "none" and (spec.dynamic or info.kind in ("distance", "logit")))


def test_a_model_keeps_its_own_training_length_for_distance_methods():
    assert Scaling("cap", 2).for_model(64).train_length == 64
    assert Scaling("ntk", 0, 32).for_model(64).train_length == 32  # dynamic: the user's threshold is kept
    with pytest.raises(ScalingError, match="train_length=32 is not valid; cap counts C in the model's own"):
        Scaling("cap", 2, 32).for_model(64)
    with pytest.raises(ScalingError, match="train_length=None"):
        Scaling("log", 1).for_model(None)
