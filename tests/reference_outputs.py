"""Reference outputs of every position method (issue 78): what the numbers
were before the kernels and the layer wiring were reorganized.

For each variant of :data:`VARIANTS` (every method of ``core.positions``,
SSMax and the logit method ``logn`` on some, dynamic and ``capnorm`` scaling
of ALiBi), a tiny fairseq LM with fixed random weights (2 layers, d=32, 4
heads, trained length :data:`L`) is run on fixed inputs:

* ``train``: log-probs and gradients (every parameter's, as two float64
  numbers: its projection on a fixed random tensor and its norm) of a full
  batch and of a right-padded one, on every kernel the method runs with
  gradients on the CPU, float32 and bfloat16;
* ``eval``: log-probs of a right-padded and a left-padded batch, on every
  kernel that runs (``flex``, compiled on the CPU, for plain ALiBi in float32
  only: its CPU compilation of dynamic scaling fails in torch 2.13);
* ``cache``: log-probs of incremental decoding, one token at a time with
  fairseq's KV cache (``incremental_state``), from an unpadded batch and a
  left-padded one;
* ``hf``: the exported Hugging Face model of the same weights
  (``export.custom.build_custom``): a left-padded batch, and its KV cache
  where the method has one;
* ``sweep``: a 16x-L sweep (L .. 16 L tokens, one row) with ``auto`` and
  ``chunked``, and the gradients of a 16 L training call (``blocked``,
  several blocks, key windows);
* ``encoder``: the bidirectional layer (ALiBi ``symmetric``, ``split``,
  ``learned``) with padding, on every kernel, with gradients, and a long
  inference call (the chunked kernel's two-sided windows).

Log-probs are those of the next token at every real position (0 at padding).
Everything runs single-threaded (the order of sums of a threaded reduction
may depend on the thread count).  ``python tests/reference_outputs.py``
writes ``tests/data/reference_outputs.pt``; ``tests/test_reference_outputs.py``
recomputes and compares.  A new method: a line in :data:`VARIANTS`, then
``python tests/reference_outputs.py --only NAME`` adds its outputs and keeps
every other stored bit.  A kernel change that moves a variant's numbers:
``--float64 NAME`` first (:func:`float64_check`: how far the new outputs,
the eager path's and the stored ones lie from float64), then ``--only NAME``.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import zlib
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

DATA = TESTS / "data" / "reference_outputs.pt"
L = 32
DIM, HEADS, WORDS = 32, 4, 40
COMMON = ["--decoder-layers", "2", "--decoder-embed-dim", str(DIM), "--decoder-attention-heads", str(HEADS),
          "--decoder-ffn-embed-dim", "48", "--dropout", "0", "--attention-dropout", "0",
          "--decoder-normalize-before", "--share-decoder-input-output-embed"]
#: name -> (fairseq flags, context extension spelling applied after the build or None).
VARIANTS: Dict[str, Tuple[List[str], Optional[str]]] = {
    "alibi": (["--arch", "transformer_lm_alibi"], None),
    "alibi-ssmax": (["--arch", "transformer_lm_alibi", "--ssmax"], None),
    "alibi-logn": (["--arch", "transformer_lm_alibi"], "logn"),
    "alibi-dynamic": (["--arch", "transformer_lm_alibi"], "linear:dynamic"),
    "alibi-capnorm": (["--arch", "transformer_lm_alibi"], "capnorm:0.5"),
    "rotary": (["--arch", "transformer_lm_rotary", "--rotary-fraction", "0.5", "--rotary-base", "500"], None),
    "rotary-logn": (["--arch", "transformer_lm_rotary"], "logn"),
    "t5bias": (["--arch", "transformer_lm_t5bias", "--t5-buckets", "8", "--t5-max-distance", "24",
                "--t5-init-slopes", "1"], None),
    "nope": (["--arch", "transformer_lm_nope"], None),
    "kerple": (["--arch", "transformer_lm_kerple"], None),
    "fire": (["--arch", "transformer_lm_fire", "--fire-hidden", "8"], None),
    "fox": (["--arch", "transformer_lm_fox", "--fox-init-slopes", "1"], None),
    "fox-ssmax": (["--arch", "transformer_lm_fox", "--ssmax"], None),
    "rnope": (["--arch", "transformer_lm_rnope", "--rnope-window", "6"], None),
    "stickbreaking": (["--arch", "transformer_lm_stickbreaking"], None),
    "path-fox-logn": (["--arch", "transformer_lm_path", "--path-forget-gate", "1"], "logn"),
}
#: ``auto`` first: what ``choose_kernel`` picks is recorded too (``choices``).
KERNEL_LIST = ("auto", "reference", "sdpa", "chunked", "blocked", "flex")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENCODER_MODES = ("symmetric", "split", "learned")


def fingerprint() -> str:
    """What makes float results bit-identical: torch, the CPU's vector unit, the machine."""
    return f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{platform.machine()}"


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: The kernels a case ran, as a bit mask over these names (``kernels.KERNELS``' registry).
KERNEL_BITS = ("reference", "sdpa", "flex", "chunked", "blocked")
_USED: List[str] = []


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Every kernel ``kernels.choose_kernel`` picks noted in ``_USED``."""
    from fairseq_alibi.core import kernels

    choose = kernels.choose_kernel

    def noted(*args, **kwargs):
        chosen = choose(*args, **kwargs)
        _USED.append(chosen)
        return chosen

    kernels.choose_kernel = noted
    try:
        yield
    finally:
        kernels.choose_kernel = choose


def used() -> torch.Tensor:
    """The bit mask of the kernels run since the last call (:data:`KERNEL_BITS`)."""
    mask = sum(1 << i for i, name in enumerate(KERNEL_BITS) if name in _USED)
    _USED.clear()
    return torch.tensor(mask)


def _dictionary():
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(WORDS):
        dictionary.add_symbol(f"w{i}")
    dictionary.pad_to_multiple_(8)
    return dictionary


def build(variant: str):
    """The fairseq LM of ``variant`` in eval mode, float32, its fixed random weights."""
    import fairseq_alibi.models  # noqa: F401  (registers the models)
    from conftest import fairseq_config
    from fairseq.tasks.language_modeling import LanguageModelingTask

    from fairseq_alibi.core.scaling import Scaling
    from fairseq_alibi.models import attention

    flags, spelling = VARIANTS[variant]
    cfg = fairseq_config(["/nonexistent", "--task", "language_modeling", "--tokens-per-sample", str(L),
                          "--alibi-train-length", str(L), "--cpu", *COMMON, *flags])
    dictionary = _dictionary()
    torch.manual_seed(0)
    model = LanguageModelingTask(cfg.task, dictionary).build_model(cfg.model)
    generator = torch.Generator().manual_seed(zlib.crc32(variant.encode()))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.4
            parameter.copy_(1 + noise / 4 if "norm" in name else noise)
    if spelling:
        attention.rescale(model, Scaling.parse(spelling, L))
    return model.eval(), cfg, dictionary


def attention_layers(model):
    from fairseq_alibi.models.attention import PositionMultiheadAttention

    return [m for m in model.modules() if isinstance(m, PositionMultiheadAttention)]


def set_kernel(model, kernel: str) -> bool:
    """Every attention layer of ``model`` on ``kernel``; False where the method refuses it."""
    from fairseq_alibi.core import kernels
    from fairseq_alibi.core.errors import ConfigError

    layers = attention_layers(model)
    try:
        chosen = [kernels.check_kernel(kernel, m.positions, m.dropout_module.p) for m in layers]
    except ConfigError:
        return False
    for m, name in zip(layers, chosen):
        m.kernel = name
    return True


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(4, 4 + WORDS, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 2
    return ids


def padded(ids: torch.Tensor, lengths: List[int], pad: int, left: bool) -> torch.Tensor:
    out = ids.clone()
    for row, n in enumerate(lengths):
        if left:
            out[row] = torch.cat([torch.full((ids.size(1) - n,), pad), ids[row, :n]])
        else:
            out[row, n:] = pad
    return out


def next_token_log_probs(log_probs: torch.Tensor, ids: torch.Tensor, pad: int) -> torch.Tensor:
    """float32 ``[B, T - 1]``: the log-prob of each next token, 0 where it or its position is padding."""
    picked = log_probs[:, :-1].float().gather(-1, ids[:, 1:, None])[..., 0]
    real = ids[:, 1:].ne(pad) & ids[:, :-1].ne(pad)
    return picked.masked_fill(~real, 0.0)


def gradient_summary(named) -> torch.Tensor:
    """float64 ``[P, 2]``: per parameter with a gradient, its projection on a fixed random tensor and its norm."""
    rows = []
    for name, parameter in named:
        if parameter.grad is None:
            continue
        grad = parameter.grad.double()
        direction = torch.randn(grad.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())),
                                dtype=torch.float64)
        rows.append(torch.stack([(grad * direction).sum(), grad.norm()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _fairseq_log_probs(model, ids) -> torch.Tensor:
    return model.get_normalized_probs(model(ids), log_probs=True)


def _train_case(model, ids, pad) -> Dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        picked = next_token_log_probs(_fairseq_log_probs(model, ids), ids, pad)
        (-picked.sum()).backward()
    out = {"log_probs": picked.detach(), "grads": gradient_summary(model.named_parameters()), "kernels": used()}
    model.zero_grad(set_to_none=True)
    return out


def _cache_case(model, ids, pad) -> torch.Tensor:
    state: Dict = {}
    steps = []
    with torch.no_grad():
        for t in range(ids.size(1)):
            out = model.decoder(ids[:, : t + 1], incremental_state=state)
            steps.append(model.get_normalized_probs(out, log_probs=True)[:, -1:])
    return next_token_log_probs(torch.cat(steps, dim=1), ids, pad)


def _hf_model(model, cfg, dictionary, variant):
    from fairseq_alibi.export.custom import build_custom
    from fairseq_alibi.export.source import Source
    from fairseq_alibi.models.config import scaling_from_config
    from fairseq_alibi.models.transformer_lm import PositionTransformerLanguageModel  # noqa: F401

    scaling = attention_layers(model)[0].positions.stack.scaling
    position = type(model).position
    source = Source("reference", model, cfg, dictionary, L, scaling_from_config(cfg.model), position=position)
    return build_custom(source, scaling).eval()


def _hf_cases(model, cfg, dictionary, variant, dtype_name, ids, pad) -> Dict[str, torch.Tensor]:
    from fairseq_alibi.core import kernels
    from fairseq_alibi.core.errors import ConfigError, InputError

    found = {}
    hf = _hf_model(model, cfg, dictionary, variant).to(DTYPES[dtype_name])
    mask = ids.ne(pad).long()
    for kernel in KERNEL_LIST[:5]:
        attentions = [layer.self_attn for layer in hf.model.layers]
        try:
            names = [kernels.check_kernel(kernel, a.positions, a.dropout) for a in attentions]
        except ConfigError:
            continue
        for a, name in zip(attentions, names):
            a.kernel = name
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        found[f"hf/{dtype_name}/{kernel}/left"] = next_token_log_probs(logits.float().log_softmax(-1), ids, pad)
        found[f"hf/{dtype_name}/{kernel}/left/kernels"] = used()
        steps, past = [], None
        try:
            with torch.no_grad():
                for t in range(ids.size(1)):
                    out = hf(input_ids=ids[:, t: t + 1], attention_mask=mask[:, : t + 1], past_key_values=past,
                             use_cache=True)
                    past = out.past_key_values
                    steps.append(out.logits.float().log_softmax(-1))
        except InputError:  # no KV cache for this method in the export
            used()
            continue
        found[f"hf/{dtype_name}/{kernel}/cache"] = next_token_log_probs(torch.cat(steps, dim=1), ids, pad)
        found[f"hf/{dtype_name}/{kernel}/cache/kernels"] = used()
    return found


def _sweep(model) -> Dict[str, torch.Tensor]:
    found = {}
    ids = tokens(1, 16 * L, seed=7)
    for kernel in ("auto", "chunked"):
        if not set_kernel(model, kernel):
            continue
        for factor in (1, 2, 4, 8, 16):
            with torch.no_grad():
                lp = _fairseq_log_probs(model, ids[:, : factor * L])
            found[f"sweep/{kernel}/{factor}"] = next_token_log_probs(lp, ids[:, : factor * L], -1)
            found[f"sweep/{kernel}/{factor}/kernels"] = used()
    set_kernel(model, "auto")
    train = _train_case(model, ids, -1)
    found.update({f"sweep/train/{key}": value for key, value in train.items()})
    return found


def compute_variant(variant: str, dtypes: Optional[Dict[str, torch.dtype]] = None,
                    sweep_dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Every reference output of ``variant``, by key (``dtypes``: the names of :data:`DTYPES` and what each
    computes in, and ``sweep_dtype`` the sweep's: other than the stored ones only for :func:`float64_check`)."""
    from fairseq_alibi.core.errors import KernelUnsupportedError

    found: Dict[str, torch.Tensor] = {}
    with single_thread(), recording():
        model, cfg, dictionary = build(variant)
        pad = dictionary.pad()
        full = tokens(2, 40, seed=1)
        right = padded(tokens(3, 40, seed=2), [40, 33, 25], pad, left=False)
        left = padded(tokens(3, 24, seed=3), [24, 17, 9], pad, left=True)
        for dtype_name, dtype in (dtypes or DTYPES).items():
            model.to(dtype)
            for kernel in KERNEL_LIST:
                if (kernel == "flex" and variant != "alibi") or not set_kernel(model, kernel):
                    continue
                if kernel != "flex":  # flex has no CPU backward
                    for name, ids in (("full", full), ("right", right)):
                        for key, value in _train_case(model, ids, pad).items():
                            found[f"train/{dtype_name}/{kernel}/{name}/{key}"] = value
                if kernel == "flex" and dtype_name != "float32":
                    continue
                for name, ids in (("right", right), ("left", left)):
                    try:
                        with torch.no_grad():
                            lp = _fairseq_log_probs(model, ids)
                    except KernelUnsupportedError:
                        used()
                        continue
                    found[f"eval/{dtype_name}/{kernel}/{name}"] = next_token_log_probs(lp, ids, pad)
                    found[f"eval/{dtype_name}/{kernel}/{name}/kernels"] = used()
                if kernel == "flex":
                    continue
                for name, ids in (("full", full[:, :24]), ("left", left)):
                    found[f"cache/{dtype_name}/{kernel}/{name}"] = _cache_case(model, ids, pad)
                    found[f"cache/{dtype_name}/{kernel}/{name}/kernels"] = used()
            set_kernel(model, "auto")
            model.float()
            found.update(_hf_cases(model, cfg, dictionary, variant, dtype_name, left, pad))
        model.to(sweep_dtype)
        found.update(_sweep(model))
    return found


def float64_check(variant: str) -> Dict[str, Dict[str, float]]:
    """How far ``variant``'s float32 outputs (training, evaluation, cache, sweep) lie from the same model's in
    float64, per group of keys: ``{group: {"fused": , "eager": , "stored": }}``, each the largest over the
    group's keys of ``max |x - exact| / max |exact|``; "fused" is this code with the fused CPU calls
    (``core/native.py``) where they run, "eager" with them switched off, "stored" the saved reference outputs.
    Run it before regenerating a variant whose numbers a kernel change moved: the new numbers should be as
    close to float64 as the eager path's and the stored ones."""
    import os

    from fairseq_alibi.core import native

    def computed(switch: str, dtypes, sweep_dtype) -> Dict[str, torch.Tensor]:
        before = os.environ.get(native.SWITCH)
        os.environ[native.SWITCH] = switch
        try:
            return compute_variant(variant, dtypes, sweep_dtype)
        finally:
            if before is None:
                os.environ.pop(native.SWITCH)
            else:
                os.environ[native.SWITCH] = before

    exact = computed("0", {"float32": torch.float64, "bfloat16": torch.bfloat16}, torch.float64)
    tables = {"fused": computed("1", None, torch.float32), "eager": computed("0", None, torch.float32)}
    stored = torch.load(DATA, weights_only=True)["outputs"]
    tables["stored"] = {k[len(variant) + 1:]: v for k, v in stored.items() if k.startswith(variant + "/")}
    groups: Dict[str, Dict[str, float]] = {}
    for key, want in exact.items():
        if key.endswith("/kernels") or not key.startswith(("train/float32/", "eval/float32/", "cache/float32/",
                                                           "sweep/")):
            continue
        group = "/".join(key.split("/")[:3]) if not key.startswith("sweep/") else "/".join(key.split("/")[:2])
        scale = float(want.double().abs().max()) or 1.0
        for name, table in tables.items():
            if key in table and table[key].shape == want.shape:
                error = float((table[key].double() - want.double()).abs().max()) / scale
                row = groups.setdefault(group, {})
                row[name] = max(row.get(name, 0.0), error)
    return groups


def compute_encoder(mode: str) -> Dict[str, torch.Tensor]:
    """The bidirectional ALiBi layer in ``mode``: every kernel, padding, gradients; a long call."""
    from fairseq_alibi.core.bias import AlibiBias
    from fairseq_alibi.models.attention import PositionMultiheadAttention

    found: Dict[str, torch.Tensor] = {}
    with single_thread(), recording():
        for dtype_name, dtype in DTYPES.items():
            for kernel in KERNEL_LIST[:5]:
                torch.manual_seed(3)
                layer = PositionMultiheadAttention(DIM, HEADS, AlibiBias(HEADS, mode), kernel=kernel).to(dtype)
                x = torch.randn(40, 3, DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
                pad = torch.zeros(3, 40, dtype=torch.bool)
                pad[1, 33:] = True
                pad[2, 25:] = True
                x.requires_grad_(True)
                out, _ = layer(x, x, x, key_padding_mask=pad, need_weights=False)
                real = (~pad).T[..., None]
                (out.float() * real).sum().backward()
                found[f"encoder/{mode}/{dtype_name}/{kernel}/out"] = (out.detach().float() * real)
                found[f"encoder/{mode}/{dtype_name}/{kernel}/grads"] = gradient_summary(
                    [("x", x)] + list(layer.named_parameters()))
                found[f"encoder/{mode}/{dtype_name}/{kernel}/kernels"] = used()
        torch.manual_seed(3)
        layer = PositionMultiheadAttention(DIM, HEADS, AlibiBias(HEADS, mode)).eval()
        x = torch.randn(600, 1, DIM, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            found[f"encoder/{mode}/long"] = layer(x, x, x, need_weights=False)[0]
        found[f"encoder/{mode}/long/kernels"] = used()
    return found


def compute_all(progress: Callable[[str], None] = lambda _: None) -> Dict[str, torch.Tensor]:
    found: Dict[str, torch.Tensor] = {}
    for variant in VARIANTS:
        progress(variant)
        found.update({f"{variant}/{k}": v for k, v in compute_variant(variant).items()})
    for mode in ENCODER_MODES:
        progress(mode)
        found.update(compute_encoder(mode))
    return found


def main() -> None:
    """Write every reference output; ``--only NAME ...``: recompute those
    variants (or encoder modes) alone, keeping every other stored value (a
    new method's entry, without rewriting the others' bits)."""
    import argparse
    import subprocess
    import time

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS) + list(ENCODER_MODES))
    parser.add_argument("--float64", metavar="VARIANT", choices=list(VARIANTS),
                        help="write nothing: print how far VARIANT's float32 outputs (fused, eager, stored) lie from "
                             "the same model's in float64 (float64_check), to run before regenerating it")
    args = parser.parse_args()
    if args.float64:
        print("| group | fused | eager | stored |\n|---|---|---|---|")
        for group, row in float64_check(args.float64).items():
            print(f"| {group} | " + " | ".join(f"{row[n]:.1e}" if n in row else "-" for n in ("fused", "eager", "stored"))
                  + " |")
        return
    only = args.only
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=TESTS.parent, capture_output=True, text=True).stdout
    start = time.time()
    if only:
        stored = torch.load(DATA, weights_only=True)
        outputs = {k: v for k, v in stored["outputs"].items() if k.split("/")[0] not in only
                   and not (k.startswith("encoder/") and k.split("/")[1] in only)}
        for name in only:
            found = compute_encoder(name) if name in ENCODER_MODES else {
                f"{name}/{k}": v for k, v in compute_variant(name).items()}
            outputs.update(found)
        commit = f"{stored['commit']} ({', '.join(only)} at {commit.strip()})"
    else:
        outputs = compute_all(lambda name: print(f"{time.time() - start:7.1f}s {name}", flush=True))
    DATA.parent.mkdir(exist_ok=True)
    torch.save({"fingerprint": fingerprint(), "commit": commit.strip(), "outputs": outputs}, DATA)
    print(f"{len(outputs)} outputs, {DATA.stat().st_size / 1e6:.2f} MB, {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
