"""Position methods: one registry entry each, the one place that says what a
method is, what it is built from and which context-extension methods apply.

A position method is one of five kinds:

* ``bias``: a ``[H, q, k]`` term added to the attention scores (ALiBi, T5's
  bucketed bias, Kerple, FIRE); its stack object is a ``bias.StackBias``, so
  every kernel of ``kernels.py`` runs it;
* ``rotation``: queries and keys rotated by their positions (RoPE), then
  bias-free causal attention;
* ``none``: no position information at all (NoPE): bias-free causal attention;
* ``gate``: a data-dependent bias, per batch row (FoX's forget gates,
  ``fox.py``): each layer binds its gates to its input, kernels take the
  per-row bias (``StackBias.batched``);
* ``hybrid``: a different object per layer (``StackBias.at_layer``):
  RNoPE-SWA's windowed RoPE and full NoPE layers (``hybrid.py``);
* ``attention``: the method computes each layer's attention itself
  (``StackBias.own_kernel``, called by ``layer.attention``): stick-breaking
  attention, which has no softmax (``stickbreaking.py``), and PaTH, whose
  keys each query sees through its own product of transformations
  (``path.py``).

The logit methods (``logn``, ``logit_scale.py``) and SSMax, which scale a
softmax's logits, apply to every method with a softmax: every one but
stick-breaking (:func:`ssmax_problem`).

Adding a method: its maths in a module of this folder, one :class:`Position`
line in :data:`POSITIONS`; the fairseq side (``models/transformer_lm.py``)
registers a ``transformer_lm_<name>`` model for every entry, with the entry's
``params`` as config fields, and the sweep, the retrieval tool and the KV
cache find it here.  Each param is a ``params.Param`` that declares the values
it takes and whether a trained model may change it: :func:`check_params` runs
before a stack is built, the console scripts check the training flags, model
overrides and the exported model's config are checked against the same
declaration, and the tests try every param of every entry at its limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .alibi import EXTENSIONS
from .bias import AlibiBias, CausalMask, ModuleBias, StackBias
from .errors import ConfigError
from .fire import INIT_THRESHOLD, Fire
from .fox import FOX_EXTENSIONS, GATE_INIT_STD, ForgetGates
from .hybrid import AUTO_NOPE_EVERY, DEFAULT_NOPE_EVERY, RNOPE_EXTENSIONS, HybridPositions
from .kerple import KerpleLog
from .path import PATH_EXTENSIONS, PathPositions
from .stickbreaking import STICKBREAKING_EXTENSIONS, StickBreakingPositions
from .params import LEARNED, SHAPE, Param, Range
from .rotary import BASE_RANGE, DEFAULT_BASE, ROPE_METHODS, RotaryPositions
from .scaling import LOGIT_METHODS, MAX_TOKENS as SCALING_MAX_TOKENS, Scaling, check_applies
from .t5bias import T5Bias


#: The export formats (``Position.exports``): this package's own model, stock BLOOM, stock GPT-NeoX.
CUSTOM, BLOOM, NEOX = "custom", "bloom", "gpt-neox"
#: The exported config's keys of a context extension (``Position.scaling_key``).
ALIBI_SCALING, ROPE_PARAMETERS = "alibi_scaling", "rope_parameters"
#: fairseq's stock ``transformer_lm`` (sinusoidal embeddings added to the tokens'): no entry here;
#: its attention is NoPE's (:data:`STOCK_ATTENTION`), what the export and the recipes compute for it.
SINUSOIDAL, STOCK_ATTENTION = "sinusoidal", "nope"

#: ``build(num_heads, head_dim, params, scaling)`` -> the stack's position object.
Builder = Callable[[int, int, Dict[str, Any], Scaling], StackBias]


@dataclass(frozen=True)
class Position:
    """One position method: its ``name``, its ``kind`` (``bias``, ``rotation``,
    ``none``, ``gate`` or ``hybrid``), the context-extension methods that apply
    to it (``extensions``, ``none`` among them), a one-line ``summary``,
    ``build``, which makes the object one layer stack shares, its ``params``
    (config fields, each with the values it takes: ``params.Param``) and
    ``check``, a constraint between them if any (called with every param in
    range; returns the problem as one sentence naming the params, or None)."""

    name: str
    kind: str
    extensions: Tuple[str, ...]
    summary: str
    build: Builder
    params: Tuple[Param, ...] = ()
    #: A constraint between the params (each already in its range): the problem, or None.
    check: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None
    #: A constraint between the params and the stack's depth (its number of layers): the problem, or None.
    depth_check: Optional[Callable[[Dict[str, Any], int], Optional[str]]] = None
    #: Whether the exported model keeps a KV cache (False: a method whose state a cache of keys
    #: and values does not hold, as FoX's running gate sums; generation then recomputes every step).
    kv_cache: bool = True
    #: The ``alibi-export-hf`` formats that hold the method, ``--format auto``'s choice first
    #: where it holds the model (``custom``: this package's own model, every method;
    #: ``bloom``: stock BLOOM; ``gpt-neox``: stock GPT-NeoX).
    exports: Tuple[str, ...] = (CUSTOM,)
    #: The exported config's key of the context extension: ``alibi_scaling``, or transformers'
    #: ``rope_parameters``, which holds the RoPE params too (``rotary_base``, ``rotary_fraction``).
    scaling_key: str = ALIBI_SCALING
    #: The line colour of the method in every plot (None: one chosen by ``evaluation.styles``).
    colour: Optional[str] = None


def _alibi(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return AlibiBias(num_heads, "causal", scaling)


def _rotary(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return RotaryPositions(num_heads, head_dim, params["rotary_base"], params["rotary_fraction"], scaling,
                           params["rotary_alibi_heads"])


def _t5bias(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return ModuleBias(T5Bias(num_heads, params["t5_buckets"], params["t5_max_distance"], params["t5_init_slopes"]),
                      num_heads, toeplitz=True)


def _nope(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return CausalMask(num_heads)


def _kerple(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return ModuleBias(KerpleLog(num_heads), num_heads, toeplitz=True)


def _fire(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    threshold = params["fire_threshold"] or scaling.train_length or INIT_THRESHOLD
    return ModuleBias(Fire(num_heads, params["fire_hidden"], init_threshold=threshold), num_heads, toeplitz=False)


def _t5_distance(params: Dict[str, Any]) -> Optional[str]:
    exact = params["t5_buckets"] // 2
    if params["t5_max_distance"] <= exact:
        return (f"t5_max_distance={params['t5_max_distance']!r} is not valid with t5_buckets={params['t5_buckets']!r}; "
                f"it must be > {exact} (the exact buckets, half of t5_buckets)")
    return None


def _fox(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return ForgetGates(num_heads, num_heads * head_dim, scaling, params["fox_init_slopes"],
                       bool(params["fox_data_dependent"]), params["fox_gate_init_std"], params["fox_weight_delay"])


def _fox_gate_init(params: Dict[str, Any]) -> Optional[str]:
    if not params["fox_data_dependent"] and params["fox_gate_init_std"] != GATE_INIT_STD:
        return (f"fox_gate_init_std={params['fox_gate_init_std']!r} sets the gate weights' initial spread, but "
                "fox_data_dependent=0 fixes them at 0; leave one of the two out")
    if not params["fox_data_dependent"] and params["fox_weight_delay"]:
        return (f"fox_weight_delay={params['fox_weight_delay']!r} delays the training of the gate weights, but "
                "fox_data_dependent=0 never trains them; leave one of the two out")
    return None


def _rnope(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    window = params["rnope_window"]
    if not window:
        if not scaling.train_length:
            raise ConfigError("rnope_window=0 means half the training length, which is not known here: give "
                              "--rnope-window N or the training length (alibi_train_length)")
        window = max(1, scaling.train_length // 2)
    return HybridPositions(num_heads, head_dim, int(window), params["rnope_nope_every"], params["rotary_base"],
                           scaling)


def _rnope_depth(params: Dict[str, Any], layers: int) -> Optional[str]:
    """A stack that is not a hybrid: no NoPE layer (windowed RoPE alone) or no RoPE layer (NoPE)."""
    every = params["rnope_nope_every"]
    if layers < 2:
        return (f"rnope needs at least 2 layers (windowed RoPE layers and a NoPE layer); this model has {layers}: "
                "give it 2 or more layers (fairseq's --decoder-layers), or use the rotary or nope method")
    if every > layers:
        return (f"rnope_nope_every={every} with {layers} layers leaves no NoPE layer (they are layers {every}, "
                f"{2 * every}, ...): the model would be windowed RoPE alone; give --rnope-nope-every between 2 and "
                f"{layers}, or 0 (the default: {DEFAULT_NOPE_EVERY}, or the number of layers where fewer)")
    return None


def _stickbreaking(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return StickBreakingPositions(num_heads, head_dim, scaling)


def _path(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return PathPositions(num_heads, head_dim, num_heads * head_dim, bool(params["path_short_conv"]),
                         int(params["path_forget_gate"]), scaling)


#: The largest training length, threshold or distance a parameter takes, in tokens (fairseq's int32 lengths):
#: the scaling spec's own bound (a factor times the training length is at most it).
MAX_TOKENS = SCALING_MAX_TOKENS

#: The extension methods of a position method without its own: as trained,
#: or a logit method (``logn``), which applies to every position method.
PLAIN = ("none",) + LOGIT_METHODS

#: Every position method, in the order tables list them.
POSITIONS: Dict[str, Position] = {p.name: p for p in (
    Position("alibi", "bias", EXTENSIONS + LOGIT_METHODS, "-m_h (i - j): a fixed slope per head (Press et al. 2022)",
             _alibi, exports=(CUSTOM, BLOOM), colour="#d62728"),
    Position("rotary", "rotation", ROPE_METHODS + LOGIT_METHODS,
             "queries and keys rotated by position (RoPE, Su et al. 2021)", _rotary,
             (Param("rotary_base", DEFAULT_BASE, "RoPE's base, frequencies base^(-2i/d)", BASE_RANGE),
              Param("rotary_fraction", 1.0, "the fraction of each head's dimensions rotated",
                    Range(float, 0.0, 1.0, open_low=True),
                    note="partial rotary: rounded down to an even number of dimensions, so a "
                         "15-dimension head rotates 14; the rest carry no position"),
              Param("rotary_alibi_heads", 0, "how many heads, steepest first, also get ALiBi's bias (a diagnostic: "
                    "RoPE with built-in recency heads)", Range(int, 0, 4096), SHAPE,
                    note="n: the first n heads get the n steepest of ALiBi's slopes for the model's heads (at most "
                         "the number of heads); a model with it cannot be exported")),
             exports=(NEOX, CUSTOM), scaling_key=ROPE_PARAMETERS, colour="#1f77b4"),
    Position("t5bias", "bias", PLAIN, "a learned scalar per (log-bucketed distance, head), one table for every "
             "layer (T5, Raffel et al. 2020)", _t5bias,
             (Param("t5_buckets", 32, "the number of T5 bias buckets, half exact distances and half logarithmic",
                    Range(int, 2, 4096), SHAPE),
              Param("t5_max_distance", 128, "the distance from which every key shares the last bucket",
                    Range(int, 2, MAX_TOKENS)),
              Param("t5_init_slopes", 0.0, "start the table at ALiBi's bias times this k: each bucket at -k m_h d, "
                    "d its nearest distance (T5's table with ALiBi's recency from step 0; it learns the retrieval "
                    "task that T5 from zeros does not, docs/retrieval.md)",
                    Range(float, 0.0, 64.0, open_low=True, special=((0, "zeros, no position preference"),)),
                    LEARNED)), _t5_distance, colour="#2ca02c"),
    Position("nope", "none", PLAIN, "no position information: the causal mask alone (Haviv et al. 2022)",
             _nope, colour="#9467bd"),
    Position("kerple", "bias", PLAIN, "-r1 log(1 + r2 (i - j)), r1 and r2 learned per head (Kerple's log "
             "variant, Chi et al. 2022)", _kerple, colour="#ff7f0e"),
    Position("fire", "bias", PLAIN, "a learned MLP of log-distance normalized by the query position (FIRE, "
             "Li et al. 2023)", _fire,
             (Param("fire_hidden", 32, "the width of FIRE's MLP, in hidden units", Range(int, 1, 4096), SHAPE),
              Param("fire_threshold", 0.0, "FIRE's initial threshold L, in tokens, learned in training",
                    Range(float, 1.0, MAX_TOKENS, special=((0, "the training length"),)), LEARNED)),
             colour="#8c564b"),
    Position("fox", "gate", FOX_EXTENSIONS, "c_i - c_j, c the running sum of log forget gates sigmoid(w . x_t + "
             "b) per head and layer (the Forgetting Transformer, Lin et al. 2025)", _fox,
             (Param("fox_init_slopes", 0.0, "start each head's forget gate at exp(-k m_h), ALiBi's slope m_h "
                    "times this k, through the gate's bias", Range(float, 0.0, 64.0, open_low=True, special=(
                        (0, "the authors' zero gate bias, gates near 0.5"),)), LEARNED),
              Param("fox_data_dependent", 1, "whether each forget gate reads its token (1: sigmoid(w . x_t + b), "
                    "the paper's) or is a learned constant per head (0: w fixed at 0, the paper's data-independent "
                    "ablation: ALiBi with learned slopes)", Range(int, 0, 1), SHAPE),
              Param("fox_gate_init_std", GATE_INIT_STD, "the standard deviation of the gate weights w at "
                    "initialization (normal, mean 0)", Range(float, 0.0, 1.0), LEARNED,
                    note="0: the weights start at 0 and are trained (the gates start the same for every token)"),
              Param("fox_weight_delay", 0, "the number of training updates during which the gate weights w keep "
                    "their initial values (no gradient): the gates read their token only after it",
                    Range(int, 0, MAX_TOKENS), LEARNED,
                    note="with fox_gate_init_std 0: data-independent gates (ALiBi with learned slopes) until "
                         "then, FoX after; counted by fairseq's trainer only (an exported model holds nothing)")),
             _fox_gate_init, kv_cache=False, colour="#e377c2"),
    Position("rnope", "hybrid", RNOPE_EXTENSIONS, "RoPE layers with a sliding window, every few layers a NoPE "
             "layer with full attention (RNoPE-SWA, Yang et al. 2025)", _rnope,
             (Param("rotary_base", DEFAULT_BASE, "RoPE's base in the RoPE layers", BASE_RANGE),
              Param("rnope_window", 0, "the RoPE layers' sliding window, in keys",
                    Range(int, 1, MAX_TOKENS, special=((0, "half the training length"),))),
              Param("rnope_nope_every", AUTO_NOPE_EVERY, "every how many layers one is a NoPE layer with full "
                    "attention (the last of each group)",
                    Range(int, 2, 4096, special=((AUTO_NOPE_EVERY, f"{DEFAULT_NOPE_EVERY}, or the number of layers "
                                                  "where fewer"),)))), depth_check=_rnope_depth, colour="#bcbd22"),
    Position("stickbreaking", "attention", STICKBREAKING_EXTENSIONS, "no softmax and no positions: query i gives "
             "key j sigmoid(z_ij) of what the nearer keys left, the rest to a learned vector per head "
             "(stick-breaking attention, Tan et al. 2025)", _stickbreaking, colour="#17becf"),
    Position("path", "attention", PATH_EXTENSIONS, "key j seen from query i through H_i ... H_{j+1}, H_t = I - "
             "beta_t w_t w_t^T from each token's input (PaTH attention, Yang et al. 2025)", _path,
             (Param("path_short_conv", 1, "whether w passes the authors' short causal convolution (width 3, SiLU) "
                    "after its low-rank projection (1) or not (0)", Range(int, 0, 1), SHAPE),
              Param("path_forget_gate", 0, "whether FoX's forget gate is added on top (PaTH-FoX: c_i - c_j per head "
                    "and layer, c the running sum of log forget gates; 1: added to the scaled scores as FoX adds "
                    "it; 2: divided by sqrt(head dim) first, as the authors' kernel has it; 0: PaTH alone)",
                    Range(int, 0, 2), SHAPE)),
             # no KV cache in the export: each new token changes every cached key (H_t) and the cache carries
             # the convolution's and the gate's state, which transformers' cache of appended keys does not hold
             kv_cache=False, colour="#393b79"),
)}


def ssmax_problem(name: str, ssmax: bool) -> Optional[str]:
    """Why SSMax (``--ssmax``) cannot be trained with position method ``name``, or
    None: SSMax scales a softmax's logits as the logit methods do (``logn``), so it
    applies where they do (the entry's ``extensions``): every method but one without a
    softmax (stick-breaking)."""
    if not ssmax or set(LOGIT_METHODS) <= set(extensions(name)):
        return None
    return (f"ssmax=True is not valid with position method {name}: SSMax scales the logits of a softmax, which "
            f"{name} attention has not (nor does logn apply to it); train without --ssmax")


def params_of(names=None):
    """``(position name, Param)`` of every parameter of the registered methods
    (of ``names`` only, if given), in registry order."""
    return [(entry.name, param) for entry in POSITIONS.values() if names is None or entry.name in names
            for param in entry.params]


def params_problem(name: str, params: Dict[str, Any], layers: Optional[int] = None) -> Optional[str]:
    """The first problem of ``params`` (a value for each param of method
    ``name``), as one sentence naming the param, or None."""
    entry = position(name)
    for param in entry.params:
        problem = param.problem(params[param.name])
        if problem:
            return f"{param.name}={params[param.name]!r} is not valid; it {problem}"
    problem = entry.check(params) if entry.check else None
    if problem is None and layers is not None and entry.depth_check:
        problem = entry.depth_check(params, layers)
    return problem


def check_params(name: str, params: Dict[str, Any], layers: Optional[int] = None) -> Dict[str, Any]:
    """``params`` if :func:`params_problem` finds none, else its ``ConfigError``."""
    problem = params_problem(name, params, layers)
    if problem:
        raise ConfigError(problem)
    return params


def position(name: str) -> Position:
    """The registry entry of ``name`` (``ConfigError`` naming the allowed ones)."""
    if name not in POSITIONS:
        raise ConfigError(f"position method {name!r} is not valid; allowed values: {', '.join(POSITIONS)}")
    return POSITIONS[name]


def attention_entry(name: str) -> Position:
    """The entry whose attention a model of ``name`` computes: its own, or NoPE's for
    fairseq's stock sinusoidal model (its positions are added to the embedding)."""
    return position(STOCK_ATTENTION if name == SINUSOIDAL else name)


def exported_methods() -> Tuple[str, ...]:
    """The ``position_method`` values an exported model takes: every entry, and ``sinusoidal``."""
    return (*POSITIONS, SINUSOIDAL)


def holding(fmt: str) -> Tuple[str, ...]:
    """The methods whose entries export to format ``fmt`` (``Position.exports``)."""
    return tuple(name for name, entry in POSITIONS.items() if fmt in entry.exports)


#: What :func:`on_register` was given: each is called with every entry, present and later.
_LISTENERS: List[Callable[[Position], None]] = []


def register(entry: Position) -> Position:
    """Add ``entry`` to :data:`POSITIONS` at run time (a method whose module lives outside
    this folder: a plugin's, a test's), and hand it to every :func:`on_register` listener
    (the fairseq side registers its ``transformer_lm_<name>`` model so).  A name already
    registered, or ``sinusoidal``, is refused (``ConfigError``)."""
    if entry.name in POSITIONS or entry.name == SINUSOIDAL:
        raise ConfigError(f"position method {entry.name!r} is registered already; give the new method another name")
    POSITIONS[entry.name] = entry
    for listener in _LISTENERS:
        listener(entry)
    return entry


def on_register(listener: Callable[[Position], None]) -> None:
    """Call ``listener(entry)`` for every entry of :data:`POSITIONS` now, in order, and for
    each one :func:`register` adds later."""
    _LISTENERS.append(listener)
    for entry in list(POSITIONS.values()):
        listener(entry)


def load_module(path: str):
    """Import the file ``path``, a method's module kept outside this folder (a plugin's, a
    test's: its maths and its ``register(Position(...))`` call), as a module of this folder,
    ``<this package>.<its file's stem>``: its imports of the core are relative (``from .bias
    import ModuleBias``) and find the core here as in an exported model's directory, where the
    export copies the module beside the core files (``export/writer.py``).  A file loaded
    already is the module returned; a stem that is a core module's name, or one loaded from
    another file, is refused (``ConfigError``)."""
    import importlib.util
    import os
    import sys

    stem, suffix = os.path.splitext(os.path.basename(path))
    if suffix != ".py" or not stem.isidentifier():
        raise ConfigError(f"{path} is not a method's module: give a Python file NAME.py, NAME an identifier")
    name = f"{__package__}.{stem}"
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "")) == os.path.realpath(path):
        return loaded
    core = os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), stem + ".py"))
    if core or loaded is not None:
        what = "a core module's name" if core else f"that of {getattr(loaded, '__file__', name)}, loaded already"
        raise ConfigError(f"a method's module cannot be named {stem}.py, {what}: rename {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"method module {path} not found")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def extensions(name: Optional[str]) -> Tuple[str, ...]:
    """The extension methods of position method ``name``; ``none`` alone for a
    model whose positions nothing here changes (the stock sinusoidal model:
    ``None`` or a name outside the registry)."""
    return POSITIONS[name].extensions if name in POSITIONS else ("none",)


def check_extension(name: str, scaling: Scaling) -> Scaling:
    """``scaling`` if its method applies to position method ``name``, else a
    ``ScalingError`` naming the methods that do."""
    return check_applies(scaling, name, position(name).extensions)


def build(name: str, num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling,
          layers: Optional[int] = None) -> StackBias:
    """The position object of one layer stack of position method ``name``."""
    entry = position(name)
    scaling = check_extension(name, scaling)
    built = entry.build(num_heads, head_dim, check_params(name, params, layers), scaling)
    if layers is not None:
        built.fit_depth(layers)  # settled for the stack's depth (a hybrid's interleaving), checked above
    if built.scaling != scaling:  # a builder that does not take the spec (a logit method applies to every method)
        built.rescale(scaling)
    return built
