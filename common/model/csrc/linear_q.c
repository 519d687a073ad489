/* y = x W^T in float32 for any number of rows, with W kept block-quantized, on CPUs with
 * AVX-512 (common/model/quant.py ``QuantizedWeight``, common/model/cpu_linear.py
 * ``QuantLinear``): the linears of a GGUF's Q4_0 ... Q6_K tensors as the file holds them.
 *
 * Every quantized weight is w[n][k] = code * scale + offset, one (scale, offset) for each
 * group of ``group`` consecutive k of an output (16 or 32), codes of 4 or 8 bits (a
 * GGUF's 5- and 6-bit codes take 8). Packed once as a tile of 64 outputs after another:
 * codes [N / 64, K, 64] bytes, or [N / 64, K, 32] of two nibbles (output j in the low
 * half of byte j, output j + 32 in its high half); (scale, offset) as [N / 64, K / group,
 * 2, 64] float32. A 4-bit weight reads 0.5 + 8 / group bytes (0.75 at groups of 32, a
 * sixth of float32's 4) and an 8-bit one 1.25.
 *
 * Each weight is made with one fused multiply-add (``_mm512_fmadd_ps``): code * scale is
 * exact and the sum is rounded once, as gguf's float32 dequantization rounds it (the
 * products it forms are exact as well): so the weights are bit for bit the float32 ones a
 * dequantized file holds, and this kernel's y bit for bit csrc/linear_f32.c's on them
 * (the same multiply-adds, in the same order): a quantized model answers as its float32
 * expansion did, reading a fraction of the bytes.
 *
 * Two ways through a tile, of one result:
 * - a decode step's few rows (``FUSED_ROWS`` or fewer): each k's weights are made in
 *   registers and multiplied into every row at once; the codes stream from DRAM once;
 * - more rows: the tile's weights are made ``CHUNK`` k at a time into a scratch buffer
 *   that stays in the L1 cache, and every 6 rows of the call multiply it (their sums kept
 *   in y between chunks: a float32 stored and loaded is the same float32), so a prompt
 *   makes each weight once per call, not once per row.
 *
 * Row invariant, as csrc/linear_f32.c's: every row sums x[k] w[n][k] into each output
 * over k = 0, 1, ... in order, one multiply-add at a time, whichever way and slot takes
 * it: a row's result does not depend on the batch nor on how threads split the call.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define COL_VECS 4   /* 64 outputs a tile */
#define FUSED_ROWS 16 /* rows the fused way takes, in passes of 1, 2, 4 or 6 */
#define CHUNK 256    /* k a chunk of the scratch: 256 x 64 floats, 64 KiB (L2) */
#define ROWS 6       /* rows a pass over the scratch: 24 accumulators, 4 weights */

/* The 64 weights of one k of a tile, from its codes ``c`` and its group's scale and
 * offset vectors. */
static inline void weights8(const uint8_t *c, const v16 *scale, const v16 *offset, v16 *w) {
    for (int v = 0; v < COL_VECS; v++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(c + 16 * v));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
        w[v] = (v16)_mm512_fmadd_ps(f, (__m512)scale[v], (__m512)offset[v]);
    }
}

static inline void weights4(const uint8_t *c, const v16 *scale, const v16 *offset, v16 *w) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)c), low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    const __m128i q[COL_VECS] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                 _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int v = 0; v < COL_VECS; v++) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[v]));
        w[v] = (v16)_mm512_fmadd_ps(f, (__m512)scale[v], (__m512)offset[v]);
    }
}

/* The lanes of vector v that hold one of a tile's ``cols`` outputs. */
static inline __mmask16 lanes(int64_t cols, int v) {
    const int64_t left = cols - 16 * v;
    return left >= 16 ? (__mmask16)0xFFFF
                      : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

#define WEIGHTS(BITS) weights##BITS
#define CODE_BYTES(BITS) (BITS == 8 ? 64 : 32) /* a tile's codes of one k */

/* Rows [0, m) of x ([m, k] float32), outputs [n0, n1) (n0 a multiple of 64) into y
 * ([m, n] float32): the fused way, m <= R (slots past m repeat row 0). */
#define FUSED(BITS, R)                                                                      \
    static void fused##BITS##_##R(const float *x, const uint8_t *codes, const float *params, \
                                  float *y, int64_t m, int64_t n, int64_t k, int64_t group, \
                                  int64_t n0, int64_t n1) {                                 \
        const float *xr[R];                                                                 \
        for (int r = 0; r < R; r++) xr[r] = x + (r < m ? r : 0) * k;                        \
        for (int64_t c = n0; c < n1; c += 64) {                                             \
            const uint8_t *tc = codes + (c / 64) * k * CODE_BYTES(BITS);                    \
            const float *tp = params + (c / 64) * (k / group) * 128;                        \
            v16 acc[R][COL_VECS];                                                           \
            for (int r = 0; r < R; r++)                                                     \
                for (int v = 0; v < COL_VECS; v++) acc[r][v] = (v16){0};                    \
            for (int64_t p0 = 0; p0 < k; p0 += group, tp += 128) {                          \
                const v16 *scale = (const v16 *)tp, *offset = (const v16 *)(tp + 64);       \
                for (int64_t p = p0; p < p0 + group; p++) {                                 \
                    v16 w[COL_VECS];                                                        \
                    WEIGHTS(BITS)(tc + p * CODE_BYTES(BITS), scale, offset, w);             \
                    for (int r = 0; r < R; r++) {                                           \
                        const float xs = xr[r][p];                                          \
                        for (int v = 0; v < COL_VECS; v++) acc[r][v] += xs * w[v];          \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            const int64_t cols = n1 - c < 64 ? n1 - c : 64;                                 \
            for (int r = 0; r < m; r++)                                                     \
                for (int v = 0; v < COL_VECS; v++)                                          \
                    _mm512_mask_storeu_ps(y + r * n + c + 16 * v, lanes(cols, v),           \
                                          (__m512)acc[r][v]);                               \
        }                                                                                   \
    }

/* The same, any m: the chunked way (see the top). */
#define CHUNKED(BITS)                                                                       \
    static void chunked##BITS(const float *x, const uint8_t *codes, const float *params,    \
                              float *y, int64_t m, int64_t n, int64_t k, int64_t group,     \
                              int64_t n0, int64_t n1) {                                     \
        v16 scratch[CHUNK * COL_VECS];                                                      \
        for (int64_t c = n0; c < n1; c += 64) {                                             \
            const uint8_t *tc = codes + (c / 64) * k * CODE_BYTES(BITS);                    \
            const float *tp = params + (c / 64) * (k / group) * 128;                        \
            const int64_t cols = n1 - c < 64 ? n1 - c : 64;                                 \
            for (int64_t p0 = 0; p0 < k; p0 += CHUNK) {                                     \
                const int64_t kc = k - p0 < CHUNK ? k - p0 : CHUNK;                         \
                for (int64_t g0 = p0; g0 < p0 + kc; g0 += group) { /* group | CHUNK */      \
                    const float *gp = tp + g0 / group * 128;                                \
                    for (int64_t p = g0; p < g0 + group; p++)                               \
                        WEIGHTS(BITS)(tc + p * CODE_BYTES(BITS), (const v16 *)gp,           \
                                      (const v16 *)(gp + 64), scratch + (p - p0) * COL_VECS); \
                }                                                                           \
                for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                  \
                    const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;                  \
                    const float *xr[ROWS];                                                  \
                    for (int r = 0; r < ROWS; r++) xr[r] = x + (r0 + (r < rows ? r : 0)) * k; \
                    v16 acc[ROWS][COL_VECS];                                                \
                    for (int r = 0; r < ROWS; r++)                                          \
                        for (int v = 0; v < COL_VECS; v++)                                  \
                            acc[r][v] = p0 == 0 || r >= rows ? (v16){0}                     \
                                : (v16)_mm512_maskz_loadu_ps(lanes(cols, v),                \
                                                             y + (r0 + r) * n + c + 16 * v); \
                    const v16 *wp = scratch;                                                \
                    for (int64_t p = p0; p < p0 + kc; p++, wp += COL_VECS) {                \
                        for (int r = 0; r < ROWS; r++) {                                    \
                            const float xs = xr[r][p];                                      \
                            for (int v = 0; v < COL_VECS; v++) acc[r][v] += xs * wp[v];     \
                        }                                                                   \
                    }                                                                       \
                    for (int r = 0; r < rows; r++)                                          \
                        for (int v = 0; v < COL_VECS; v++)                                  \
                            _mm512_mask_storeu_ps(y + (r0 + r) * n + c + 16 * v,            \
                                                  lanes(cols, v), (__m512)acc[r][v]);       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

FUSED(8, 1)
FUSED(8, 2)
FUSED(8, 4)
FUSED(8, 6)
FUSED(4, 1)
FUSED(4, 2)
FUSED(4, 4)
FUSED(4, 6)
CHUNKED(8)
CHUNKED(4)

void linear_q(const float *x, const uint8_t *codes, const float *params, float *y, int64_t m,
              int64_t n, int64_t k, int64_t group, int64_t bits, int64_t n0, int64_t n1) {
    typedef void Way(const float *, const uint8_t *, const float *, float *, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t);
    static Way *const fused[2][4] = {{fused4_1, fused4_2, fused4_4, fused4_6},
                                     {fused8_1, fused8_2, fused8_4, fused8_6}};
    if (m > FUSED_ROWS) {
        (bits == 8 ? chunked8 : chunked4)(x, codes, params, y, m, n, k, group, n0, n1);
        return;
    }
    for (int64_t r0 = 0; r0 < m; r0 += 6) { /* passes of at most 6 rows */
        const int64_t rows = m - r0 < 6 ? m - r0 : 6;
        fused[bits == 8][rows == 1 ? 0 : rows == 2 ? 1 : rows <= 4 ? 2 : 3](
            x + r0 * k, codes, params, y + r0 * n, rows, n, k, group, n0, n1);
    }
}
#endif
