"""Fused CPU loops, compiled from the C++ below on first use.

Eager PyTorch runs an elementwise formula as one pass over memory per
operation.  Where a kernel's elementwise work costs as much as its matrix
products (stick-breaking's two sigmoids and running product along the keys,
five passes over every block of scores), one loop that reads each score once
does the same work in a third of the time.  This module holds such loops, in
C++ with GCC's vector extensions (16 floats at a time with AVX-512, else 8;
x86-64 CPUs with AVX2 or AVX-512, the vector instructions torch itself uses
there),
compiled with the machine's C++ compiler into a shared library and called
through ``ctypes`` on tensors' memory.

It is optional: without a compiler, on a build error, on a CPU without AVX2
(or not x86-64: the loops were not measured there), off the CPU, for
float64 (the tests' exact oracle), or with ``FAIRSEQ_ALIBI_NATIVE=0`` in the
environment, :func:`library` is None and each caller runs its eager
PyTorch path, which computes the same numbers (to float32 rounding: the
loops' exponential is within 2 units in the last place of the exact one).
:func:`status` says which, and why.

The library is built once per source, compiler and flags into
``$FAIRSEQ_ALIBI_NATIVE_DIR`` (default ``~/.cache/fairseq_alibi/native``,
``$XDG_CACHE_HOME`` honoured), written under a temporary name and renamed,
so that processes building at once (test workers) never load half a file.
The file's name is the hash of what built it: a changed source or compiler
builds anew, nothing stale is loaded.  Parallel over heads with OpenMP
(torch's own runtime, which is loaded first, serves the library), as many
threads as ``torch.get_num_threads()``.

Pure torch and the standard library, no fairseq: this file travels with
exported models, which build the same library where they run (or fall back).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

#: Set to 0 to run every kernel's eager PyTorch path.
SWITCH = "FAIRSEQ_ALIBI_NATIVE"
#: Where the built library is kept.
DIRECTORY = "FAIRSEQ_ALIBI_NATIVE_DIR"
#: Bumped with every change of the functions' signatures (checked on load).
ABI = 1

SOURCE = r"""
// fairseq_alibi/core/native.py's loops.  Built by that module; see its docstring.
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// One vector of floats: 16 with AVX-512, else 8 (GCC's vector extensions: plain C++ on any target).
#if defined(__AVX512F__)
#define WIDTH 16
#else
#define WIDTH 8
#endif
typedef float vf __attribute__((vector_size(4 * WIDTH)));
typedef int32_t vi __attribute__((vector_size(4 * WIDTH)));
typedef float v1f __attribute__((vector_size(4)));
typedef int32_t v1i __attribute__((vector_size(4)));

// exp(x), x clamped to [-87, 87] (results stay normal floats; NaN passes through): x = n ln2 + r with
// ln2 split in two (Cody and Waite: n ln2_hi is exact), |r| <= ln2 / 2, exp(r) by its Taylor series to
// r^7 (truncation < 5e-9); 2^n written into the exponent bits.  Within 2 ulp of the exact value.
template <typename F, typename I>
static inline F fexp(F x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 87.0f ? 87.0f : x;
    F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    F r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    F p = r * (1.0f / 5040) + (1.0f / 720);
    p = p * r + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    I bits = (__builtin_convertvector(n, I) + 127) << 23;
    F scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// 1 / d for d in [1, 2^126]: the CPU's approximate reciprocal and one Newton step (a division takes
// longer than the rest of the loop), within 2 ulp; a division where there is no such instruction.
static inline vf reciprocal(vf d) {
#if defined(__AVX512F__)
    vf x = (vf)_mm512_rcp14_ps((__m512)d);
    return x + x * (1.0f - d * x);
#elif defined(__AVX2__)
    vf x = (vf)_mm256_rcp_ps((__m256)d);
    return x + x * (1.0f - d * x);
#else
    return 1.0f / d;
#endif
}

extern "C" int fa_abi(void) { return 1; }

// Stick-breaking's terms of one block of scores per head, keys nearest first (see stickbreaking.py):
// z [heads, cols, rows] the scores (key c of query r at c * rows + r), kept [heads, rows] each query's
// stick left before the block (in) and after it (out), w [heads, cols, rows] the weights times that
// stick: with b = sigmoid(z) = 1 / (1 + e), e = exp(-z), and 1 - b = e b (exact where b is near 1),
//     w[c, r] = b kept[r];  kept[r] *= e b,
// key by key (w may be z: each score is read before its weight is written).  A key query r does not see (c < base - r: its own key and later ones) or a padded key
// (pad[heads, cols] nonzero; pad may be null) weighs 0 and leaves the stick as it is.
extern "C" void fa_stickbreaking_terms(const float* z, float* w, float* kept, const uint8_t* pad,
                                       int64_t heads, int64_t cols, int64_t rows, int64_t base, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && heads > 1)
    for (int64_t h = 0; h < heads; ++h) {
        float* stick = kept + h * rows;
        vi lane;
        for (int i = 0; i < WIDTH; ++i) lane[i] = i;
        for (int64_t c = 0; c < cols; ++c) {
            const float* zc = z + (h * cols + c) * rows;
            float* wc = w + (h * cols + c) * rows;
            if (pad && pad[h * cols + c]) {
                memset(wc, 0, rows * sizeof(float));
                continue;
            }
            const int64_t first = base - c;  // the first row that sees key c
            int64_t r = 0;
            for (; r + WIDTH <= rows; r += WIDTH) {
                vf zr, st;
                memcpy(&zr, zc + r, sizeof zr);
                memcpy(&st, stick + r, sizeof st);
                vf e = fexp<vf, vi>(-zr);
                vf b = reciprocal(1.0f + e);
                vf left = e * b;
                vi seen = (lane + (int32_t)(r - first)) >= 0;
                b = seen ? b : 0.0f;
                left = seen ? left : 1.0f;
                vf wr = b * st;
                st *= left;
                memcpy(wc + r, &wr, sizeof wr);
                memcpy(stick + r, &st, sizeof st);
            }
            for (; r < rows; ++r) {
                v1f zr = {-zc[r]};
                float e = fexp<v1f, v1i>(zr)[0];
                float b = 1.0f / (1.0f + e), left = e * b;
                if (r < first) { b = 0.0f; left = 1.0f; }
                wc[r] = b * stick[r];
                stick[r] *= left;
            }
        }
    }
}
"""

_state = {"library": None, "tried": False, "why": "not built yet"}


def _flags() -> list:
    """The compiler's flags: optimized, position-independent, OpenMP, and the vector instructions torch
    itself uses on this CPU.  Only x86-64 CPUs with AVX2 (torch's capability AVX2 or AVX512) are
    served: the loops were measured there (without AVX they ran slower than eager PyTorch), and
    ``RuntimeError`` says so elsewhere."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"the fused loops need an x86-64 CPU with AVX2; torch reports {platform.machine()} "
                           f"with capability {capability}")
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-Wno-psabi", "-std=c++14", "-mavx2", "-mfma"]
    if capability == "AVX512":  # torch's own test of it: F, BW, VL and DQ
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    return flags


def _directory() -> str:
    if os.environ.get(DIRECTORY):
        return os.environ[DIRECTORY]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fairseq_alibi", "native")


def _build() -> ctypes.CDLL:
    """Build (or find built) and load the library; raises ``RuntimeError`` saying why not."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler (c++ or g++ on the PATH, or $CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = _flags()
    key = hashlib.sha256("\0".join([SOURCE, compiler, version, *flags]).encode()).hexdigest()[:20]
    directory = _directory()
    path = os.path.join(directory, f"fairseq_alibi_native_{key}.so")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as work:
            source = os.path.join(work, "native.cpp")
            with open(source, "w", encoding="utf-8") as handle:
                handle.write(SOURCE)
            built = os.path.join(work, "native.so")
            run = subprocess.run([compiler, *flags, source, "-o", built], capture_output=True, text=True,
                                 timeout=600)
            if run.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {(run.stderr or run.stdout).strip()[-500:]}")
            os.replace(built, path)  # atomic: another process sees the whole file or none
    library = ctypes.CDLL(path)
    if library.fa_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {library.fa_abi()}, not {ABI}")
    library.fa_stickbreaking_terms.restype = None
    library.fa_stickbreaking_terms.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    return library


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None where it is switched off or cannot be built (:func:`status` says
    why; the first failure is logged once as a warning)."""
    if os.environ.get(SWITCH, "1").strip() == "0":
        _state["why"] = f"switched off ({SWITCH}=0)"
        return None
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["library"], _state["why"] = _build(), "built"
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _state["why"] = f"not available: {error}"
            logger.warning("fused CPU loops %s; the eager PyTorch kernels run instead", _state["why"])
    return _state["library"]


def status() -> str:
    """One line: whether the fused loops run, and why not where they do not."""
    return "built" if library() is not None else _state["why"]


def available_for(t: Tensor) -> bool:
    """Whether the loops serve tensors like ``t``: float32 on the CPU, and the library loaded."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and library() is not None


def _pointer(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def stickbreaking_terms(z: Tensor, w: Tensor, kept: Tensor, pad: Optional[Tensor], base: int,
                        checked: bool = True) -> None:
    """Stick-breaking's weights of one block (the C++ ``fa_stickbreaking_terms``): ``z`` and ``w``
    ``[heads, cols, rows]`` (scores in, weights out; ``w`` may be ``z``), ``kept`` ``[heads, rows]`` (in
    place), ``pad``
    ``[heads, cols]`` uint8 or None; all float32, contiguous, on the CPU; query ``r`` sees key ``c`` where
    ``c >= base - r``.  ``checked=False`` skips the checks of the arguments (a kernel's inner loop, whose
    buffers are made to fit: they cost as much as the call)."""
    heads, cols, rows = z.shape
    if not checked:
        _state["library"].fa_stickbreaking_terms(z.data_ptr(), w.data_ptr(), kept.data_ptr(), _pointer(pad),
                                                 heads, cols, rows, base, torch.get_num_threads())
        return
    for name, t, shape in (("z", z, (heads, cols, rows)), ("w", w, (heads, cols, rows)),
                           ("kept", kept, (heads, rows))):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {shape}, "
                             f"not {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})")
    if pad is not None and (pad.dtype != torch.uint8 or not pad.is_contiguous() or tuple(pad.shape) != (heads, cols)):
        raise ValueError(f"pad must be a contiguous uint8 tensor of shape {(heads, cols)}")
    library().fa_stickbreaking_terms(z.data_ptr(), w.data_ptr(), kept.data_ptr(), _pointer(pad),
                                     heads, cols, rows, base, torch.get_num_threads())
