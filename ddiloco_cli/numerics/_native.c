/* ddiloco's optional compiled kernels: the int4/int8 block quantiser, the dequantiser, the
 * per-block sums of q**2 (a contribution's norm) and a learner's outer gradient, one pass each
 * with the GIL released.
 *
 * They compute what blockquant.py's numpy passes compute, bit for bit: the same IEEE fp32
 * operations on each element in the same order (no fused multiply-add: built with
 * -ffp-contract=off; no fast-math), so a payload and a decoded value do not depend on whether
 * this module was built. For a NaN or Inf input, or a scale whose inverse overflows (garbage
 * codes, whatever numpy's casts make of them), quantize() returns 1 and writes nothing the
 * caller keeps: the caller then runs the numpy passes.
 *
 * The layout is the frame's (protocol/PROTOCOL.md, the codec table): one bf16 scale per block
 * (absmax / qmax rounded up to bf16), codes q + offset (int4: offset 8, two a byte, low nibble
 * first; int8: offset 128). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the kernels need fp32 arithmetic evaluated in fp32 (FLT_EVAL_METHOD 0)"
#endif

#define MAX_BF16_BITS 0x7F7F0000u /* the largest finite bf16, as fp32 bits */
#define CHUNK_ELEMS (1 << 16)     /* codes made this many at a time, then packed while in cache */

/* x86-64 Linux with gcc: an AVX2 copy of each pass beside the baseline (SSE2) one, picked when
 * the library loads by what the CPU has; the same IEEE operations either way (no FMA: the
 * contraction is off) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* One block of m values: its scale's fp32 bits (bf16 in the top half) and its codes; residual
 * (when not NULL) gets x - q * scale. Returns 1 when numpy's passes must decide instead. */
INLINE int quantize_block(const float *restrict x, Py_ssize_t m, float fq, float bias, int offset,
                          uint8_t *restrict codes, float *restrict residual, uint32_t *scale_bits) {
    /* max |x| as bits (int32: SSE2 compares those): non-negative floats order as their bits, a
     * NaN or an Inf lies above every finite value, and zeros of either sign give +0.0 */
    int32_t top = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        int32_t a = (int32_t)(bits_of(x[j]) & 0x7FFFFFFFu);
        top = a > top ? a : top;
    }
    if (top > 0x7F7FFFFF) return 1; /* a NaN or an Inf */
    /* absmax / qmax rounded up to bf16 (positive: adding 0xFFFF before truncating rounds up),
     * held at the largest finite bf16 */
    uint32_t bits = bits_of(float_of((uint32_t)top) / fq);
    if (bits > MAX_BF16_BITS) bits = MAX_BF16_BITS;
    bits = (bits + 0xFFFFu) & ~0xFFFFu;
    float scale = float_of(bits), inv = 0.0f;
    if (scale > 0.0f) {
        inv = 1.0f / scale;
        if (bits_of(inv) >= 0x7F800000u) return 1;  /* a subnormal scale: 1 / scale overflows */
    }
    if (residual) {
        for (Py_ssize_t j = 0; j < m; j++) {
            float y = x[j] * inv;
            y = y + bias;             /* >= 0.5: the conversion floors, round-half-up of x / scale */
            int32_t c = (int32_t)y;
            codes[j] = (uint8_t)c;
            float q = (float)(c - offset); /* the decoder's q, times the scale: x less its decoded value */
            float d = q * scale;
            residual[j] = x[j] - d;
        }
    } else {
        for (Py_ssize_t j = 0; j < m; j++) {
            float y = x[j] * inv;
            y = y + bias;
            codes[j] = (uint8_t)(int32_t)y;
        }
    }
    *scale_bits = bits;
    return 0;
}

CLONES static int quantize_all(const float *x, Py_ssize_t n, Py_ssize_t block, int qmax, int offset, int per_byte,
                               int16_t *scales, uint8_t *body, float *residual, uint8_t *tmp) {
    const float fq = (float)qmax, bias = (float)offset + 0.5f;
    /* a chunk of whole blocks and an even count of values, so each chunk packs on its own */
    Py_ssize_t chunk = block * (CHUNK_ELEMS / block > 0 ? CHUNK_ELEMS / block : 1);
    if (chunk % 2) chunk += block;
    for (Py_ssize_t lo = 0; lo < n; lo += chunk) {
        Py_ssize_t hi = lo + chunk < n ? lo + chunk : n;
        uint8_t *codes = per_byte == 1 ? body + lo : tmp;
        for (Py_ssize_t b = lo / block; b < hi / block; b++) {
            Py_ssize_t s = b * block;
            uint32_t bits;
            if (quantize_block(x + s, block, fq, bias, offset, codes + (s - lo), residual ? residual + s : NULL, &bits))
                return 1;
            scales[b] = (int16_t)(uint16_t)(bits >> 16);
        }
        if (per_byte == 2) {
            uint8_t *out = body + lo / 2;
            for (Py_ssize_t i = 0; i < (hi - lo) / 2; i++)
                out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
        }
    }
    return 0;
}

/* q * scale of elements [lo, hi) of one block (its scale sc), into dst[0 .. hi - lo): the
 * decoder's products, each rounded once */
INLINE void block_products(const uint8_t *restrict c, Py_ssize_t lo, Py_ssize_t hi, int per_byte, float sc,
                           float *restrict dst) {
    if (per_byte == 1) {
        for (Py_ssize_t i = lo; i < hi; i++) dst[i - lo] = (float)((int32_t)c[i] - 128) * sc;
    } else if (lo % 2 == 0 && hi % 2 == 0) { /* whole bytes: both nibbles of each */
        const uint8_t *cb = c + lo / 2;
        for (Py_ssize_t k = 0; k < (hi - lo) / 2; k++) {
            dst[2 * k] = (float)((int32_t)(cb[k] & 15) - 8) * sc;
            dst[2 * k + 1] = (float)((int32_t)(cb[k] >> 4) - 8) * sc;
        }
    } else {
        for (Py_ssize_t i = lo; i < hi; i++) dst[i - lo] = (float)((int32_t)((c[i >> 1] >> ((i & 1) * 4)) & 15) - 8) * sc;
    }
}

/* o[lo .. hi) = q * sc (+ p when not NULL) of elements [lo, hi) of one block */
INLINE void dequantize_range(const uint8_t *restrict c, Py_ssize_t lo, Py_ssize_t hi, int per_byte, float sc,
                             const float *restrict p, float *restrict o) {
    block_products(c, lo, hi, per_byte, sc, o + lo);
    if (p)
        for (Py_ssize_t i = lo; i < hi; i++) o[i] = o[i] + p[i];
}

/* o = q * scale (+ p when not NULL), block by block */
CLONES static void dequantize_all(const uint8_t *restrict c, const float *restrict s, Py_ssize_t n, Py_ssize_t block,
                                  int per_byte, const float *restrict p, float *restrict o) {
    Py_ssize_t nb = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nb; b++)
        dequantize_range(c, b * block, b * block + block < n ? b * block + block : n, per_byte, s[b], p, o);
}

#define ACC_PIECE 4096 /* even: a piece keeps its start's parity (int4 nibbles) */

/* acc[lo .. end) += q * sc of elements [lo, end) of one block: the products of a piece into a
 * buffer in cache (tmp, ACC_PIECE values), then added, each product rounded before its addition */
INLINE void accumulate_range(const uint8_t *restrict c, Py_ssize_t lo, Py_ssize_t end, int per_byte, float sc,
                             float *restrict acc, float *restrict tmp) {
    for (; lo < end; lo += ACC_PIECE) {
        Py_ssize_t hi = lo + ACC_PIECE < end ? lo + ACC_PIECE : end;
        block_products(c, lo, hi, per_byte, sc, tmp);
        for (Py_ssize_t i = lo; i < hi; i++) acc[i] = acc[i] + tmp[i - lo];
    }
}

/* acc += q * scale, in place (a merge's next term), block by block */
CLONES static void accumulate_all(const uint8_t *restrict c, const float *restrict s, Py_ssize_t n, Py_ssize_t block,
                                  int per_byte, float *restrict acc) {
    float tmp[ACC_PIECE];
    Py_ssize_t nb = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nb; b++)
        accumulate_range(c, b * block, b * block + block < n ? b * block + block : n, per_byte, s[b], acc, tmp);
}

/* sum(q**2) of each whole block, exact (an integer <= 128**2 * block), as fp64 */
CLONES static void square_sums_all(const uint8_t *restrict c, Py_ssize_t blocks, Py_ssize_t block, int per_byte,
                                   double *restrict out) {
    for (Py_ssize_t b = 0; b < blocks; b++) {
        uint64_t total = 0;
        if (per_byte == 1) {
            const uint8_t *cb = c + b * block;
            for (Py_ssize_t i = 0; i < block; i++) {
                int32_t q = (int32_t)cb[i] - 128;
                total += (uint32_t)(q * q);
            }
        } else { /* block is even: the block's bytes hold its codes alone */
            const uint8_t *cb = c + b * (block / 2);
            for (Py_ssize_t k = 0; k < block / 2; k++) {
                int32_t lo = (int32_t)(cb[k] & 15) - 8, hi = (int32_t)(cb[k] >> 4) - 8;
                total += (uint32_t)(lo * lo + hi * hi);
            }
        }
        out[b] = (double)total;
    }
}

/* x86-64 with gcc or clang: AVX2 copies of the three passes a merge makes of every contribution
 * (dequantize, accumulate, square sums), with explicit vector code, picked at import when the CPU
 * has AVX2 (``simd()`` turns them off, for the tests and an A/B). Each value gets the operations the
 * scalar passes give it, in the same order: its q exactly (an int8, then an exact conversion), one
 * fp32 multiply by its block's scale, then one fp32 add (a NaN stays a NaN; which NaN payload is
 * the hardware's choice either way, and no NaN reaches a merge); integer sums of squares are
 * exact either way. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define X86_SIMD 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))
static int simd_on = 0;

/* op 0: dst = q * s; op 1: dst = q * s + p; op 2: dst = dst + q * s; for 8 values whose q are
 * the low 8 int8s of q8 */
AVX2_INLINE void eight_products(__m128i q8, __m256 s, const float *p, float *dst, int op) {
    __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), s);
    if (op == 1) prod = _mm256_add_ps(prod, _mm256_loadu_ps(p));
    else if (op == 2) prod = _mm256_add_ps(_mm256_loadu_ps(dst), prod);
    _mm256_storeu_ps(dst, prod);
}

/* The products of the first values of a run of m codes that starts on a byte (int4: on an even
 * element), 32 (int4) or 16 (int8) at a time; returns how many it did (the caller does the rest) */
AVX2_INLINE Py_ssize_t vector_products(const uint8_t *cb, Py_ssize_t m, int per_byte, float sc, const float *p,
                                       float *dst, int op) {
    const __m256 s = _mm256_set1_ps(sc);
    Py_ssize_t k = 0;
    if (per_byte == 2) {
        const __m128i low4 = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        for (; k + 32 <= m; k += 32) {
            __m128i x = _mm_loadu_si128((const __m128i *)(cb + k / 2));
            __m128i lo = _mm_and_si128(x, low4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low4);
            __m128i a = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight); /* values k .. k + 15, low nibble first */
            __m128i b = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight); /* k + 16 .. k + 31 */
            eight_products(a, s, p ? p + k : NULL, dst + k, op);
            eight_products(_mm_srli_si128(a, 8), s, p ? p + k + 8 : NULL, dst + k + 8, op);
            eight_products(b, s, p ? p + k + 16 : NULL, dst + k + 16, op);
            eight_products(_mm_srli_si128(b, 8), s, p ? p + k + 24 : NULL, dst + k + 24, op);
        }
    } else {
        const __m128i sign = _mm_set1_epi8((char)0x80);
        for (; k + 16 <= m; k += 16) {
            __m128i q = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(cb + k)), sign); /* code - 128 as int8 */
            eight_products(q, s, p ? p + k : NULL, dst + k, op);
            eight_products(_mm_srli_si128(q, 8), s, p ? p + k + 8 : NULL, dst + k + 8, op);
        }
    }
    return k;
}

/* dequantize_all with the vector products first where a block starts on a byte (the scalar
 * range does the rest of the block) */
AVX2 static void dequantize_avx2(const uint8_t *restrict c, const float *restrict s, Py_ssize_t n, Py_ssize_t block,
                                 int per_byte, const float *restrict p, float *restrict o) {
    Py_ssize_t nb = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t lo = b * block, hi = lo + block < n ? lo + block : n;
        if (per_byte == 1 || lo % 2 == 0)
            lo += p ? vector_products(c + lo / per_byte, hi - lo, per_byte, s[b], p + lo, o + lo, 1)
                    : vector_products(c + lo / per_byte, hi - lo, per_byte, s[b], NULL, o + lo, 0);
        dequantize_range(c, lo, hi, per_byte, s[b], p, o);
    }
}

/* accumulate_all with the vector products first where a block starts on a byte */
AVX2 static void accumulate_avx2(const uint8_t *restrict c, const float *restrict s, Py_ssize_t n, Py_ssize_t block,
                                 int per_byte, float *restrict acc) {
    float tmp[ACC_PIECE];
    Py_ssize_t nb = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t lo = b * block, end = lo + block < n ? lo + block : n;
        if (per_byte == 1 || lo % 2 == 0)
            lo += vector_products(c + lo / per_byte, end - lo, per_byte, s[b], NULL, acc + lo, 2);
        accumulate_range(c, lo, end, per_byte, s[b], acc, tmp);
    }
}

/* square_sums_all for int4: each byte's two squares from a 16-entry table (pshufb), summed over
 * 8 bytes at a time (psadbw) into 64-bit lanes; int8 takes the scalar pass */
AVX2 static void square_sums_avx2(const uint8_t *restrict c, Py_ssize_t blocks, Py_ssize_t block, int per_byte,
                                  double *restrict out) {
    if (per_byte != 2) {
        square_sums_all(c, blocks, block, per_byte, out);
        return;
    }
    const __m256i squares = _mm256_setr_epi8(64, 49, 36, 25, 16, 9, 4, 1, 0, 1, 4, 9, 16, 25, 36, 49,
                                             64, 49, 36, 25, 16, 9, 4, 1, 0, 1, 4, 9, 16, 25, 36, 49);
    const __m256i low4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    Py_ssize_t bytes = block / 2;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const uint8_t *cb = c + b * bytes;
        __m256i lanes = zero;
        Py_ssize_t k = 0;
        for (; k + 32 <= bytes; k += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(cb + k));
            __m256i lo = _mm256_and_si256(x, low4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
            __m256i sq = _mm256_add_epi8(_mm256_shuffle_epi8(squares, lo), _mm256_shuffle_epi8(squares, hi)); /* <= 128 */
            lanes = _mm256_add_epi64(lanes, _mm256_sad_epu8(sq, zero));
        }
        uint64_t part[4];
        _mm256_storeu_si256((__m256i *)part, lanes);
        uint64_t total = part[0] + part[1] + part[2] + part[3];
        for (; k < bytes; k++) {
            int32_t lo = (int32_t)(cb[k] & 15) - 8, hi = (int32_t)(cb[k] >> 4) - 8;
            total += (uint32_t)(lo * lo + hi * hi);
        }
        out[b] = (double)total;
    }
}

#define DEQUANTIZE(...) (simd_on ? dequantize_avx2(__VA_ARGS__) : dequantize_all(__VA_ARGS__))
#define ACCUMULATE(...) (simd_on ? accumulate_avx2(__VA_ARGS__) : accumulate_all(__VA_ARGS__))
#define SQUARE_SUMS(...) (simd_on ? square_sums_avx2(__VA_ARGS__) : square_sums_all(__VA_ARGS__))
#else
#define DEQUANTIZE dequantize_all
#define ACCUMULATE accumulate_all
#define SQUARE_SUMS square_sums_all
#endif

/* delta = (base - theta) (+ residual when not NULL), each rounded once: a learner's outer gradient
 * with error feedback, in one pass */
CLONES static void outer_delta_all(const float *restrict theta, const float *restrict base, const float *restrict res,
                                   Py_ssize_t n, float *restrict delta) {
    if (res) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float d = base[i] - theta[i];
            delta[i] = d + res[i];
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) delta[i] = base[i] - theta[i];
    }
}

static int check_len(const Py_buffer *buf, Py_ssize_t want, const char *what) {
    if (buf->len < want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what, buf->len, want);
        return -1;
    }
    return 0;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

static int disjoint(const Py_buffer *out, const Py_buffer *in, const char *what) {
    if (in->obj && overlaps(out, in)) {
        PyErr_Format(PyExc_ValueError, "%s overlaps an output", what);
        return -1;
    }
    return 0;
}

/* view of obj (None: none, view->obj stays NULL); -1 with the error set when obj has none */
static int optional_buffer(PyObject *obj, Py_buffer *view, int flags) {
    return obj == Py_None ? 0 : PyObject_GetBuffer(obj, view, flags);
}

static int codec_args(int per_byte, int offset, int qmax) {
    if (!((per_byte == 2 && offset == 8 && qmax >= 1 && qmax <= 7) ||
          (per_byte == 1 && offset == 128 && qmax >= 1 && qmax <= 127))) {
        PyErr_SetString(PyExc_ValueError, "per_byte / offset / qmax are not int4's or int8's");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(quantize_doc,
"quantize(x, block, qmax, offset, per_byte, scales, body, residual) -> int\n\n"
"x: fp32, n values in whole blocks (n even for int4); scales: int16 (n / block, the bf16 of each\n"
"scale); body: uint8 (n / per_byte codes); residual: fp32 (n, x - decoded) or None. Returns 0,\n"
"or 1 when the numpy passes must make this payload (outputs then partly written).");

static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer x, scales, body, residual = {0};
    Py_ssize_t block;
    int qmax, offset, per_byte, status = 0;
    PyObject *res_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niiiw*w*O", &x, &block, &qmax, &offset, &per_byte, &scales, &body, &res_obj))
        return NULL;
    if (optional_buffer(res_obj, &residual, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        status = -1;
        goto done;
    }
    int have_res = residual.obj != NULL;
    Py_ssize_t n = x.len / 4;
    if (block < 1 || x.len % 4 || n % block || (per_byte == 2 && n % 2)) {
        PyErr_SetString(PyExc_ValueError, "x must hold whole blocks of fp32 (an even count for int4)");
        status = -1;
        goto done;
    }
    if (codec_args(per_byte, offset, qmax) || check_len(&scales, 2 * (n / block), "scales") ||
        check_len(&body, n / per_byte, "body") || (have_res && check_len(&residual, 4 * n, "residual")) ||
        disjoint(&scales, &x, "x") || disjoint(&body, &x, "x") || disjoint(&body, &scales, "scales") ||
        (have_res && (disjoint(&residual, &x, "x") || disjoint(&residual, &body, "body") ||
                      disjoint(&residual, &scales, "scales")))) {
        status = -1;
        goto done;
    }
    uint8_t *tmp = NULL;
    if (per_byte == 2 && n) {
        Py_ssize_t chunk = block * (CHUNK_ELEMS / block > 0 ? CHUNK_ELEMS / block : 1) + block;
        tmp = malloc((size_t)(chunk < n ? chunk : n));
        if (!tmp) {
            PyErr_NoMemory();
            status = -1;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    status = quantize_all((const float *)x.buf, n, block, qmax, offset, per_byte, (int16_t *)scales.buf,
                          (uint8_t *)body.buf, have_res ? (float *)residual.buf : NULL, tmp);
    Py_END_ALLOW_THREADS
    free(tmp);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&body);
    if (residual.obj) PyBuffer_Release(&residual);
    if (status < 0) return NULL;
    return PyLong_FromLong(status);
}

PyDoc_STRVAR(dequantize_doc,
"dequantize(codes, scale, n, block, offset, per_byte, base, out) -> None\n\n"
"out[i] = (code_i - offset) * scale[i // block] (+ base[i] when base is not None), fp32, for n\n"
"values: the decoder's products, then the sum with a previous value. base is out (the same\n"
"object): out[i] += the product, in place (a merge's next term).");

static PyObject *dequantize(PyObject *self, PyObject *args) {
    Py_buffer codes, scale, out, base = {0};
    Py_ssize_t n, block;
    int offset, per_byte, ok = 1;
    PyObject *base_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nniiOw*", &codes, &scale, &n, &block, &offset, &per_byte, &base_obj, &out))
        return NULL;
    int in_place = base_obj == out.obj; /* out += q * scale */
    if (optional_buffer(in_place ? Py_None : base_obj, &base, PyBUF_C_CONTIGUOUS) < 0) {
        ok = 0;
        goto done;
    }
    int have_base = base.obj != NULL;
    if (n < 0 || block < 1 || !((per_byte == 2 && offset == 8) || (per_byte == 1 && offset == 128))) {
        PyErr_SetString(PyExc_ValueError, "bad n / block / codec");
        ok = 0;
        goto done;
    }
    Py_ssize_t nb = (n + block - 1) / block;
    if (check_len(&codes, (n + per_byte - 1) / per_byte, "codes") || check_len(&scale, 4 * nb, "scale") ||
        check_len(&out, 4 * n, "out") || (have_base && check_len(&base, 4 * n, "base")) ||
        disjoint(&out, &codes, "codes") || disjoint(&out, &scale, "scale") || (have_base && disjoint(&out, &base, "base"))) {
        ok = 0;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (in_place)
        ACCUMULATE((const uint8_t *)codes.buf, (const float *)scale.buf, n, block, per_byte, (float *)out.buf);
    else
        DEQUANTIZE((const uint8_t *)codes.buf, (const float *)scale.buf, n, block, per_byte,
                   have_base ? (const float *)base.buf : NULL, (float *)out.buf);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    if (base.obj) PyBuffer_Release(&base);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(square_sums_doc,
"square_sums(codes, blocks, block, per_byte, out) -> None\n\n"
"out[b] = sum of q**2 over whole block b (fp64, exact integers) from the codes; int4 needs an\n"
"even block (a block's codes in whole bytes).");

static PyObject *square_sums(PyObject *self, PyObject *args) {
    Py_buffer codes, out;
    Py_ssize_t blocks, block;
    int per_byte, ok = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nniw*", &codes, &blocks, &block, &per_byte, &out))
        return NULL;
    if (blocks < 0 || block < 1 || block > (1 << 20) || !(per_byte == 1 || (per_byte == 2 && block % 2 == 0))) {
        PyErr_SetString(PyExc_ValueError, "bad blocks / block / per_byte (int4 needs an even block)");
        ok = 0;
    } else if (check_len(&codes, blocks * (block / per_byte), "codes") || check_len(&out, 8 * blocks, "out") ||
               disjoint(&out, &codes, "codes")) {
        ok = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        SQUARE_SUMS((const uint8_t *)codes.buf, blocks, block, per_byte, (double *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(outer_delta_doc,
"outer_delta(theta, base, residual, delta) -> None\n\n"
"delta[i] = (base[i] - theta[i]) + residual[i] (without the sum when residual is None); fp32, n =\n"
"len(theta) / 4 values. delta must not overlap an input.");

static PyObject *outer_delta(PyObject *self, PyObject *args) {
    Py_buffer theta, base, delta, res = {0};
    PyObject *res_obj;
    int ok = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*Ow*", &theta, &base, &res_obj, &delta))
        return NULL;
    if (optional_buffer(res_obj, &res, PyBUF_C_CONTIGUOUS) < 0) {
        ok = 0;
        goto done;
    }
    int have_res = res.obj != NULL;
    Py_ssize_t n = theta.len / 4;
    if (theta.len % 4) {
        PyErr_SetString(PyExc_ValueError, "theta must hold fp32 values");
        ok = 0;
        goto done;
    }
    if (check_len(&base, 4 * n, "base") || check_len(&delta, 4 * n, "delta") ||
        (have_res && check_len(&res, 4 * n, "residual")) || disjoint(&delta, &theta, "theta") ||
        disjoint(&delta, &base, "base") || (have_res && disjoint(&delta, &res, "residual"))) {
        ok = 0;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    outer_delta_all((const float *)theta.buf, (const float *)base.buf, have_res ? (const float *)res.buf : NULL, n,
                    (float *)delta.buf);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&theta);
    PyBuffer_Release(&base);
    PyBuffer_Release(&delta);
    if (res.obj) PyBuffer_Release(&res);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(simd_doc,
"simd(on=None) -> bool\n\n"
"Whether dequantize, the in-place accumulate and int4's square_sums run their AVX2 copies (the\n"
"same values; False where the CPU or the build has none). on: turn them on (only where the CPU\n"
"has AVX2) or off, for a comparison. Returns the setting before the call.");

static PyObject *simd(PyObject *self, PyObject *args) {
    PyObject *on = Py_None;
    (void)self;
    if (!PyArg_ParseTuple(args, "|O", &on)) return NULL;
#ifdef X86_SIMD
    int before = simd_on;
    if (on != Py_None) {
        int want = PyObject_IsTrue(on);
        if (want < 0) return NULL;
        simd_on = want && __builtin_cpu_supports("avx2");
    }
    return PyBool_FromLong(before);
#else
    (void)on;
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, quantize_doc},
    {"dequantize", dequantize, METH_VARARGS, dequantize_doc},
    {"square_sums", square_sums, METH_VARARGS, square_sums_doc},
    {"outer_delta", outer_delta, METH_VARARGS, outer_delta_doc},
    {"simd", simd, METH_VARARGS, simd_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "ddiloco's optional compiled codec kernels (see numerics/native.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

/* API: what native.py expects; raised with any change of a function's arguments or meaning, so a
 * stale in-place build (an editable install not rebuilt after a pull) is not used */
#define API 4

PyMODINIT_FUNC PyInit__native(void) {
#ifdef X86_SIMD
    __builtin_cpu_init();
    simd_on = __builtin_cpu_supports("avx2") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "API", API) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
