/* y = x W^T with W kept block-quantized (common/model/quant.py) and x rounded to int8,
 * integer dot products (AVX-512 VNNI ``vpdpbusd``): ``linear_dtype = "int8"``
 * (common/model/cpu_linear.py ``QuantLinear`` of ``int8``), llama.cpp's way.
 *
 * Each row's inputs are rounded per group of ``group`` (16 or 32, the weights' group):
 * d = max |x| / 127, q = x / d rounded to the nearest integer (ties to even), and the
 * group's float32 sum s kept. With w = code * scale + offset,
 *
 *     y[n] = sum over groups g of  scale[n][g] * d[g] * (sum of code * q over g)
 *                                + offset[n][g] * s[g]
 *
 * where the inner sums are exact int32 (``vpdpbusd``: 4 unsigned codes times 4 signed
 * inputs a lane), so the only rounding besides the inputs' is the per-group float32
 * multiply-adds. The weights are never made in float: a decode step reads the codes and
 * multiplies them as they are.
 *
 * Packed once: codes of 8 bits as [N / 64, K / 4, 64, 4] (the 4 codes of a k-quad of an
 * output side by side: a lane of ``vpdpbusd``); of 4 bits as [N / 64, K / 4, 2, 64]
 * bytes, each half of 64 bytes holding outputs 32h + j (low nibbles) and 32h + 16 + j
 * (high) at bytes 4j .. 4j + 3; scales and offsets as csrc/linear_q.c's, [N / 64,
 * K / group, 2, 64] float32.
 *
 * Row invariant: a row's inputs are rounded alone, and its outputs summed in the same
 * order whatever the other rows, the pass that takes it or the threads' split.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define COL_VECS 4 /* 64 outputs a tile */

/* Row x ([k] float32) rounded: q ([k] int8), d and s ([k / group] float32). */
void int8_row(const float *x, int64_t k, int64_t group, int8_t *q, float *d, float *s) {
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, g++) {
        __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
        for (int64_t p = g0; p < g0 + group; p += 16) {
            const __m512 v = _mm512_loadu_ps(x + p);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
            sum = _mm512_add_ps(sum, v);
        }
        const float top = _mm512_reduce_max_ps(amax), scale = top / 127.0f;
        const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        d[g] = scale;
        s[g] = _mm512_reduce_add_ps(sum);
        for (int64_t p = g0; p < g0 + group; p += 16) {
            const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + p), inv));
            _mm_storeu_si128((__m128i *)(q + p), _mm512_cvtsepi32_epi8(r));
        }
    }
}

/* The 4 code vectors (16 outputs x 4 k each) of k-quad ``quad`` of a tile. */
static inline void codes8(const uint8_t *tile, int64_t quad, __m512i *c) {
    const uint8_t *at = tile + quad * 256;
    for (int v = 0; v < COL_VECS; v++) c[v] = _mm512_loadu_si512(at + 64 * v);
}

static inline void codes4(const uint8_t *tile, int64_t quad, __m512i *c) {
    const uint8_t *at = tile + quad * 128;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m512i b = _mm512_loadu_si512(at + 64 * h);
        c[2 * h] = _mm512_and_si512(b, low);
        c[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
}

static inline __mmask16 lanes(int64_t cols, int v) {
    const int64_t left = cols - 16 * v;
    return left >= 16 ? (__mmask16)0xFFFF
                      : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* Rows [0, m) (m <= R; slots past m repeat row 0) of the rounded inputs (q, d, s: row
 * r's at r * k, r * groups), outputs [n0, n1) of the packed codes and params into y. */
#define PASS(BITS, R)                                                                       \
    static void pass##BITS##_##R(const int8_t *q, const float *d, const float *s,           \
                                 const uint8_t *codes, const float *params, float *y,       \
                                 int64_t m, int64_t n, int64_t k, int64_t group,            \
                                 int64_t n0, int64_t n1) {                                  \
        const int64_t groups = k / group, quads = group / 4;                                \
        int64_t row[R];                                                                     \
        for (int r = 0; r < R; r++) row[r] = r < m ? r : 0;                                 \
        for (int64_t c = n0; c < n1; c += 64) {                                             \
            const uint8_t *tile = codes + (c / 64) * k * BITS * 8;                          \
            const float *tp = params + (c / 64) * groups * 128;                             \
            __m512 acc[R][COL_VECS];                                                        \
            for (int r = 0; r < R; r++)                                                     \
                for (int v = 0; v < COL_VECS; v++) acc[r][v] = _mm512_setzero_ps();         \
            for (int64_t g = 0; g < groups; g++, tp += 128) {                               \
                __m512i sum[R][COL_VECS];                                                   \
                for (int r = 0; r < R; r++)                                                 \
                    for (int v = 0; v < COL_VECS; v++) sum[r][v] = _mm512_setzero_si512(); \
                for (int64_t u = g * quads; u < (g + 1) * quads; u++) {                     \
                    __m512i cv[COL_VECS];                                                   \
                    codes##BITS(tile, u, cv);                                               \
                    for (int r = 0; r < R; r++) {                                           \
                        const __m512i xv =                                                  \
                            _mm512_set1_epi32(*(const int32_t *)(q + row[r] * k + 4 * u));  \
                        for (int v = 0; v < COL_VECS; v++)                                  \
                            sum[r][v] = _mm512_dpbusd_epi32(sum[r][v], cv[v], xv);          \
                    }                                                                       \
                }                                                                           \
                for (int r = 0; r < R; r++) {                                               \
                    const __m512 dr = _mm512_set1_ps(d[row[r] * groups + g]);               \
                    const __m512 sr = _mm512_set1_ps(s[row[r] * groups + g]);               \
                    for (int v = 0; v < COL_VECS; v++) {                                    \
                        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(tp + 16 * v), dr); \
                        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][v]), scale,   \
                                                    acc[r][v]);                             \
                        acc[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(tp + 64 + 16 * v), sr,  \
                                                    acc[r][v]);                             \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            const int64_t cols = n1 - c < 64 ? n1 - c : 64;                                 \
            for (int r = 0; r < m; r++)                                                     \
                for (int v = 0; v < COL_VECS; v++)                                          \
                    _mm512_mask_storeu_ps(y + r * n + c + 16 * v, lanes(cols, v), acc[r][v]); \
        }                                                                                   \
    }

PASS(8, 1)
PASS(8, 2)
PASS(8, 3)
PASS(4, 1)
PASS(4, 2)
PASS(4, 3)

/* Rows [0, m) in passes of at most 3 (12 int32 and 12 float32 accumulators). */
void linear_int8(const int8_t *q, const float *d, const float *s, const uint8_t *codes,
                 const float *params, float *y, int64_t m, int64_t n, int64_t k,
                 int64_t group, int64_t bits, int64_t n0, int64_t n1) {
    typedef void Pass(const int8_t *, const float *, const float *, const uint8_t *,
                      const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t);
    static Pass *const passes[2][3] = {{pass4_1, pass4_2, pass4_3},
                                       {pass8_1, pass8_2, pass8_3}};
    const int64_t groups = k / group;
    for (int64_t r0 = 0; r0 < m; r0 += 3) {
        const int64_t rows = m - r0 < 3 ? m - r0 : 3;
        passes[bits == 8][rows - 1](q + r0 * k, d + r0 * groups, s + r0 * groups, codes,
                                    params, y + r0 * n, rows, n, k, group, n0, n1);
    }
}
#endif
