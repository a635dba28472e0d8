"""Fused CPU calls, compiled from the C++ below on first use.

Eager PyTorch runs an elementwise formula as one pass over memory per
operation, and a blockwise kernel written in Python as one step (a dozen
operations) per block.  Where that costs as much as the matrix products,
one C++ call does the whole attention: per head (OpenMP threads over the
heads) and block of queries, the scores of a block of keys by the BLAS
``sgemm`` torch itself calls, one vectorized loop over them, the output by
``sgemm``, each head's block of scores staying in the core's cache.  Three
such calls for evaluation (no gradient):

* :func:`stickbreaking_forward`: stick-breaking's weights (two sigmoids
  and the running product along the keys), each head stopping once its
  sticks are spent (``stickbreaking.py``); :func:`stickbreaking_terms` is
  its loop alone, for its tests;
* :func:`fire_forward`: FIRE's bias (one value per distance and block,
  per pair where the block's rows straddle a knot of its MLP) and an online
  softmax (``fire.py``);
* :func:`path_forward`: PaTH's blocks' compact forms, the sweep within each
  chunk, the cached keys (those PaTH-FoX's gate has made negligible left
  out) and their carrying through the chunk, without padding (``path.py``):
  ``sgemm`` for every product, the triangular inverse by forward
  substitution.

and, for PaTH's training, three pairs of calls with backwards written out:
:func:`path_block_terms` (the blocks' compact forms), :func:`path_merge`
(blocks merged in pairs) and :func:`path_sweep_forward` (the sweep over the
blocks and its softmax); :func:`path_w` is PaTH's ``w`` (its convolution,
SiLU and unit length) in one pass where no gradient is taken.

Every tensor these calls allocate lies on a buffer kept for reuse
(:class:`Scratch`, :data:`SCRATCH`), handed out again only once nothing
references it: a fresh tensor is faulted in from the operating system page
by page, which on a small virtual machine took an eighth of PaTH's training
call at 4,096 tokens.

The loops are C++ with GCC's vector extensions, 16 floats at a time with
AVX-512, else 8 (x86-64 CPUs with AVX2 or AVX-512, the vector instructions
torch itself uses there); their exponential is within 2 units in the last
place of the exact one.  ``sgemm``'s address is read from torch's own,
already loaded CPU library and its two products checked once against
torch's (:func:`forward_available`).

It is optional: without a compiler, on a build error, on a CPU without AVX2
(or not x86-64: the loops were not measured there), off the CPU, for
float64 (the tests' exact oracle), or with ``FAIRSEQ_ALIBI_NATIVE=0`` in the
environment, :func:`library` is None and each caller runs its eager
PyTorch path, which computes the same numbers to float32 rounding.
:func:`status` says which, and why.

The library is built once per source, compiler and flags into
``$FAIRSEQ_ALIBI_NATIVE_DIR`` (default ``~/.cache/fairseq_alibi/native``,
``$XDG_CACHE_HOME`` honoured), written under a temporary name and renamed,
so that processes building at once (test workers) never load half a file.
The file's name is the hash of what built it: a changed source or compiler
builds anew, nothing stale is loaded.  OpenMP is torch's own runtime, which
is loaded first; as many threads as ``torch.get_num_threads()``.

Torch and the standard library, no fairseq: this file travels with
exported models, which build the same library where they run (or fall back).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

from .errors import ConfigError

logger = logging.getLogger(__name__)

#: Set to 0 to run every kernel's eager PyTorch path (:func:`switched_on`).
SWITCH = "FAIRSEQ_ALIBI_NATIVE"
#: Where the built library is kept.
DIRECTORY = "FAIRSEQ_ALIBI_NATIVE_DIR"
#: Bumped with every change of the functions' signatures (checked on load).
ABI = 10

SOURCE = r"""
// fairseq_alibi/core/native.py's loops.  Built by that module; see its docstring.
#include <stdint.h>
#include <string.h>
#include <math.h>

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

extern "C" int fa_abi(void) { return 10; }

// Stick-breaking's weights of one block of scores of one head, keys nearest first (see stickbreaking.py):
// z [cols, rows] the scores (key c of query r at c * rows + r), stick [rows] each query's stick left before
// the block (in) and after it (out), w [cols, rows] the weights times that stick: with b = sigmoid(z) =
// 1 / (1 + e), e = exp(-z), and 1 - b = e b (exact where b is near 1),
//     w[c, r] = b stick[r];  stick[r] *= e b,
// key by key (w may be z: each score is read before its weight is written).  A key query r does not see
// (c < base - r: its own key and later ones) or a padded key (pad[cols] nonzero; pad may be null) weighs 0
// and leaves the stick as it is.
static void sticks(const float* z, float* w, float* stick, const uint8_t* pad, int64_t cols, int64_t rows,
                   int64_t base) {
    vi lane;
    for (int i = 0; i < WIDTH; ++i) lane[i] = i;
    for (int64_t c = 0; c < cols; ++c) {
        const float* zc = z + c * rows;
        float* wc = w + c * rows;
        if (pad && pad[c]) {
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

// sticks() for a batch of heads: z, w [heads, cols, rows], kept [heads, rows], pad [heads, cols] or null.
extern "C" void fa_stickbreaking_terms(const float* z, float* w, float* kept, const uint8_t* pad,
                                       int64_t heads, int64_t cols, int64_t rows, int64_t base, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && heads > 1)
    for (int64_t h = 0; h < heads; ++h)
        sticks(z + h * cols * rows, w + h * cols * rows, kept + h * rows, pad ? pad + h * cols : nullptr,
               cols, rows, base);
}

// The BLAS routine torch calls (Fortran's sgemm, column-major): its address is passed in.
typedef void (*sgemm_t)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                        const int*, const float*, const int*, const float*, float*, const int*);

// The forwards' two products, called exactly as they call them, on row-major q [rows, d], k [cols, d] and
// v [cols, dv]: z [cols, rows] = K Q^T, then o [rows, dv] += z^T V (native.py's _sgemm_works checks both
// against torch before a forward runs).
extern "C" void fa_sgemm_probe(void* gemm, const float* q, const float* k, const float* v, float* z, float* o,
                               int rows, int cols, int d, int dv) {
    const sgemm_t sgemm = (sgemm_t)gemm;
    const float one = 1.0f, zero = 0.0f;
    sgemm("T", "N", &rows, &cols, &d, &one, q, &d, k, &d, &zero, z, &rows);      // z [cols, rows] = K Q^T
    sgemm("N", "T", &dv, &rows, &cols, &one, v, &dv, z, &rows, &one, o, &dv);    // o [rows, dv] += z^T V
}

// Stick-breaking's forward without a gradient, whole: stickbreaking.py's _forward_by_heads step for step, one
// head at a time (each thread one head: a head's block of scores stays in the core's cache between the two
// products and the loop).  q [heads, T, D] (scaled), k [heads, S, D] and v [heads, S, Dv] with the keys
// reversed (key S - 1 first), pad [heads, S] in the same order (nonzero at padding; may be null); queries
// the last T of the S keys.  For each block of `block` queries, key blocks of `key_block` from the diagonal
// backwards: scores z = K Q^T, the weights over them (sticks), out += z^T V, until every query of the block
// has less than `floor` of its stick left.  Writes out [heads, T, Dv], rem [heads, T] (the sticks left) and
// scored[heads], the (query, key) pairs computed (whole blocks, masked parts included).
extern "C" void fa_stickbreaking_forward(const float* q, const float* k, const float* v, const uint8_t* pad,
                                         float* out, float* rem, int64_t* scored, int64_t heads, int64_t T,
                                         int64_t S, int64_t D, int64_t Dv, int64_t block, int64_t key_block,
                                         float floor, int threads, void* gemm) {
    const sgemm_t sgemm = (sgemm_t)gemm;
    const int64_t offset = S - T;
    const float one = 1.0f, zero = 0.0f;
    const int d = (int)D, dv = (int)Dv;
#pragma omp parallel num_threads(threads) if (threads > 1 && heads > 1)
    {
        float* z = new float[block * key_block];
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < heads; ++h) {
            const float* qh = q + h * T * D;
            const float* kh = k + h * S * D;
            const float* vh = v + h * S * Dv;
            const uint8_t* ph = pad ? pad + h * S : nullptr;
            float* oh = out + h * T * Dv;
            float* stick = rem + h * T;
            int64_t pairs = 0;
            for (int64_t start = 0; start < T; start += block) {
                const int64_t rows = T - start < block ? T - start : block;
                const int n_rows = (int)rows;
                memset(oh + start * Dv, 0, rows * Dv * sizeof(float));
                for (int64_t r = 0; r < rows; ++r) stick[start + r] = 1.0f;
                for (int64_t stop = offset + start + rows - 1; stop > 0;) {  // keys before the last query
                    const int64_t first = stop - key_block > 0 ? stop - key_block : 0;
                    const int n_cols = (int)(stop - first);
                    const float* kb = kh + (S - stop) * D;  // key stop - 1 first
                    const float* vb = vh + (S - stop) * Dv;
                    // z [cols, rows] = K_block Q_rows^T: column-major z^T = Q_rows K_block^T
                    sgemm("T", "N", &n_rows, &n_cols, &d, &one, qh + start * D, &d, kb, &d, &zero, z, &n_rows);
                    sticks(z, z, stick + start, ph ? ph + (S - stop) : nullptr, n_cols, rows, stop - offset - start);
                    // out [rows, Dv] += z^T V_block: column-major out^T += V_block^T z
                    sgemm("N", "T", &dv, &n_rows, &n_cols, &one, vb, &dv, z, &n_rows, &one, oh + start * Dv, &dv);
                    pairs += rows * n_cols;
                    float top = 0.0f;
                    bool nan = false;
                    for (int64_t r = 0; r < rows; ++r) {
                        const float s = stick[start + r];
                        nan |= s != s;
                        top = s > top ? s : top;
                    }
                    if (nan || !(top >= floor)) break;  // every query's stick spent (as the eager path: NaN stops)
                    stop = first;
                }
            }
            scored[h] = pairs;
        }
        delete[] z;
    }
}

// Whether any lane of a comparison's result (0 or -1 per lane) is set: one test instruction.
static inline bool any_lane(vi mask) {
#if defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#else
    bool any = false;
    for (int l = 0; l < WIDTH; ++l) any |= mask[l] != 0;
    return any;
#endif
}

// The index of x's piece: the number of knots below x (torch.bucketize's, right=False).
static inline int piece_of(float x, const float* knots, int n_knots) {
    int lo = 0, hi = n_knots;  // the first knot >= x, by bisection
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (knots[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// piece_of(x) found from a nearby piece p (the previous distance's): up while the knot above is below x, down
// while the one below is not; NaN has piece 0, as piece_of gives it.
static inline int piece_walk(float x, const float* knots, int n_knots, int p) {
    if (x != x) return 0;
    while (p < n_knots && knots[p] < x) ++p;
    while (p > 0 && !(knots[p - 1] < x)) --p;
    return p;
}

// FIRE's bias value of MLP input x on piece p: slope x + intercept, rounded twice as torch's separate
// product and sum round it (no fused multiply-add), as fire.py computes it.
__attribute__((optimize("fp-contract=off"))) static inline float fire_value(float slope, float x, float intercept) {
    return slope * x + intercept;
}
__attribute__((optimize("fp-contract=off"))) static inline vf fire_values(vf slope, vf x, vf intercept) {
    return slope * x + intercept;
}

// A row's running maximum raised to m (where it rises): its earlier sum and output scaled by exp(old - m).
static inline void rescaled(float* o, int64_t Dv, float* top, float* total, float m) {
    if (!(m > *top)) return;
    if (*top != -INFINITY) {
        v1f a = {*top - m};
        const float scale = fexp<v1f, v1i>(a)[0];
        *total *= scale;
        for (int64_t t = 0; t < Dv; ++t) o[t] *= scale;
    }
    *top = m;
}

// A column of scores z [rows] replaced by its weights exp(z - top) (0 where z is -inf), added to sums [rows];
// whether any score exceeds its row's top by more than headroom (then the weights are not to be used).
static inline bool column_weights(float* z, int64_t rows, const float* top, float* sums, float headroom) {
    vi over = {};
    bool late = false;
    int64_t r = 0;
    for (; r + WIDTH <= rows; r += WIDTH) {
        vf zv, m, t;
        memcpy(&zv, z + r, sizeof zv);
        memcpy(&m, top + r, sizeof m);
        memcpy(&t, sums + r, sizeof t);
        over |= zv > m + headroom;
        vf p = fexp<vf, vi>(zv - m);
        p = zv == -INFINITY ? 0.0f : p;
        t += p;
        memcpy(z + r, &p, sizeof p);
        memcpy(sums + r, &t, sizeof t);
    }
    for (; r < rows; ++r) {
        late |= z[r] > top[r] + headroom;
        v1f a = {z[r] - top[r]};
        const float p = z[r] == -INFINITY ? 0.0f : fexp<v1f, v1i>(a)[0];
        z[r] = p;
        sums[r] += p;
    }
    return late || any_lane(over);
}

// How far above a row's running maximum a later key block's scores may lie and still be weighed against that
// maximum in the same pass as their bias (fa_fire_forward): weights up to e^30 each, their sum over 2^31 keys
// far below float32's largest value.
#define FIRE_HEADROOM 30.0f

// FIRE's attention without a gradient (fire.py): softmax over keys j <= i of q_i . k_j / sqrt(d) + b_h(i, j),
// b_h(i, j) = slope x + intercept on the piece of x = psi[i - j] / norm[i] (psi[d] = log(c d + 1), norm[i] =
// log(c max(threshold, i) + 1), both computed by the caller in float32).  q [heads, T, D] (scaled), k [heads,
// S, D], v [heads, S, Dv], pad [heads, S] (nonzero at padding; may be null); queries the last T of the S
// keys; the tables knots [n], slopes and intercepts [H, n + 1] per head of the model (head h of the batch's
// heads reads row h % H).  For each block of `block` queries, key blocks of `key_block` from the nearest
// back: scores z = K Q^T by sgemm, the bias added, an online softmax (the rows' running maxima and sums; past
// the first key block, the weights taken against the maxima so far as the bias is added, see FIRE_HEADROOM),
// out += P^T V by sgemm; out [heads, T, Dv] divided by the sums at the end.  Each block's bias per distance where the block's
// rows share a piece (the piece at the block's smallest and largest normalizer agree), per pair elsewhere; the
// pieces of every distance the query block sees are found once for all its key blocks, by walking along the
// distances (by bisection for each key block, they took about a fifth of the call at 2,048 tokens).
// x is psi times the row's 1 / norm (a multiplication per pair, not a division): within
// one unit in the last place of fire.py's psi / norm, and monotone in the row as the quotient is, so the
// pieces of a block's first and last rows still bound every row's.  Where no row of a key's column straddles
// a knot (a count per distance says so), the bias is (slope psi) (1 / norm) + intercept, one multiply-add a
// pair; each row's largest score is kept as the bias is added (no second pass over the scores).
extern "C" void fa_fire_forward(const float* q, const float* k, const float* v, const uint8_t* pad,
                                const float* psi, const float* norm, const float* knots, int64_t n_knots,
                                const float* slopes, const float* intercepts, int64_t model_heads, float* out,
                                int64_t heads, int64_t T, int64_t S, int64_t D, int64_t Dv, int64_t block,
                                int64_t key_block, int threads, void* gemm) {
    const sgemm_t sgemm = (sgemm_t)gemm;
    const int64_t offset = S - T;
    const int64_t pieces = n_knots + 1;
    const float one = 1.0f, zero = 0.0f;
    const int d = (int)D, dv = (int)Dv;
#pragma omp parallel num_threads(threads) if (threads > 1 && heads > 1)
    {
        float* z = new float[block * key_block];
        float* top = new float[block];    // each row's running maximum
        float* total = new float[block];  // each row's running sum of exp(score - top)
        // per distance of a query block, entry lead + distance (lead entries first: the distances below 0,
        // which no row sees): the pieces of its last and first rows, the slope and intercept of the first
        const int64_t lead = block - 1, span = lead + S;
        int* low = new int[span];
        int* high = new int[span];
        float* slope_d = new float[span];
        float* icpt_d = new float[span];
        float* inv_norm = new float[block];  // 1 / norm of the block's rows: x = psi * (1 / norm)
        float* slope_psi = new float[span];  // slope * psi per distance: the bias slope_psi / norm + intercept
        int* straddles = new int[span + 1];  // how many of the distances before each straddle a knot
        float* rowmax = new float[block];    // each row's largest score of the key block
        float* part = new float[block];      // each row's sum of the key block's weights (one pass)
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < heads; ++h) {
            const float* qh = q + h * T * D;
            const float* kh = k + h * S * D;
            const float* vh = v + h * S * Dv;
            const uint8_t* ph = pad ? pad + h * S : nullptr;
            const float* sl = slopes + (h % model_heads) * pieces;
            const float* ic = intercepts + (h % model_heads) * pieces;
            float* oh = out + h * T * Dv;
            for (int64_t start = 0; start < T; start += block) {
                const int64_t rows = T - start < block ? T - start : block;
                const int n_rows = (int)rows;
                const int64_t i0 = offset + start;  // the block's first query position
                const float* nrm = norm + start;
                for (int64_t r = 0; r < rows; ++r) inv_norm[r] = 1.0f / nrm[r];
                const float i_first = inv_norm[0], i_last = inv_norm[rows - 1];
                // the block's tables, once for all its key blocks: x grows with the distance, so each row's
                // piece is found by walking from the previous distance's (piece_walk), not by bisection
                const int64_t entries = lead + i0 + rows;  // distances up to i0 + rows - 1
                straddles[0] = 0;
                for (int64_t e = 0; e < lead; ++e) {
                    low[e] = high[e] = 0;
                    slope_d[e] = icpt_d[e] = slope_psi[e] = 0.0f;
                    straddles[e + 1] = 0;
                }
                int p_low = 0, p_high = 0;
                for (int64_t e = lead; e < entries; ++e) {  // x falls as the normalizer grows: the last row's x is the smallest
                    const float ps_e = psi[e - lead];
                    p_low = piece_walk(ps_e * i_last, knots, (int)n_knots, p_low);
                    p_high = piece_walk(ps_e * i_first, knots, (int)n_knots, p_high);
                    low[e] = p_low;
                    high[e] = p_high;
                    slope_d[e] = sl[p_low];
                    icpt_d[e] = ic[p_low];
                    slope_psi[e] = slope_d[e] * ps_e;
                    straddles[e + 1] = straddles[e] + (p_low != p_high);
                }
                memset(oh + start * Dv, 0, rows * Dv * sizeof(float));
                for (int64_t r = 0; r < rows; ++r) { top[r] = -INFINITY; total[r] = 0.0f; }
                const int64_t keys = i0 + rows;  // keys 0 .. i0 + rows - 1
                // key blocks from the nearest back: the first sets each row's maximum (two passes: the bias and
                // the maximum, then the weights); a later one weighs its scores against it as their bias is added
                // (one pass), unless a score lies more than FIRE_HEADROOM above it (then two passes after all)
                for (int64_t j0 = (keys - 1) / key_block * key_block; j0 >= 0; j0 -= key_block) {
                    const int64_t cols = keys - j0 < key_block ? keys - j0 : key_block;
                    const int n_cols = (int)cols;
                    bool lazy = true;  // one pass: every row has a finite maximum
                    for (int64_t r = 0; r < rows && lazy; ++r) lazy = top[r] != -INFINITY;
                  again:
                    sgemm("T", "N", &n_rows, &n_cols, &d, &one, qh + start * D, &d, kh + j0 * D, &d, &zero, z, &n_rows);
                    bool over = false;
                    for (int64_t r = 0; r < rows; ++r) rowmax[r] = -INFINITY;
                    if (lazy) memset(part, 0, rows * sizeof(float));
                    for (int64_t c = 0; c < cols; ++c) {
                        float* zc = z + c * rows;
                        const int64_t j = j0 + c;
                        if (ph && ph[j]) {
                            for (int64_t r = 0; r < rows; ++r) zc[r] = lazy ? 0.0f : -INFINITY;
                            continue;
                        }
                        // row r: distance i0 + r - j (rows before j - i0 do not see key j), entry e = r + cols - 1 - c
                        int64_t r = j - i0 > 0 ? j - i0 : 0;
                        for (int64_t s = 0; s < r && s < rows; ++s) zc[s] = -INFINITY;
                        const float* ps = psi + (i0 - j);  // ps[r]: row r's psi
                        const int64_t base = lead + i0 - j;  // row r's distance's entry: base + r
                        const int* lo = low + base;
                        const int* hi = high + base;
                        const float* sd = slope_d + base;
                        const float* id = icpt_d + base;
                        if (r < rows && straddles[base + rows] == straddles[base + r]) {
                            // no row of the column straddles a knot: slope psi / norm + intercept, one FMA a pair
                            const float* sp = slope_psi + base;
                            for (; r + WIDTH <= rows; r += WIDTH) {
                                vf spv, nv, iv, zv, mv;
                                memcpy(&spv, sp + r, sizeof spv);
                                memcpy(&nv, inv_norm + r, sizeof nv);
                                memcpy(&iv, id + r, sizeof iv);
                                memcpy(&zv, zc + r, sizeof zv);
                                memcpy(&mv, rowmax + r, sizeof mv);
                                zv += spv * nv + iv;
                                mv = zv > mv ? zv : mv;
                                memcpy(zc + r, &zv, sizeof zv);
                                memcpy(rowmax + r, &mv, sizeof mv);
                            }
                            for (; r < rows; ++r) {
                                zc[r] += sp[r] * inv_norm[r] + id[r];
                                rowmax[r] = zc[r] > rowmax[r] ? zc[r] : rowmax[r];
                            }
                            if (lazy) over |= column_weights(zc, rows, top, part, FIRE_HEADROOM);
                            continue;
                        }
                        for (; r + WIDTH <= rows; r += WIDTH) {
                            vf pv, nv, sv, iv, zv, mv;
                            vi lv, hv;
                            memcpy(&pv, ps + r, sizeof pv);
                            memcpy(&nv, inv_norm + r, sizeof nv);
                            memcpy(&sv, sd + r, sizeof sv);
                            memcpy(&iv, id + r, sizeof iv);
                            memcpy(&zv, zc + r, sizeof zv);
                            memcpy(&lv, lo + r, sizeof lv);
                            memcpy(&hv, hi + r, sizeof hv);
                            const vf x = pv * nv;
                            vf b = fire_values(sv, x, iv);
                            const vi differ = lv != hv;
                            if (any_lane(differ)) {  // rows that straddle a knot at this distance: their own piece
                                for (int l = 0; l < WIDTH; ++l) {
                                    if (!differ[l]) continue;
                                    const int p = piece_of(x[l], knots, (int)n_knots);
                                    b[l] = fire_value(sl[p], x[l], ic[p]);
                                }
                            }
                            zv += b;
                            memcpy(&mv, rowmax + r, sizeof mv);
                            mv = zv > mv ? zv : mv;
                            memcpy(zc + r, &zv, sizeof zv);
                            memcpy(rowmax + r, &mv, sizeof mv);
                        }
                        for (; r < rows; ++r) {
                            const float x = ps[r] * inv_norm[r];
                            const int p = lo[r] == hi[r] ? lo[r] : piece_of(x, knots, (int)n_knots);
                            zc[r] += fire_value(sl[p], x, ic[p]);
                            rowmax[r] = zc[r] > rowmax[r] ? zc[r] : rowmax[r];
                        }
                        if (lazy) over |= column_weights(zc, rows, top, part, FIRE_HEADROOM);
                    }
                    if (lazy && over) {  // a score far above its row's maximum: the block again, in two passes
                        lazy = false;
                        goto again;
                    }
                    if (lazy) {
                        for (int64_t r = 0; r < rows; ++r) total[r] += part[r];
                    } else {  // online softmax: the rows' new maxima (kept as the bias was added), earlier sums and
                              // outputs rescaled, then the weights exp(z - max), 0 where masked, into z
                        for (int64_t r = 0; r < rows; ++r) rescaled(oh + (start + r) * Dv, Dv, top + r, total + r, rowmax[r]);
                        for (int64_t c = 0; c < cols; ++c) column_weights(z + c * rows, rows, top, total, INFINITY);
                    }
                    sgemm("N", "T", &dv, &n_rows, &n_cols, &one, vh + j0 * Dv, &dv, z, &n_rows, &one, oh + start * Dv, &dv);
                }
                for (int64_t r = 0; r < rows; ++r) {
                    float* o = oh + (start + r) * Dv;
                    for (int64_t t = 0; t < Dv; ++t) o[t] /= total[r];
                }
            }
        }
        delete[] z; delete[] top; delete[] total; delete[] low; delete[] high; delete[] slope_d; delete[] icpt_d;
        delete[] inv_norm; delete[] slope_psi; delete[] straddles; delete[] rowmax; delete[] part;
    }
}

// Row-major C [m, n] = alpha op(A) op(B) + beta C by the column-major sgemm (C^T = op(B)^T op(A)^T).
static inline void mm(sgemm_t g, bool ta, bool tb, int m, int n, int k, float alpha, const float* A, int lda,
                      const float* B, int ldb, float beta, float* C, int ldc) {
    if (m <= 0 || n <= 0) return;
    g(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &k, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// A row of scores z [cols] replaced by exp(z - shift), 0 where z - shift <= -87 (path.py's SUBNORMAL: a weight
// under float32's normal range is 0, as the eager path's threshold makes it; NaN stays NaN); returns their sum.
static inline float shifted_exp(float* z, int64_t cols, float shift) {
    vf sum = {};
    float tail = 0.0f;
    int64_t c = 0;
    for (; c + WIDTH <= cols; c += WIDTH) {
        vf x;
        memcpy(&x, z + c, sizeof x);
        x -= shift;
        vf p = fexp<vf, vi>(x);
        p = x <= -87.0f ? 0.0f : p;
        sum += p;
        memcpy(z + c, &p, sizeof p);
    }
    for (; c < cols; ++c) {
        v1f x = {z[c] - shift};
        const float p = x[0] <= -87.0f ? 0.0f : fexp<v1f, v1i>(x)[0];
        tail += p;
        z[c] = p;
    }
    for (int l = 0; l < WIDTH; ++l) tail += sum[l];
    return tail;
}

// One step of an online softmax over row-major scores z [rows, cols] (leading dimension ld): each row's
// running maximum top, sum total and output o [rows, Dv] (ld Dv) rescaled where the maximum rises, z
// overwritten by the weights exp(z - top) (shifted_exp).
static void softmax_rows(float* z, int64_t rows, int64_t cols, int64_t ld, float* top, float* total, float* o,
                         int64_t Dv) {
    for (int64_t r = 0; r < rows; ++r) {
        float* zr = z + r * ld;
        float m = top[r];
        int64_t c = 0;
        if (cols >= WIDTH) {
            vf mv;
            memcpy(&mv, zr, sizeof mv);
            for (c = WIDTH; c + WIDTH <= cols; c += WIDTH) {
                vf x;
                memcpy(&x, zr + c, sizeof x);
                mv = x > mv ? x : mv;
            }
            for (int l = 0; l < WIDTH; ++l) m = mv[l] > m ? mv[l] : m;
        }
        for (; c < cols; ++c) m = zr[c] > m ? zr[c] : m;
        rescaled(o + r * Dv, Dv, top + r, total + r, m);
        total[r] += shifted_exp(zr, cols, top[r]);
    }
}

// PaTH's compact (UT) form of one block of c tokens (path.py's _block_terms), row-major: q, k, w [c, D]
// (q scaled; rows past the input's end zero, their beta 0: H = I there), beta [c]; writes local [c, c] (the
// block's own scores, -inf above the diagonal), carried [c, D] (queries carried back to the block's start),
// k_end [c, D] (keys carried to its end) and m [D, D] (the block's product, q -> q m).  work: 4 c^2 + 2 c D;
// save (may be null): 3 c^2 + c D, what path_block_backward reads.
static void path_block(sgemm_t g, int c, int D, const float* q, const float* k, const float* w, const float* beta,
                       float* local, float* carried, float* k_end, float* m, float* work, float* save = nullptr) {
    float* low = work;              // strictly_lower(W W^T) diag(beta), then reused for Q W^T
    float* inv = low + c * c;       // T = (I + low)^{-1}, unit lower triangular
    float* a = inv + c * c;         // T strictly_lower(W K^T), then diag(beta) of it
    float* x = a + c * c;           // strictly_lower(W K^T)
    float* wbeta = x + c * c;       // diag(beta) W
    float* gt = wbeta + c * D;      // G = T W, then diag(beta) G
    mm(g, false, true, c, c, D, 1.0f, w, D, w, D, 0.0f, low, c);
    for (int i = 0; i < c; ++i)
        for (int t = 0; t < c; ++t) low[i * c + t] = t < i ? low[i * c + t] * beta[t] : 0.0f;
    for (int i = 0; i < c; ++i) {  // forward substitution, row by row: T_i = e_i - sum_t<i low[i, t] T_t
        float* row = inv + i * c;
        memset(row, 0, c * sizeof(float));
        row[i] = 1.0f;
        for (int t = 0; t < i; ++t) {
            const float l = low[i * c + t];
            if (l == 0.0f) continue;
            const float* other = inv + t * c;
            for (int j = 0; j <= t; ++j) row[j] -= l * other[j];
        }
    }
    mm(g, false, false, c, D, c, 1.0f, inv, c, w, D, 0.0f, gt, D);
    mm(g, false, true, c, c, D, 1.0f, w, D, k, D, 0.0f, x, c);
    for (int t = 0; t < c; ++t)
        for (int j = t; j < c; ++j) x[t * c + j] = 0.0f;
    mm(g, false, false, c, c, c, 1.0f, inv, c, x, c, 0.0f, a, c);
    for (int t = 0; t < c; ++t)
        for (int d = 0; d < D; ++d) wbeta[t * D + d] = beta[t] * w[t * D + d];
    memcpy(k_end, k, (size_t)c * D * sizeof(float));
    mm(g, true, false, c, D, c, -1.0f, a, c, wbeta, D, 1.0f, k_end, D);  // k_end = K - A^T (beta W)
    for (int d = 0; d < D * D; ++d) m[d] = 0.0f;
    for (int d = 0; d < D; ++d) m[d * D + d] = 1.0f;
    mm(g, true, false, D, D, c, -1.0f, wbeta, D, gt, D, 1.0f, m, D);      // M = I - (beta W)^T G
    float* qw = low;
    mm(g, false, true, c, c, D, 1.0f, q, D, w, D, 0.0f, qw, c);
    for (int i = 0; i < c; ++i)
        for (int t = i + 1; t < c; ++t) qw[i * c + t] = 0.0f;
    if (save) {  // for the backward: T, A and G before their rows are scaled by beta, and lower(Q W^T)
        memcpy(save, inv, (size_t)c * c * sizeof(float));
        memcpy(save + c * c, a, (size_t)c * c * sizeof(float));
        memcpy(save + 2 * c * c, qw, (size_t)c * c * sizeof(float));
        memcpy(save + 3 * c * c, gt, (size_t)c * D * sizeof(float));
    }
    for (int t = 0; t < c; ++t) {
        for (int j = 0; j < c; ++j) a[t * c + j] *= beta[t];
        for (int d = 0; d < D; ++d) gt[t * D + d] *= beta[t];
    }
    mm(g, false, true, c, c, D, 1.0f, q, D, k, D, 0.0f, local, c);
    mm(g, false, false, c, c, c, -1.0f, qw, c, a, c, 1.0f, local, c);   // Q K^T - QW diag(beta) A
    for (int i = 0; i < c; ++i)
        for (int j = i + 1; j < c; ++j) local[i * c + j] = -INFINITY;
    memcpy(carried, q, (size_t)c * D * sizeof(float));
    mm(g, false, false, c, D, c, -1.0f, qw, c, gt, D, 1.0f, carried, D);  // Q - QW diag(beta) G
}

// The block terms of n blocks at once, for training (path.py's _BlockTerms): q, k, w [n, c, D], beta [n, c]; local
// [n, c, c], carried and k_end [n, c, D], m [n, D, D] as path_block writes them, save [n, 3 c^2 + c D] for the
// backward.
extern "C" void fa_path_block_terms(const float* q, const float* k, const float* w, const float* beta, float* local,
                                    float* carried, float* k_end, float* m, float* save, int64_t n, int64_t c,
                                    int64_t D, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
    {
        float* work = new float[4 * c * c + 2 * c * D];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n; ++b)
            path_block(g, (int)c, (int)D, q + b * c * D, k + b * c * D, w + b * c * D, beta + b * c, local + b * c * c,
                       carried + b * c * D, k_end + b * c * D, m + b * D * D, work, save + b * (3 * c * c + c * D));
        delete[] work;
    }
}

// The gradients of path_block's outputs taken back to its inputs, for n blocks (the derivation in path.py's
// _BlockTerms): given dlocal [n, c, c] (read below the diagonal and on it only), dcarried, dk_end [n, c, D] and dm
// [n, D, D], writes dq, dk, dw [n, c, D] and dbeta [n, c].  With Wb = diag(beta) W, Ab = diag(beta) A, Gb =
// diag(beta) G, X = strictly_lower(W K^T), S = W W^T:
//   dQ = dC + dL K + dQW W;  dK = dL^T Q + dKe + dX^T W;  dQW = lower(-dC Gb^T - dL Ab^T);
//   dG = -diag(beta) QW^T dC - Wb dM;  dA = -diag(beta) QW^T dL - Wb dKe^T;  dWb = -G dM^T - A dKe;
//   dT = dA X^T + dG W^T;  dX = strictly_lower(T^T dA);  dLow = -T^T dT T^T;  dS = strictly_lower(dLow) diag(beta);
//   dW = dQW^T Q + diag(beta) dWb + dX K + T^T dG + (dS + dS^T) W;
//   dbeta = rowsum(G o dGb) + rowsum(A o dAb) + rowsum(W o dWb) + colsum(strictly_lower(S) o dLow).
extern "C" void fa_path_block_terms_backward(const float* q, const float* k, const float* w, const float* beta,
                                             const float* save, const float* dlocal, const float* dcarried,
                                             const float* dk_end, const float* dm, float* dq, float* dk, float* dw,
                                             float* dbeta, int64_t n, int64_t cc, int64_t DD, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int c = (int)cc, D = (int)DD;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
    {
        float* dl = new float[c * c];    // dlocal below and on the diagonal
        float* dqw = new float[c * c];
        float* da = new float[c * c];    // dAb, then dA
        float* x = new float[c * c];     // X, then S
        float* dt = new float[c * c];
        float* tmp = new float[c * c];
        float* wb = new float[c * D];
        float* gb = new float[c * D];    // Gb, then dWb
        float* ab = new float[c * c];
        float* dg = new float[c * D];    // dGb, then dG
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n; ++b) {
            const float *Q = q + b * c * D, *K = k + b * c * D, *W = w + b * c * D, *be = beta + b * c;
            const float* sv = save + b * (3 * c * c + c * D);
            const float *T = sv, *A = sv + c * c, *QW = sv + 2 * c * c, *G = sv + 3 * c * c;
            const float *dL0 = dlocal + b * c * c, *dC = dcarried + b * c * D, *dKe = dk_end + b * c * D;
            const float* dM = dm + b * D * D;
            float *dQ = dq + b * c * D, *dK = dk + b * c * D, *dW = dw + b * c * D, *dB = dbeta + b * c;
            for (int i = 0; i < c; ++i)
                for (int j = 0; j < c; ++j) dl[i * c + j] = j <= i ? dL0[i * c + j] : 0.0f;
            for (int t = 0; t < c; ++t) {
                dB[t] = 0.0f;
                for (int d = 0; d < D; ++d) { wb[t * D + d] = be[t] * W[t * D + d]; gb[t * D + d] = be[t] * G[t * D + d]; }
                for (int j = 0; j < c; ++j) ab[t * c + j] = be[t] * A[t * c + j];
            }
            // dQ = dC + dL K;  dK = dL^T Q + dKe
            memcpy(dQ, dC, (size_t)c * D * sizeof(float));
            mm(g, false, false, c, D, c, 1.0f, dl, c, K, D, 1.0f, dQ, D);
            memcpy(dK, dKe, (size_t)c * D * sizeof(float));
            mm(g, true, false, c, D, c, 1.0f, dl, c, Q, D, 1.0f, dK, D);
            // dQW = lower(-dC Gb^T - dL Ab^T)
            mm(g, false, true, c, c, D, -1.0f, dC, D, gb, D, 0.0f, dqw, c);
            mm(g, false, true, c, c, c, -1.0f, dl, c, ab, c, 1.0f, dqw, c);
            for (int i = 0; i < c; ++i)
                for (int t = i + 1; t < c; ++t) dqw[i * c + t] = 0.0f;
            // dGb = -QW^T dC;  dAb = -QW^T dL;  their beta parts
            mm(g, true, false, c, D, c, -1.0f, QW, c, dC, D, 0.0f, dg, D);
            mm(g, true, false, c, c, c, -1.0f, QW, c, dl, c, 0.0f, da, c);
            for (int t = 0; t < c; ++t) {
                float s = 0.0f;
                for (int d = 0; d < D; ++d) { s += G[t * D + d] * dg[t * D + d]; dg[t * D + d] *= be[t]; }
                for (int j = 0; j < c; ++j) { s += A[t * c + j] * da[t * c + j]; da[t * c + j] *= be[t]; }
                dB[t] += s;
            }
            // dG -= Wb dM;  dA -= Wb dKe^T;  dWb = -G dM^T - A dKe  (into gb)
            mm(g, false, false, c, D, D, -1.0f, wb, D, dM, D, 1.0f, dg, D);
            mm(g, false, true, c, c, D, -1.0f, wb, D, dKe, D, 1.0f, da, c);
            mm(g, false, true, c, D, D, -1.0f, G, D, dM, D, 0.0f, gb, D);
            mm(g, false, false, c, D, c, -1.0f, A, c, dKe, D, 1.0f, gb, D);
            // dQ += dQW W;  dW = dQW^T Q + diag(beta) dWb;  dbeta += rowsum(W o dWb)
            mm(g, false, false, c, D, c, 1.0f, dqw, c, W, D, 1.0f, dQ, D);
            mm(g, true, false, c, D, c, 1.0f, dqw, c, Q, D, 0.0f, dW, D);
            for (int t = 0; t < c; ++t) {
                float s = 0.0f;
                for (int d = 0; d < D; ++d) { s += W[t * D + d] * gb[t * D + d]; dW[t * D + d] += be[t] * gb[t * D + d]; }
                dB[t] += s;
            }
            // X = strictly_lower(W K^T);  dT = dA X^T + dG W^T;  dX = strictly_lower(T^T dA)
            mm(g, false, true, c, c, D, 1.0f, W, D, K, D, 0.0f, x, c);
            for (int t = 0; t < c; ++t)
                for (int j = t; j < c; ++j) x[t * c + j] = 0.0f;
            mm(g, false, true, c, c, c, 1.0f, da, c, x, c, 0.0f, dt, c);
            mm(g, false, true, c, c, D, 1.0f, dg, D, W, D, 1.0f, dt, c);
            mm(g, true, false, c, c, c, 1.0f, T, c, da, c, 0.0f, x, c);
            for (int t = 0; t < c; ++t)
                for (int j = t; j < c; ++j) x[t * c + j] = 0.0f;
            // dW += dX K + T^T dG;  dK += dX^T W
            mm(g, false, false, c, D, c, 1.0f, x, c, K, D, 1.0f, dW, D);
            mm(g, true, false, c, D, c, 1.0f, x, c, W, D, 1.0f, dK, D);
            mm(g, true, false, c, D, c, 1.0f, T, c, dg, D, 1.0f, dW, D);
            // dLow = -T^T dT T^T (into dt);  S = W W^T (into x)
            mm(g, true, false, c, c, c, 1.0f, T, c, dt, c, 0.0f, tmp, c);
            mm(g, false, true, c, c, c, -1.0f, tmp, c, T, c, 0.0f, dt, c);
            mm(g, false, true, c, c, D, 1.0f, W, D, W, D, 0.0f, x, c);
            // dS = strictly_lower(dLow) diag(beta), symmetrized into tmp;  dbeta += colsum(strictly_lower(S) o dLow)
            for (int i = 0; i < c; ++i)
                for (int t = 0; t < c; ++t) tmp[i * c + t] = 0.0f;
            for (int i = 0; i < c; ++i)
                for (int t = 0; t < i; ++t) {
                    const float v = dt[i * c + t] * be[t];
                    tmp[i * c + t] += v;
                    tmp[t * c + i] += v;
                    dB[t] += x[i * c + t] * dt[i * c + t];
                }
            mm(g, false, false, c, D, c, 1.0f, tmp, c, W, D, 1.0f, dW, D);
        }
        delete[] dl; delete[] dqw; delete[] da; delete[] x; delete[] dt; delete[] tmp; delete[] wb; delete[] gb;
        delete[] ab; delete[] dg;
    }
}

// Adds the gate's bias c_i - c_j to scores z [rows, cols] (ld) of queries with gates cq [rows] and keys ck [cols].
static void add_gate(float* z, int rows, int cols, int ld, const float* cq, const float* ck) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < cols; ++j) z[r * ld + j] += cq[r] - ck[j];
}

// Merged block q of a head (q = p * heads + h): its earlier block e and later block o, as the layout indexes them.
static inline void pair_of(int64_t q, int64_t heads, int64_t* e, int64_t* o) {
    const int64_t p = q / heads, h = q % heads;
    *e = 2 * p * heads + h;
    *o = (2 * p + 1) * heads + h;
}

// body(q, e, o) for each merged block q of the n / 2 * heads (its earlier block e and later o: pair_of), OpenMP
// threads over them: fa_path_merge's and its backward's loop.
template <typename Body>
static void each_merged_pair(int64_t n, int64_t heads, int threads, Body body) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 2)
    for (int64_t q = 0; q < n / 2 * heads; ++q) {
        int64_t e, o;
        pair_of(q, heads, &e, &o);
        body(q, e, o);
    }
}

// One level of PaTH's block merge (path.py's _merged_terms), blocks in pairs of each head (the earlier e = 2p, the
// later o = 2p + 1; block b of head h at b * heads + h): local [n, heads, C, C], carried and k_end [n, heads, C, D],
// m [n, heads, D, D] give local2 [n / 2, heads, 2C, 2C] (e's and o's own scores on the diagonal, -inf above, the
// corner carried_o k_end_e^T below), carried2 [n / 2, heads, 2C, D] (e's, then o's carried on through M_e: q M_e),
// k_end2 (e's carried on through M_o: k M_o^T, then o's) and m2 = M_o M_e.
extern "C" void fa_path_merge(const float* local, const float* carried, const float* k_end, const float* m,
                              float* local2, float* carried2, float* k_end2, float* m2, int64_t n, int64_t heads,
                              int64_t cc, int64_t dd, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int C = (int)cc, D = (int)dd, C2 = 2 * C;
    each_merged_pair(n, heads, threads, [&](int64_t q, int64_t e, int64_t o) {
        float* l2 = local2 + q * C2 * C2;
        for (int r = 0; r < C; ++r) {
            memcpy(l2 + r * C2, local + e * C * C + r * C, C * sizeof(float));
            for (int j = C; j < C2; ++j) l2[r * C2 + j] = -INFINITY;
            memcpy(l2 + (C + r) * C2 + C, local + o * C * C + r * C, C * sizeof(float));
        }
        mm(g, false, true, C, C, D, 1.0f, carried + o * C * D, D, k_end + e * C * D, D, 0.0f, l2 + C * C2, C2);
        memcpy(carried2 + q * C2 * D, carried + e * C * D, (size_t)C * D * sizeof(float));
        mm(g, false, false, C, D, D, 1.0f, carried + o * C * D, D, m + e * D * D, D, 0.0f, carried2 + q * C2 * D + C * D, D);
        mm(g, false, true, C, D, D, 1.0f, k_end + e * C * D, D, m + o * D * D, D, 0.0f, k_end2 + q * C2 * D, D);
        memcpy(k_end2 + q * C2 * D + C * D, k_end + o * C * D, (size_t)C * D * sizeof(float));
        mm(g, false, false, D, D, D, 1.0f, m + o * D * D, D, m + e * D * D, D, 0.0f, m2 + q * D * D, D);
    });
}

// fa_path_merge's backward: the gradients of its inputs (written whole) from those of its outputs.
extern "C" void fa_path_merge_backward(const float* carried, const float* k_end, const float* m, const float* d_local2,
                                       const float* d_carried2, const float* d_k_end2, const float* d_m2, float* d_local,
                                       float* d_carried, float* d_k_end, float* d_m, int64_t n, int64_t heads,
                                       int64_t cc, int64_t dd, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int C = (int)cc, D = (int)dd, C2 = 2 * C;
    each_merged_pair(n, heads, threads, [&](int64_t q, int64_t e, int64_t o) {
        const float* dl2 = d_local2 + q * C2 * C2;
        const float* corner = dl2 + C * C2;  // [C, C], leading dimension 2C
        const float *dc2 = d_carried2 + q * C2 * D, *dk2 = d_k_end2 + q * C2 * D, *dm2 = d_m2 + q * D * D;
        const float *co = carried + o * C * D, *ke = k_end + e * C * D;
        const float *me = m + e * D * D, *mo = m + o * D * D;
        for (int r = 0; r < C; ++r) {
            memcpy(d_local + e * C * C + r * C, dl2 + r * C2, C * sizeof(float));
            memcpy(d_local + o * C * C + r * C, dl2 + (C + r) * C2 + C, C * sizeof(float));
        }
        memcpy(d_carried + e * C * D, dc2, (size_t)C * D * sizeof(float));
        memcpy(d_k_end + o * C * D, dk2 + C * D, (size_t)C * D * sizeof(float));
        float* dco = d_carried + o * C * D;  // corner k_end_e + dcarried2_o M_e^T
        mm(g, false, false, C, D, C, 1.0f, corner, C2, ke, D, 0.0f, dco, D);
        mm(g, false, true, C, D, D, 1.0f, dc2 + C * D, D, me, D, 1.0f, dco, D);
        float* dke = d_k_end + e * C * D;    // corner^T carried_o + dk_end2_e M_o
        mm(g, true, false, C, D, C, 1.0f, corner, C2, co, D, 0.0f, dke, D);
        mm(g, false, false, C, D, D, 1.0f, dk2, D, mo, D, 1.0f, dke, D);
        float* dme = d_m + e * D * D;        // carried_o^T dcarried2_o + M_o^T dm2
        mm(g, true, false, D, D, C, 1.0f, co, D, dc2 + C * D, D, 0.0f, dme, D);
        mm(g, true, false, D, D, D, 1.0f, mo, D, dm2, D, 1.0f, dme, D);
        float* dmo = d_m + o * D * D;        // dk_end2_e^T k_end_e + dm2 M_e^T
        mm(g, true, false, D, D, C, 1.0f, dk2, D, ke, D, 0.0f, dmo, D);
        mm(g, false, true, D, D, D, 1.0f, dm2, D, me, D, 1.0f, dmo, D);
    });
}

// PaTH's training sweep (path.py's _TrainingSweep), forward, per head: blocks of C tokens, the layouts [n, heads, ...]
// (block m of head h at (m * heads + h)): local [n, heads, C, C] (the blocks' own scores, gate and padding applied,
// -inf where masked), carried and k_end [n, heads, C, D], v [n, heads, C, Dv], gate [n, heads, C] (the cumulative
// log gates, or null), pad [n, heads / per_batch, C] (nonzero at padded keys, or null), m [n, heads, D, D] (the
// blocks' products).  Query block m scores its own block (local) and each earlier block e with its queries carried
// to e's end (Q_{m,m-1} = carried_m, Q_{m,e} = Q_{m,e+1} M_{e+1}), the gate's c_i - c_j added; the softmax over
// all of them at once (each row's largest score first; a shifted score at or below -87 weighs 0).  Writes out [n,
// heads, C, Dv], inverse [n, heads, C] (1 / each row's sum, 0 for a row without a key), and for the backward
// weights [heads, n (n + 1) / 2, C, C] (query block m's steps from m(m+1)/2: its own block, then e = m - 1 .. 0)
// and queries [heads, n (n - 1) / 2, C, D] (Q_{m,e} for e = m - 1 .. 0, from m(m-1)/2).
extern "C" void fa_path_sweep_forward(const float* local, const float* carried, const float* k_end, const float* v,
                                      const float* gate, const uint8_t* pad, const float* m_blocks, float* out,
                                      float* inverse, float* weights, float* queries, int64_t n, int64_t heads,
                                      int64_t per_batch, int64_t C, int64_t D, int64_t Dv, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int c = (int)C, d = (int)D, dv = (int)Dv;
    const int64_t pairs = n * (n + 1) / 2, carries = n * (n - 1) / 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && heads > 1)
    {
        float* top = new float[C];
        float* total = new float[C];
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t b = h / per_batch;
            for (int64_t m = 0; m < n; ++m) {
                const int64_t at = m * heads + h;
                float* P = weights + (h * pairs + m * (m + 1) / 2) * C * C;
                float* Qs = queries + (h * carries + m * (m - 1) / 2) * C * D;
                memcpy(P, local + at * C * C, (size_t)C * C * sizeof(float));
                for (int64_t s = 1; s <= m; ++s) {
                    const int64_t e = m - s, ae = e * heads + h;
                    float* Q = Qs + (s - 1) * C * D;
                    if (s == 1) memcpy(Q, carried + at * C * D, (size_t)C * D * sizeof(float));
                    else mm(g, false, false, c, d, d, 1.0f, Q - C * D, d, m_blocks + (ae + heads) * D * D, d, 0.0f, Q, d);
                    float* z = P + s * C * C;
                    mm(g, false, true, c, c, d, 1.0f, Q, d, k_end + ae * C * D, d, 0.0f, z, c);
                    if (gate) add_gate(z, c, c, c, gate + at * C, gate + ae * C);
                    if (pad) {
                        const uint8_t* pe = pad + (e * (heads / per_batch) + b) * C;
                        for (int64_t j = 0; j < C; ++j)
                            if (pe[j]) for (int64_t r = 0; r < C; ++r) z[r * C + j] = -INFINITY;
                    }
                }
                for (int64_t r = 0; r < C; ++r) { top[r] = -INFINITY; total[r] = 0.0f; }
                for (int64_t s = 0; s <= m; ++s)
                    for (int64_t r = 0; r < C; ++r) {
                        const float* zr = P + s * C * C + r * C;
                        float t = top[r];
                        for (int64_t j = 0; j < C; ++j) t = zr[j] > t ? zr[j] : t;
                        top[r] = t;
                    }
                for (int64_t r = 0; r < C; ++r) if (top[r] == -INFINITY) top[r] = 0.0f;  // a row without a key
                float* o = out + at * C * Dv;
                for (int64_t s = 0; s <= m; ++s) {
                    float* z = P + s * C * C;
                    for (int64_t r = 0; r < C; ++r) total[r] += shifted_exp(z + r * C, C, top[r]);
                    const int64_t ae = (m - s) * heads + h;
                    mm(g, false, false, c, dv, c, 1.0f, z, c, v + ae * C * Dv, dv, s ? 1.0f : 0.0f, o, dv);
                }
                float* inv = inverse + at * C;
                for (int64_t r = 0; r < C; ++r) {
                    inv[r] = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
                    for (int64_t t = 0; t < Dv; ++t) o[r * Dv + t] *= inv[r];
                }
            }
        }
        delete[] top; delete[] total;
    }
}

// fa_path_sweep_forward's backward, per head: the softmax's (dS = P (dP - rowsum(dO O)), 1 / sum folded into dO),
// then each query block's gradient carried back along the blocks its queries went through (g_{m,0} = dQ_{m,0};
// dM_e += Q_{m,e}^T g_{m,e-1}, g_{m,e} = dQ_{m,e} + g_{m,e-1} M_e^T; dcarried_m = g_{m,m-1}).  d_out [n, heads, C,
// Dv]; writes d_local [n, heads, C, C] and adds into d_carried, d_k_end [n, heads, C, D], d_v [n, heads, C, Dv],
// d_gate [n, heads, C] (may be null: the gate of the steps between blocks; the blocks' own scores' gate is
// local's) and d_m [n, heads, D, D], all zeroed by the caller.
extern "C" void fa_path_sweep_backward(const float* d_out, const float* out, const float* inverse,
                                       const float* weights, const float* queries, const float* k_end,
                                       const float* v, const float* m_blocks, float* d_local, float* d_carried,
                                       float* d_k_end, float* d_v, float* d_gate, float* d_m, int64_t n,
                                       int64_t heads, int64_t C, int64_t D, int64_t Dv, int threads, void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int c = (int)C, d = (int)D, dv = (int)Dv;
    const int64_t pairs = n * (n + 1) / 2, carries = n * (n - 1) / 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && heads > 1)
    {
        float* dos = new float[C * Dv];
        float* delta = new float[C];
        float* ds = new float[C * C];
        float* dq = new float[(n > 1 ? n - 1 : 1) * C * D];  // dQ_{m,e} of every step e < m
        float* gr = new float[C * D];
        float* spare = new float[C * D];
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < heads; ++h) {
            for (int64_t m = 0; m < n; ++m) {
                const int64_t at = m * heads + h;
                const float* P = weights + (h * pairs + m * (m + 1) / 2) * C * C;
                const float* Qs = queries + (h * carries + m * (m - 1) / 2) * C * D;
                const float *dO = d_out + at * C * Dv, *O = out + at * C * Dv, *inv = inverse + at * C;
                for (int64_t r = 0; r < C; ++r) {
                    float s = 0.0f;
                    for (int64_t t = 0; t < Dv; ++t) {
                        s += dO[r * Dv + t] * O[r * Dv + t];
                        dos[r * Dv + t] = dO[r * Dv + t] * inv[r];
                    }
                    delta[r] = s * inv[r];
                }
                for (int64_t s = 0; s <= m; ++s) {
                    const int64_t e = m - s, ae = e * heads + h;
                    const float* W = P + s * C * C;
                    mm(g, true, false, c, dv, c, 1.0f, W, c, dos, dv, 1.0f, d_v + ae * C * Dv, dv);   // dV += P^T dO
                    float* dS = s ? ds : d_local + at * C * C;
                    mm(g, false, true, c, c, dv, 1.0f, dos, dv, v + ae * C * Dv, dv, 0.0f, dS, c);    // dP = dO V^T
                    for (int64_t r = 0; r < C; ++r)
                        for (int64_t j = 0; j < C; ++j) dS[r * C + j] = W[r * C + j] * (dS[r * C + j] - delta[r]);
                    if (!s) continue;
                    const float* Q = Qs + (s - 1) * C * D;
                    mm(g, false, false, c, d, c, 1.0f, dS, c, k_end + ae * C * D, d, 0.0f, dq + e * C * D, d);
                    mm(g, true, false, c, d, c, 1.0f, dS, c, Q, d, 1.0f, d_k_end + ae * C * D, d);
                    if (d_gate) {
                        float* cq = d_gate + at * C;
                        float* ck = d_gate + ae * C;
                        for (int64_t r = 0; r < C; ++r)
                            for (int64_t j = 0; j < C; ++j) { cq[r] += dS[r * C + j]; ck[j] -= dS[r * C + j]; }
                    }
                }
                if (!m) continue;
                memcpy(gr, dq, (size_t)C * D * sizeof(float));  // g_{m,0}
                for (int64_t e = 1; e < m; ++e) {
                    const float* Q = Qs + (m - e - 1) * C * D;  // Q_{m,e}: step s = m - e
                    const int64_t ae = e * heads + h;
                    mm(g, true, false, d, d, c, 1.0f, Q, d, gr, d, 1.0f, d_m + ae * D * D, d);   // dM_e += Q^T g
                    memcpy(spare, dq + e * C * D, (size_t)C * D * sizeof(float));
                    mm(g, false, true, c, d, d, 1.0f, gr, d, m_blocks + ae * D * D, d, 1.0f, spare, d);  // + g M_e^T
                    memcpy(gr, spare, (size_t)C * D * sizeof(float));
                }
                float* dc = d_carried + at * C * D;
                for (int64_t i = 0; i < C * D; ++i) dc[i] += gr[i];
            }
        }
        delete[] dos; delete[] delta; delete[] ds; delete[] dq; delete[] gr; delete[] spare;
    }
}

// PaTH's w without a gradient (path.py's PathProjections: causal_convolution, SiLU, unit length) in one pass:
// u [B, T, H D] (the projections as the linear layer gives them; batch head i = b H + h reads u[b, :, h D : h D +
// D] and model head h), taps [K, H D] (nn.Conv1d's weight transposed), prefix [B H, K - 1, D] (the K - 1 inputs
// before the first token; null: zeros); writes w [B H, T, D]: y = sum_k taps[k, h D + d] u[t + k - (K - 1), d] (the
// nearest input first, as causal_convolution sums), silu(y) = y / (1 + exp(-y)), w = silu(y) / sqrt(|silu(y)|^2 +
// eps).  The eager path's copy into [B, H, T, D] and its five passes over u (and their tensors) are one pass.
extern "C" void fa_path_w(const float* u, const float* taps, const float* prefix, float* w, int64_t heads,
                          int64_t model_heads, int64_t T, int64_t D, int64_t K, float eps, int threads) {
    const int64_t HD = model_heads * D;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && heads > 1)
    for (int64_t h = 0; h < heads; ++h) {
        const float* uh = u + (h / model_heads) * T * HD + (h % model_heads) * D;  // token t's row: uh + t * HD
        const float* ph = prefix ? prefix + h * (K - 1) * D : nullptr;
        const float* th = taps + (h % model_heads) * D;  // tap k of channel d: th[k * HD + d]
        float* wh = w + h * T * D;
        for (int64_t t = 0; t < T; ++t) {
            float* y = wh + t * D;
            for (int64_t d = 0; d < D; ++d) y[d] = 0.0f;
            for (int64_t k = K - 1; k >= 0; --k) {
                const int64_t i = t + k - (K - 1);  // the input tap k reads
                const float* x = i >= 0 ? uh + i * HD : ph ? ph + (K - 1 + i) * D : nullptr;
                if (!x) continue;
                const float* tk = th + k * HD;
                for (int64_t d = 0; d < D; ++d) y[d] += tk[d] * x[d];
            }
            vf squares = {};
            int64_t d = 0;
            for (; d + WIDTH <= D; d += WIDTH) {
                vf v;
                memcpy(&v, y + d, sizeof v);
                v = v / (1.0f + fexp<vf, vi>(-v));
                memcpy(y + d, &v, sizeof v);
                squares += v * v;
            }
            float norm = 0.0f;
            for (int l = 0; l < WIDTH; ++l) norm += squares[l];
            for (; d < D; ++d) {
                v1f a = {-y[d]};
                y[d] = y[d] / (1.0f + fexp<v1f, v1i>(a)[0]);
                norm += y[d] * y[d];
            }
            const float scale = 1.0f / sqrtf(norm + eps);
            for (d = 0; d < D; ++d) y[d] *= scale;
        }
    }
}

// PaTH's attention without a gradient or padding (path.py's _by_chunks and _sweep, in one call):
// per head, `chunk` tokens at a time in blocks of `block`: each block's compact form (path_block), then each
// query block's online softmax over its own block, the earlier blocks of its chunk from the nearest back (its
// queries carried through each block's product on the way), and every key before the chunk (the cache, kept
// carried to the chunk's start) in blocks of `key_block`; then the cache carried through the chunk (one D x D
// product per key: the chunk's block products multiplied first) and the chunk's keys appended, carried to its
// end.  q, k, w [heads, T, D] (q scaled), beta [heads, T], values [heads, S0 + T, Dv] (the cache's and the new
// ones), keys [heads, S0 + T, D]: the cache's S0 keys in, every key carried through the T new tokens out (the
// last chunk's step only where carry_last: else the keys are left as the last chunk read them); out [heads, T, Dv].
// gate [heads, S0 + T] (PaTH-FoX's cumulative log gates c, scaled as the scores are; may be null) adds c_i - c_j
// to every score, and leaves out the first cached keys that weigh less than exp(-gap) of every row's largest
// weight so far (path.py's _forgotten: gap = log(keys) + gap_base); skipped [heads] (may be null): the (query,
// cached key) pairs each head left out, summed over its chunks.
extern "C" void fa_path_forward(const float* q, const float* k, const float* w, const float* beta, const float* values,
                                const float* gate, float gap_base, float* keys, float* out, int64_t* skipped,
                                int64_t heads, int64_t T, int64_t S0, int64_t D, int64_t Dv, int64_t block,
                                int64_t chunk, int64_t query_block, int64_t key_block, int carry_last, int threads,
                                void* gemm) {
    const sgemm_t g = (sgemm_t)gemm;
    const int c = (int)block, d = (int)D, dv = (int)Dv;
    const int64_t most = (chunk + block - 1) / block;  // blocks per chunk
    const int64_t S = S0 + T;
#pragma omp parallel num_threads(threads) if (threads > 1 && heads > 1)
    {
        float* qc = new float[most * c * D];      // each block's queries carried to its start
        float* ke = new float[most * c * D];      // each block's keys carried to its end
        float* prod = new float[most * D * D];    // each block's product
        float* loc = new float[most * c * c];     // each block's own scores
        float* in = new float[3 * c * D + c];     // one block's q, k, w and beta, zero past the end
        float* work = new float[4 * c * c + 2 * c * D];
        const int64_t width = key_block > c ? key_block : c;
        float* z = new float[(query_block > c ? query_block : c) * width];
        float* qa = new float[most * c * D];     // the chunk's queries, carried to its start
        float* qb = new float[c * D];
        float* o = new float[most * c * Dv];     // the chunk's outputs, unnormalized
        float* top = new float[most * c];
        float* total = new float[most * c];
        float* after = new float[D * D];
        float* spare = new float[(width > D ? width : D) * D];
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < heads; ++h) {
            const float* qh = q + h * T * D;
            const float* kh = k + h * T * D;
            const float* wh = w + h * T * D;
            const float* bh = beta + h * T;
            const float* vh = values + h * S * Dv;
            float* keys_h = keys + h * S * D;
            float* oh = out + h * T * Dv;
            const float* ch = gate ? gate + h * S : nullptr;  // every token's gate, the cache's first
            int64_t pairs_skipped = 0;
            for (int64_t s = 0; s < T; s += chunk) {
                const int64_t len = T - s < chunk ? T - s : chunk;
                const int64_t nb = (len + c - 1) / c;
                const int64_t past = S0 + s;  // keys before the chunk, carried to its start
                for (int64_t b = 0; b < nb; ++b) {
                    const int64_t first = s + b * c, rows = len - b * c < c ? len - b * c : c;
                    float *qi = in, *ki = in + c * D, *wi = in + 2 * c * D, *bi = in + 3 * c * D;
                    memset(in, 0, (3 * c * D + c) * sizeof(float));
                    memcpy(qi, qh + first * D, rows * D * sizeof(float));
                    memcpy(ki, kh + first * D, rows * D * sizeof(float));
                    memcpy(wi, wh + first * D, rows * D * sizeof(float));
                    memcpy(bi, bh + first, rows * sizeof(float));
                    path_block(g, c, d, qi, ki, wi, bi, loc + b * c * c, qc + b * c * D, ke + b * c * D,
                               prod + b * D * D, work);
                }
                for (int64_t m = 0; m < nb; ++m) {  // each query block within the chunk
                    const int rows = (int)(len - m * c < c ? len - m * c : c);
                    const float* vm = vh + (past + m * c) * Dv;
                    float *tm = top + m * c, *sm = total + m * c, *om = o + m * c * Dv, *qm = qa + m * c * D;
                    for (int r = 0; r < rows; ++r) { tm[r] = -INFINITY; sm[r] = 0.0f; }
                    memset(om, 0, rows * Dv * sizeof(float));
                    for (int r = 0; r < rows; ++r) memcpy(z + r * rows, loc + m * c * c + r * c, rows * sizeof(float));
                    const float* cm = ch ? ch + past + m * c : nullptr;  // the block's queries' gates
                    if (ch) add_gate(z, rows, rows, rows, cm, cm);
                    softmax_rows(z, rows, rows, rows, tm, sm, om, Dv);
                    mm(g, false, false, rows, dv, rows, 1.0f, z, rows, vm, dv, 1.0f, om, dv);
                    memcpy(qm, qc + m * c * D, rows * D * sizeof(float));
                    for (int64_t e = m - 1; e >= 0; --e) {  // the chunk's earlier blocks, nearest first
                        mm(g, false, true, rows, c, d, 1.0f, qm, d, ke + e * c * D, d, 0.0f, z, c);
                        if (ch) add_gate(z, rows, c, c, cm, ch + past + e * c);
                        softmax_rows(z, rows, c, c, tm, sm, om, Dv);
                        mm(g, false, false, rows, dv, c, 1.0f, z, c, vh + (past + e * c) * Dv, dv, 1.0f, om, dv);
                        if (e || past) {  // on to the end of block e - 1 (or the chunk's start)
                            mm(g, false, false, rows, d, d, 1.0f, qm, d, prod + e * D * D, d, 0.0f, qb, d);
                            memcpy(qm, qb, rows * D * sizeof(float));
                        }
                    }
                }
                // every query of the chunk, carried to its start, against the keys before it: with the gate, from
                // the first key that is not negligible for some row.  A carried query or key is no longer than it
                // was (PaTH's eigenvalues are 1 and 1 - beta), so a score is at most |q| max |k|: key j weighs
                // less than exp(-gap) of row r's largest weight where c_r - c_j + |q_r| max |k| < top_r - gap.
                int64_t first = 0;
                if (ch && past) {
                    float reach = 0.0f, allowance = -INFINITY;
                    for (int64_t j = 0; j < past; ++j) {
                        float n = 0.0f;
                        for (int64_t t = 0; t < D; ++t) n += keys_h[j * D + t] * keys_h[j * D + t];
                        reach = n > reach ? n : reach;
                    }
                    reach = sqrtf(reach);
                    for (int64_t r = 0; r < len; ++r) {
                        float n = 0.0f;
                        for (int64_t t = 0; t < D; ++t) n += qa[r * D + t] * qa[r * D + t];
                        const float a = ch[past + r] + sqrtf(n) * reach - top[r];
                        allowance = a > allowance ? a : allowance;
                    }
                    const float bound = allowance + (logf((float)(past + len)) + gap_base);
                    while (first < past && ch[first] > bound) ++first;
                }
                pairs_skipped += len * first;
                for (int64_t r0 = 0; r0 < len; r0 += query_block) {
                    const int rows = (int)(len - r0 < query_block ? len - r0 : query_block);
                    for (int64_t j0 = first; j0 < past; j0 += key_block) {
                        const int cols = (int)(past - j0 < key_block ? past - j0 : key_block);
                        mm(g, false, true, rows, cols, d, 1.0f, qa + r0 * D, d, keys_h + j0 * D, d, 0.0f, z, cols);
                        if (ch) add_gate(z, rows, cols, cols, ch + past + r0, ch + j0);
                        softmax_rows(z, rows, cols, cols, top + r0, total + r0, o + r0 * Dv, Dv);
                        mm(g, false, false, rows, dv, cols, 1.0f, z, cols, vh + j0 * Dv, dv, 1.0f, o + r0 * Dv, dv);
                    }
                }
                float* dst = oh + s * Dv;
                for (int64_t r = 0; r < len; ++r) {
                    const float inv = 1.0f / total[r];
                    for (int64_t t = 0; t < Dv; ++t) dst[r * Dv + t] = o[r * Dv + t] * inv;
                }
                if (s + len >= T && !carry_last) continue;
                // the chunk's keys carried to its end: block m's through the products of blocks m + 1 .. nb - 1
                // (a key row goes through a block as k M^T), then the cache through all of them
                for (int64_t i = 0; i < D * D; ++i) after[i] = 0.0f;
                for (int64_t i = 0; i < D; ++i) after[i * D + i] = 1.0f;
                for (int64_t m = nb - 1; m >= 0; --m) {
                    const int rows = (int)(len - m * c < c ? len - m * c : c);
                    mm(g, false, false, rows, d, d, 1.0f, ke + m * c * D, d, after, d, 0.0f,
                       keys_h + (past + m * c) * D, d);
                    if (m || past) {
                        mm(g, true, false, d, d, d, 1.0f, prod + m * D * D, d, after, d, 0.0f, spare, d);
                        memcpy(after, spare, D * D * sizeof(float));
                    }
                }
                for (int64_t j0 = 0; j0 < past; j0 += width) {
                    const int cols = (int)(past - j0 < width ? past - j0 : width);
                    mm(g, false, false, cols, d, d, 1.0f, keys_h + j0 * D, d, after, d, 0.0f, spare, d);
                    memcpy(keys_h + j0 * D, spare, cols * D * sizeof(float));
                }
            }
            if (skipped) skipped[h] = pairs_skipped;
        }
        delete[] qc; delete[] ke; delete[] prod; delete[] loc; delete[] in; delete[] work; delete[] z;
        delete[] qa; delete[] qb; delete[] o; delete[] top; delete[] total; delete[] after; delete[] spare;
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
    library.fa_sgemm_probe.restype = None
    library.fa_sgemm_probe.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4
    library.fa_fire_forward.restype = None
    library.fa_fire_forward.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
                                        + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 7
                                        + [ctypes.c_int, ctypes.c_void_p])
    library.fa_path_forward.restype = None
    library.fa_path_forward.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 3
                                        + [ctypes.c_int64] * 9 + [ctypes.c_int] * 2 + [ctypes.c_void_p])
    library.fa_path_w.restype = None
    library.fa_path_w.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    library.fa_path_block_terms.restype = None
    library.fa_path_block_terms.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 3 + [ctypes.c_int,
                                                                                           ctypes.c_void_p]
    library.fa_path_block_terms_backward.restype = None
    library.fa_path_block_terms_backward.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_int64] * 3 + [
        ctypes.c_int, ctypes.c_void_p]
    library.fa_path_sweep_forward.restype = None
    library.fa_path_sweep_forward.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 6 + [ctypes.c_int,
                                                                                             ctypes.c_void_p]
    library.fa_path_sweep_backward.restype = None
    library.fa_path_sweep_backward.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_int64] * 5 + [ctypes.c_int,
                                                                                              ctypes.c_void_p]
    library.fa_path_merge.restype = None
    library.fa_path_merge.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_void_p]
    library.fa_path_merge_backward.restype = None
    library.fa_path_merge_backward.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 4 + [ctypes.c_int,
                                                                                              ctypes.c_void_p]
    library.fa_stickbreaking_forward.restype = None
    library.fa_stickbreaking_forward.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
                                                 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
    return library


#: The values of :data:`SWITCH` (any case), off and on.
OFF, ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes", "")


def switched_on() -> bool:
    """:data:`SWITCH` read: unset or one of :data:`ON` lets the fused calls run, one of :data:`OFF` switches
    them off; ``ConfigError`` for anything else (a typo must not leave them on unnoticed)."""
    value = os.environ.get(SWITCH, "1").strip().lower()
    if value not in OFF + ON:
        raise ConfigError(f"{SWITCH}={os.environ[SWITCH]!r} is not valid: set it to 0 (or false, off, no) to run "
                          "the eager PyTorch paths instead of the fused CPU calls, to 1 (or true, on, yes) or unset "
                          "it to let them run")
    return value not in OFF


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None where it is switched off or cannot be built (:func:`status` says
    why; the first failure is logged once as a warning)."""
    if not switched_on():
        _state["why"] = f"switched off ({SWITCH}={os.environ[SWITCH]})"
        return None
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["library"], _state["why"] = _build(), "built"
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _state["why"] = f"not available: {error}"
            logger.warning("fused CPU loops %s; the eager PyTorch kernels run instead", _state["why"])
    return _state["library"]


def _sgemm_address() -> Optional[int]:
    """The address of the BLAS ``sgemm`` (Fortran's ``sgemm_``) in torch's own CPU library, already loaded
    (``RTLD_NOLOAD``: nothing new is loaded or run), or None where it has none: the products the fused
    forward takes are then torch's calls instead."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        torch_cpu = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ctypes.cast(torch_cpu.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def status() -> str:
    """One line: whether the fused loops run, and why not where they do not."""
    return "built" if library() is not None else _state["why"]


def _sgemm_works(address: int) -> bool:
    """Whether ``sgemm`` at ``address`` computes the forwards' two products as torch does (a BLAS whose
    integers are 64-bit, or another convention, would give wrong numbers with no error): one small case of
    each, against torch's products, within float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    rows, cols, d, dv = 5, 7, 3, 4
    q, k, v = (torch.randn(n, m, generator=gen) for n, m in ((rows, d), (cols, d), (cols, dv)))
    start = torch.randn(rows, dv, generator=gen)
    z, o = torch.empty(cols, rows), start.clone()
    library().fa_sgemm_probe(address, q.data_ptr(), k.data_ptr(), v.data_ptr(), z.data_ptr(), o.data_ptr(),
                             rows, cols, d, dv)
    want_z = k.double() @ q.double().t()
    return bool(torch.allclose(z.double(), want_z, rtol=1e-5, atol=1e-5)) and bool(
        torch.allclose(o.double(), start.double() + want_z.t() @ v.double(), rtol=1e-5, atol=1e-5))


def runs_for(t: Tensor) -> bool:
    """Whether the fused calls serve tensors like ``t``: on the CPU, not float64 (the tests' exact oracle;
    any other dtype is computed in float32), and :func:`forward_available`."""
    return t.device.type == "cpu" and t.dtype != torch.float64 and forward_available()


def forward_available() -> bool:
    """Whether the fused forwards (:func:`stickbreaking_forward`, :func:`fire_forward`) run here: the library
    loaded, torch's ``sgemm`` found, and its products checked once (:func:`_sgemm_works`; a failed check is
    logged as a warning, and the callers' other paths run)."""
    if library() is None:
        return False
    if "sgemm" not in _state:
        address = _sgemm_address()
        if address is not None and not _sgemm_works(address):
            logger.warning("torch's sgemm at %s does not compute the fused forwards' products as torch does; "
                           "the fused forwards are switched off", hex(address))
            address = None
        _state["sgemm"] = address
    return _state["sgemm"] is not None


def _pointer(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _check(name: str, t: Tensor, shape) -> None:
    """Every fused call's tensor argument: float32, contiguous, on the CPU, of ``shape``; else ValueError."""
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != tuple(shape) or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {tuple(shape)}, "
                         f"not {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})")


def _check_pad(pad: Optional[Tensor], shape) -> None:
    """A padding mask, where given: contiguous uint8 (nonzero at padding) of ``shape``."""
    if pad is not None and (pad.dtype != torch.uint8 or not pad.is_contiguous() or tuple(pad.shape) != tuple(shape)):
        raise ValueError(f"pad must be a contiguous uint8 tensor of shape {tuple(shape)}")


def stickbreaking_terms(z: Tensor, w: Tensor, kept: Tensor, pad: Optional[Tensor], base: int) -> None:
    """Stick-breaking's loop alone, on one block of every head (the C++ ``fa_stickbreaking_terms``; the fused
    forward runs the same loop, and the tests check it through this): ``z`` and ``w`` ``[heads, cols, rows]``
    (scores in, weights out; ``w`` may be ``z``), ``kept`` ``[heads, rows]`` (in place), ``pad`` ``[heads,
    cols]`` uint8 or None; all float32, contiguous, on the CPU; query ``r`` sees key ``c`` where ``c >= base -
    r``."""
    heads, cols, rows = z.shape
    for name, t, shape in (("z", z, (heads, cols, rows)), ("w", w, (heads, cols, rows)),
                           ("kept", kept, (heads, rows))):
        _check(name, t, shape)
    _check_pad(pad, (heads, cols))
    library().fa_stickbreaking_terms(z.data_ptr(), w.data_ptr(), kept.data_ptr(), _pointer(pad),
                                     heads, cols, rows, base, torch.get_num_threads())


def stickbreaking_forward(q: Tensor, k: Tensor, v: Tensor, pad: Optional[Tensor], block: int, key_block: int,
                          floor: float) -> Tuple[Tensor, Tensor, int]:
    """Stick-breaking's forward without a gradient in one call (the C++ ``fa_stickbreaking_forward``, where
    :func:`forward_available`): ``(out [heads, T, Dv], remainders [heads, T], pairs scored)`` of the scaled
    queries ``q`` ``[heads, T, D]`` (the last ``T`` of the ``S`` keys), keys ``k`` ``[heads, S, D]`` and
    values ``v`` ``[heads, S, Dv]`` reversed along the keys, ``pad`` ``[heads, S]`` (uint8, reversed alike)
    or None; float32, contiguous, on the CPU.  ``block`` queries by ``key_block`` keys at a time; a head's
    query block stops reading keys once every query's stick is below ``floor``."""
    heads, T, D = q.shape
    S, Dv = k.size(1), v.size(-1)
    for name, t, shape in (("q", q, (heads, T, D)), ("k", k, (heads, S, D)), ("v", v, (heads, S, Dv))):
        _check(name, t, shape)
    _check_pad(pad, (heads, S))
    if block < 1 or key_block < 1 or S < T or max(heads, T, S, D, Dv, block * key_block) >= 2 ** 31:
        raise ValueError(f"block {block} and key_block {key_block} must be at least 1, S {S} at least T {T}, "
                         "and every size below 2^31 (BLAS's 32-bit sizes)")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")
    out, rem = SCRATCH.take((heads, T, Dv)), SCRATCH.take((heads, T))
    scored = torch.zeros(heads, dtype=torch.int64)
    library().fa_stickbreaking_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(pad), out.data_ptr(),
                                       rem.data_ptr(), scored.data_ptr(), heads, T, S, D, Dv, block, key_block,
                                       floor, torch.get_num_threads(), _state["sgemm"])
    return out, rem, int(scored.sum())


def fire_forward(q: Tensor, k: Tensor, v: Tensor, pad: Optional[Tensor], psi: Tensor, norm: Tensor, knots: Tensor,
                 slopes: Tensor, intercepts: Tensor, block: int, key_block: int) -> Tensor:
    """FIRE's attention without a gradient in one call (the C++ ``fa_fire_forward``, where
    :func:`forward_available`): ``out [heads, T, Dv]`` of the scaled queries ``q`` ``[heads, T, D]`` (the last
    ``T`` of the ``S`` keys), keys ``k`` ``[heads, S, D]``, values ``v`` ``[heads, S, Dv]``, ``pad`` ``[heads,
    S]`` (uint8) or None; FIRE's tables (``fire.Fire.fused_tables``): ``psi`` ``[S]`` per distance, ``norm``
    ``[T]`` per query, ``knots`` ``[n]``, ``slopes`` and ``intercepts`` ``[H, n + 1]`` per head of the model
    (batch head ``h`` reads row ``h % H``); float32, contiguous, on the CPU; ``block`` queries by ``key_block``
    keys at a time."""
    heads, T, D = q.shape
    S, Dv = k.size(1), v.size(-1)
    H, pieces = slopes.shape
    shapes = (("q", q, (heads, T, D)), ("k", k, (heads, S, D)), ("v", v, (heads, S, Dv)), ("psi", psi, (S,)),
              ("norm", norm, (T,)), ("knots", knots, (pieces - 1,)), ("slopes", slopes, (H, pieces)),
              ("intercepts", intercepts, (H, pieces)))
    for name, t, shape in shapes:
        _check(name, t, shape)
    _check_pad(pad, (heads, S))
    if block < 1 or key_block < 1 or S < T or heads % H or max(heads, T, S, D, Dv, block * key_block) >= 2 ** 31:
        raise ValueError(f"block {block} and key_block {key_block} must be at least 1, S {S} at least T {T}, the "
                         f"heads {heads} a multiple of the model's {H}, and every size below 2^31")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")
    out = SCRATCH.take((heads, T, Dv))
    library().fa_fire_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(pad), psi.data_ptr(),
                              norm.data_ptr(), knots.data_ptr(), pieces - 1, slopes.data_ptr(), intercepts.data_ptr(),
                              H, out.data_ptr(), heads, T, S, D, Dv, block, key_block, torch.get_num_threads(),
                              _state["sgemm"])
    return out


def path_w(u: Tensor, taps: Tensor, heads: int, prefix: Optional[Tensor], eps: float) -> Tensor:
    """PaTH's ``w`` ``[B H, T, D]`` without a gradient in one pass (the C++ ``fa_path_w``): of the projections
    ``u`` ``[B, T, H D]`` (``H = heads``, the model's), the depthwise convolution's ``taps`` ``[K, H D]``
    (``nn.Conv1d``'s weight transposed) over the ``K - 1`` inputs before each token (``prefix`` ``[B H, K - 1,
    D]``, zeros where None), SiLU, each row scaled to unit length (``eps`` under the square root)."""
    B, T, HD = u.shape
    K = taps.size(0)
    if heads < 1 or HD % heads or K < 1:
        raise ValueError(f"u {tuple(u.shape)} must hold {heads} heads of equal width, taps {tuple(taps.shape)} "
                         "at least one tap")
    D = HD // heads
    _check("u", u, (B, T, HD))
    _check("taps", taps, (K, HD))
    if prefix is not None:
        _check("prefix", prefix, (B * heads, K - 1, D))
    if library() is None:
        raise RuntimeError(f"the fused loops do not run here: {status()}")
    w = SCRATCH.take((B * heads, T, D))
    library().fa_path_w(u.data_ptr(), taps.data_ptr(), _pointer(prefix), w.data_ptr(), B * heads, heads, T, D, K, eps,
                        torch.get_num_threads())
    return w


def path_forward(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, values: Tensor, keys: Tensor, gate: Optional[Tensor],
                 gap_base: float, block: int, chunk: int, query_block: int, key_block: int,
                 carry_last: bool) -> Tuple[Tensor, int]:
    """PaTH's attention without a gradient or padding in one call (the C++ ``fa_path_forward``, where
    :func:`forward_available`): ``(out [heads, T, Dv], pairs skipped)`` of the ``T`` new tokens' scaled
    queries ``q``, keys ``k`` and ``w`` ``[heads, T, D]`` and ``beta`` ``[heads, T]``, with ``values`` ``[heads,
    S0 + T, Dv]`` (the cache's, then the new ones) and ``keys`` ``[heads, S0 + T, D]``, whose first ``S0`` rows
    are the cache's keys (carried through every cached token's ``H``): on return every row holds its key
    carried through the new tokens too (the last chunk's step taken only where ``carry_last``).  ``gate``
    ``[heads, S0 + T]`` (PaTH-FoX's cumulative log gates, scaled as the scores) or None; with it a chunk's
    queries skip the first cached keys that weigh less than ``exp(-gap)`` of every row's largest weight, ``gap
    = log(keys) + gap_base`` (``causal_blocks.negligible_gap``): the (query, key) pairs so left out, summed
    over the heads, are the second value.  Float32, contiguous, on the CPU; ``chunk``
    tokens per step, in blocks of ``block``, the cache's keys read ``key_block`` at a time by ``query_block``
    queries (``path.py``)."""
    heads, T, D = q.shape
    S, Dv = keys.size(1), values.size(-1)
    shapes = (("q", q, (heads, T, D)), ("k", k, (heads, T, D)), ("w", w, (heads, T, D)), ("beta", beta, (heads, T)),
              ("values", values, (heads, S, Dv)), ("keys", keys, (heads, S, D)))
    for name, t, shape in shapes + ((("gate", gate, (heads, S)),) if gate is not None else ()):
        _check(name, t, shape)
    if min(block, chunk, query_block, key_block) < 1 or S < T or max(
            heads, S, D, Dv, chunk * max(block, key_block, D, Dv), query_block * key_block) >= 2 ** 31:
        raise ValueError(f"block {block}, chunk {chunk}, query_block {query_block} and key_block {key_block} must be "
                         f"at least 1, S {S} at least T {T}, and every size below 2^31 (BLAS's 32-bit sizes)")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")
    out = SCRATCH.take((heads, T, Dv))
    skipped = torch.zeros(heads, dtype=torch.int64)
    library().fa_path_forward(q.data_ptr(), k.data_ptr(), w.data_ptr(), beta.data_ptr(), values.data_ptr(),
                              _pointer(gate), gap_base, keys.data_ptr(), out.data_ptr(), skipped.data_ptr(), heads, T,
                              S - T, D, Dv, block, chunk, query_block, key_block, int(carry_last),
                              torch.get_num_threads(), _state["sgemm"])
    return out, int(skipped.sum())


def path_block_terms(q: Tensor, k: Tensor, w: Tensor, beta: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PaTH's block terms of ``n`` blocks in one call (the C++ ``fa_path_block_terms``, where
    :func:`forward_available`): ``(local [n, c, c], carried [n, c, D], k_end [n, c, D], m [n, D, D], saved)``
    of the blocks' scaled queries ``q``, keys ``k`` and ``w`` ``[n, c, D]`` and ``beta`` ``[n, c]`` (float32,
    contiguous, on the CPU), as ``path._block_terms`` gives them (the product as the ``D x D`` matrix);
    ``saved`` ``[n, 3 c^2 + c D]`` is what :func:`path_block_terms_backward` reads."""
    n, c, D = q.shape
    _check_blocks(q, k, w, beta)
    local, carried, k_end = SCRATCH.take((n, c, c)), SCRATCH.take((n, c, D)), SCRATCH.take((n, c, D))
    m, saved = SCRATCH.take((n, D, D)), SCRATCH.take((n, 3 * c * c + c * D))
    library().fa_path_block_terms(q.data_ptr(), k.data_ptr(), w.data_ptr(), beta.data_ptr(), local.data_ptr(),
                                  carried.data_ptr(), k_end.data_ptr(), m.data_ptr(), saved.data_ptr(), n, c, D,
                                  torch.get_num_threads(), _state["sgemm"])
    return local, carried, k_end, m, saved


def path_block_terms_backward(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, saved: Tensor, d_local: Tensor,
                              d_carried: Tensor, d_k_end: Tensor, d_m: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients ``(dq, dk, dw, dbeta)`` of :func:`path_block_terms`' inputs from those of its four outputs
    (the C++ ``fa_path_block_terms_backward``; ``d_local`` is read below and on the diagonal only)."""
    n, c, D = q.shape
    _check_blocks(q, k, w, beta)
    for name, t, shape in (("saved", saved, (n, 3 * c * c + c * D)), ("d_local", d_local, (n, c, c)),
                           ("d_carried", d_carried, (n, c, D)), ("d_k_end", d_k_end, (n, c, D)),
                           ("d_m", d_m, (n, D, D))):
        _check(name, t, shape)
    dq, dk, dw, dbeta = (SCRATCH.take(tuple(t.shape)) for t in (q, k, w, beta))
    library().fa_path_block_terms_backward(
        q.data_ptr(), k.data_ptr(), w.data_ptr(), beta.data_ptr(), saved.data_ptr(), d_local.data_ptr(),
        d_carried.data_ptr(), d_k_end.data_ptr(), d_m.data_ptr(), dq.data_ptr(), dk.data_ptr(), dw.data_ptr(),
        dbeta.data_ptr(), n, c, D, torch.get_num_threads(), _state["sgemm"])
    return dq, dk, dw, dbeta


def _check_blocks(q: Tensor, k: Tensor, w: Tensor, beta: Tensor) -> None:
    n, c, D = q.shape
    for name, t, shape in (("q", q, (n, c, D)), ("k", k, (n, c, D)), ("w", w, (n, c, D)), ("beta", beta, (n, c))):
        _check(name, t, shape)
    if max(n, 3 * c * c + c * D, D * D) >= 2 ** 31:
        raise ValueError("every size must be below 2^31 (BLAS's 32-bit sizes)")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")


class Scratch:
    """Buffers of float32 kept for reuse by the fused calls: their outputs and copies (``O(T)``, a few MiB) and
    PaTH's training terms, gradients and sweep weights (``O(T^2)``, up to hundreds of MiB a layer).  A fresh
    tensor takes its memory from the operating system page by page, zeroed, on every call; on the small
    virtual machine of the results log that took an eighth of PaTH's training call at 4,096 tokens
    (``new_methods_cpu.py``'s ``-fresh`` cases).

    :meth:`take` hands out the memory of the smallest kept buffer that fits (at most twice the size asked for)
    and that nothing references any more: a caller's output, or a tensor autograd saved until the backward that
    reads it has run or its graph is freed, keeps its buffer out of reach.  Else it makes a new buffer.  Kept
    buffers are grouped by size, the least recently used first within each, so a model's layers find theirs
    at once, step after step.  At most :attr:`most` are kept, the least recently used dropped first: what is
    kept is at most what the calls held at their peak (:meth:`clear` lets it go)."""

    def __init__(self, most: int = 4096):
        self.most = most
        self.groups: dict = {}  # (numel, made in inference mode) -> buffers, the least recently used first
        self.order: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()  # id -> (group, buffer)
        self.lone = self._references(torch.empty(1))
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.order)

    @staticmethod
    def _references(t: Tensor) -> int:
        """Tensors sharing the buffer's storage, ``t`` and the query's own included; -1 where this torch cannot
        count them (then no buffer is ever handed out twice)."""
        count = getattr(torch._C, "_storage_Use_Count", None)
        return -1 if count is None else count(t.untyped_storage()._cdata)

    def _free(self, group: tuple) -> Optional[Tensor]:
        if self.lone < 0:
            return None
        for buffer in self.groups.get(group, ()):
            if self._references(buffer) == self.lone:
                return buffer
        return None

    def take(self, shape: Tuple[int, ...]) -> Tensor:
        """A float32 CPU tensor of ``shape``, contiguous, its values undefined: a tensor of its own (not a view,
        which autograd would track as one) on a kept buffer's memory.  Buffers made in inference mode serve only
        calls in inference mode, and the others only calls outside it (torch keeps the two kinds apart)."""
        size = 1
        for n in shape:
            size *= n
        inference = torch.is_inference_mode_enabled()
        with self.lock:
            group, buffer = (size, inference), self._free((size, inference))
            if buffer is None:  # a larger one, the smallest that is free
                for other in sorted(g for g in self.groups if g[1] == inference and size < g[0] <= 2 * max(size, 1)):
                    buffer = self._free(other)
                    if buffer is not None:
                        group = other
                        break
            if buffer is None:
                buffer = torch.empty(size, dtype=torch.float32)
                self.groups.setdefault(group, []).append(buffer)
            else:  # the most recently used of its group now
                members = self.groups[group]
                members.append(members.pop(next(i for i, b in enumerate(members) if b is buffer)))
            self.order[id(buffer)] = (group, buffer)
            self.order.move_to_end(id(buffer))
            while len(self.order) > self.most:
                old_group, old = self.order.popitem(last=False)[1]
                members = self.groups[old_group]
                del members[next(i for i, b in enumerate(members) if b is old)]
                if not members:
                    del self.groups[old_group]
            return torch.empty(0, dtype=torch.float32).set_(buffer.untyped_storage(), 0, tuple(shape))

    def clear(self) -> None:
        with self.lock:
            self.groups.clear()
            self.order.clear()


#: The fused calls' kept buffers (:class:`Scratch`).
SCRATCH = Scratch()


def take(shape: Tuple[int, ...]) -> Tensor:
    """:meth:`Scratch.take` of :data:`SCRATCH` (read when called: a benchmark may replace it)."""
    return SCRATCH.take(shape)


def scaled(t: Tensor, scale: float) -> Tensor:
    """``t * scale`` in float32, contiguous, in a kept buffer (:data:`SCRATCH`): the queries a fused call reads,
    scaled (another dtype is taken to float32 first, as ``t.float() * scale`` computes it)."""
    out = SCRATCH.take(tuple(t.shape))
    return torch.mul(t if t.dtype == torch.float32 else t.float(), scale, out=out)


def path_sweep_forward(local: Tensor, carried: Tensor, k_end: Tensor, v: Tensor, gate: Optional[Tensor],
                       pad: Optional[Tensor], m: Tensor, per_batch: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """PaTH's training sweep, forward, in one call (the C++ ``fa_path_sweep_forward``, where
    :func:`forward_available`): ``(out, inverse, weights, queries)`` of ``n`` blocks of ``C`` tokens of
    ``heads`` heads, ``per_batch`` heads per batch row: ``local`` ``[n, heads, C, C]`` (the blocks' own scores,
    masked), ``carried`` and ``k_end`` ``[n, heads, C, D]``, ``v`` ``[n, heads, C, Dv]``, ``gate`` ``[n,
    heads, C]`` or None, ``pad`` ``[n, heads / per_batch, C]`` (uint8) or None, ``m`` ``[n, heads, D, D]``
    (float32, contiguous, on the CPU); ``weights`` and ``queries`` are what :func:`path_sweep_backward` reads."""
    n, heads, C, D = carried.shape
    Dv = v.size(-1)
    shapes = (("local", local, (n, heads, C, C)), ("carried", carried, (n, heads, C, D)),
              ("k_end", k_end, (n, heads, C, D)), ("v", v, (n, heads, C, Dv)), ("m", m, (n, heads, D, D)))
    for name, t, shape in shapes + ((("gate", gate, (n, heads, C)),) if gate is not None else ()):
        _check(name, t, shape)
    if heads % per_batch:
        raise ValueError(f"heads {heads} must be a multiple of per_batch {per_batch}")
    _check_pad(pad, (n, heads // per_batch, C))
    if max(heads * n * (n + 1) // 2 * C * C, heads * n * C * max(D, Dv)) >= 2 ** 62 or max(C, D, Dv) >= 2 ** 15:
        raise ValueError("sizes too large for the fused sweep")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")
    out, inverse = SCRATCH.take((n, heads, C, Dv)), SCRATCH.take((n, heads, C))
    weights = SCRATCH.take((heads, n * (n + 1) // 2, C, C))  # every entry written before it is read
    queries = SCRATCH.take((heads, max(n * (n - 1) // 2, 1), C, D))
    library().fa_path_sweep_forward(local.data_ptr(), carried.data_ptr(), k_end.data_ptr(), v.data_ptr(),
                                    _pointer(gate), _pointer(pad), m.data_ptr(), out.data_ptr(), inverse.data_ptr(),
                                    weights.data_ptr(), queries.data_ptr(), n, heads, per_batch, C, D, Dv,
                                    torch.get_num_threads(), _state["sgemm"])
    return out, inverse, weights, queries


def path_sweep_backward(d_out: Tensor, out: Tensor, inverse: Tensor, weights: Tensor, queries: Tensor, k_end: Tensor,
                        v: Tensor, m: Tensor, gated: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor],
                                                                     Tensor]:
    """The gradients ``(d_local, d_carried, d_k_end, d_v, d_gate or None, d_m)`` of :func:`path_sweep_forward`'s
    inputs from ``d_out`` ``[n, heads, C, Dv]`` (the C++ ``fa_path_sweep_backward``); ``d_gate`` (where
    ``gated``) is the gate's through the steps between blocks only (the blocks' own scores carry theirs in
    ``d_local``)."""
    n, heads, C, D = k_end.shape
    Dv = v.size(-1)
    for name, t, shape in (("d_out", d_out, (n, heads, C, Dv)), ("out", out, (n, heads, C, Dv)),
                           ("inverse", inverse, (n, heads, C)), ("weights", weights, (heads, n * (n + 1) // 2, C, C)),
                           ("queries", queries, (heads, max(n * (n - 1) // 2, 1), C, D)),
                           ("k_end", k_end, (n, heads, C, D)), ("v", v, (n, heads, C, Dv)), ("m", m, (n, heads, D, D))):
        _check(name, t, shape)
    d_local = SCRATCH.take((n, heads, C, C))
    d_carried, d_k_end, d_v = (SCRATCH.take(tuple(t.shape)).zero_() for t in (k_end, k_end, v))
    d_gate = SCRATCH.take((n, heads, C)).zero_() if gated else None
    d_m = SCRATCH.take(tuple(m.shape)).zero_()
    library().fa_path_sweep_backward(d_out.data_ptr(), out.data_ptr(), inverse.data_ptr(), weights.data_ptr(),
                                     queries.data_ptr(), k_end.data_ptr(), v.data_ptr(), m.data_ptr(),
                                     d_local.data_ptr(), d_carried.data_ptr(), d_k_end.data_ptr(), d_v.data_ptr(),
                                     _pointer(d_gate), d_m.data_ptr(), n, heads, C, D, Dv, torch.get_num_threads(),
                                     _state["sgemm"])
    return d_local, d_carried, d_k_end, d_v, d_gate, d_m


def path_merge(local: Tensor, carried: Tensor, k_end: Tensor, m: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One level of PaTH's block merge (the C++ ``fa_path_merge``, where :func:`forward_available`): ``(local2,
    carried2, k_end2, m2)`` of blocks in pairs, ``local`` ``[n, heads, C, C]``, ``carried`` and ``k_end`` ``[n,
    heads, C, D]``, ``m`` ``[n, heads, D, D]`` (``n`` even; float32, contiguous, on the CPU), as
    ``path._merged_terms`` merges them once."""
    n, heads, C, D = carried.shape
    if n % 2:
        raise ValueError(f"the blocks must come in pairs, not {n}")
    for name, t, shape in (("local", local, (n, heads, C, C)), ("carried", carried, (n, heads, C, D)),
                           ("k_end", k_end, (n, heads, C, D)), ("m", m, (n, heads, D, D))):
        _check(name, t, shape)
    if max(n * heads * 4 * C * max(C, D), D * D) >= 2 ** 62 or max(2 * C, D) >= 2 ** 15:
        raise ValueError("sizes too large for the fused merge")
    if not forward_available():
        raise RuntimeError(f"the fused forward does not run here: {status()}")
    local2, m2 = SCRATCH.take((n // 2, heads, 2 * C, 2 * C)), SCRATCH.take((n // 2, heads, D, D))
    carried2, k_end2 = SCRATCH.take((n // 2, heads, 2 * C, D)), SCRATCH.take((n // 2, heads, 2 * C, D))
    library().fa_path_merge(local.data_ptr(), carried.data_ptr(), k_end.data_ptr(), m.data_ptr(), local2.data_ptr(),
                            carried2.data_ptr(), k_end2.data_ptr(), m2.data_ptr(), n, heads, C, D,
                            torch.get_num_threads(), _state["sgemm"])
    return local2, carried2, k_end2, m2


def path_merge_backward(carried: Tensor, k_end: Tensor, m: Tensor, d_local2: Tensor, d_carried2: Tensor,
                        d_k_end2: Tensor, d_m2: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients ``(d_local, d_carried, d_k_end, d_m)`` of :func:`path_merge`'s inputs from those of its
    outputs (the C++ ``fa_path_merge_backward``)."""
    n, heads, C, D = carried.shape
    for name, t, shape in (("carried", carried, (n, heads, C, D)), ("k_end", k_end, (n, heads, C, D)),
                           ("m", m, (n, heads, D, D)), ("d_local2", d_local2, (n // 2, heads, 2 * C, 2 * C)),
                           ("d_carried2", d_carried2, (n // 2, heads, 2 * C, D)),
                           ("d_k_end2", d_k_end2, (n // 2, heads, 2 * C, D)), ("d_m2", d_m2, (n // 2, heads, D, D))):
        _check(name, t, shape)
    d_local = SCRATCH.take((n, heads, C, C))
    d_carried, d_k_end, d_m = (SCRATCH.take(tuple(t.shape)) for t in (carried, k_end, m))
    library().fa_path_merge_backward(carried.data_ptr(), k_end.data_ptr(), m.data_ptr(), d_local2.data_ptr(),
                                     d_carried2.data_ptr(), d_k_end2.data_ptr(), d_m2.data_ptr(), d_local.data_ptr(),
                                     d_carried.data_ptr(), d_k_end.data_ptr(), d_m.data_ptr(), n, heads, C, D,
                                     torch.get_num_threads(), _state["sgemm"])
    return d_local, d_carried, d_k_end, d_m
