/* y = x W^T for a decode step's few rows, with bfloat16 weights and activations and
 * float32 sums, on CPUs with AVX-512 BF16 (vdpbf16ps).
 *
 * Weights are packed once (common/model/cpu_linear.py) as [N / 64, K / 2, 64, 2] (N
 * padded with zero rows): output n's weights k and k + 1 side by side, so one vector
 * holds 16 outputs' pair of weights and ``vdpbf16ps`` adds x[k] w[n][k] + x[k + 1]
 * w[n][k + 1] to 16 outputs at once, with no horizontal sums; a tile of 64 outputs is
 * one contiguous run of memory, which streams from DRAM once (then from the cache for
 * its further rows). A tile computes 4 rows x 64 outputs at a time (16 accumulators), or
 * 8 where the call has 5-16 rows (their rows then read each tile once: a batch-8 step of
 * SmolLM2 0.87-0.89x the time): at a decode step's few rows what bounds it is reading the
 * weights.
 *
 * Row invariant: each output element is the sum over k pairs in order 0, 1, ... of the
 * same products, whatever other rows or output tiles the call has and whichever tile of
 * rows takes it: a row's result does not depend on the batch, nor on how threads split
 * the outputs.
 *
 * Without AVX-512 BF16 the library has no ``linear_bf16`` (the caller keeps oneDNN).
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define COL_VECS 4  /* 64 outputs a tile */

/* Rows [0, m) of x ([m, k] bfloat16), outputs [n0, n1) (n0 a multiple of 64, n1 of 16)
 * of the packed weights w into y ([m, n] float32), ROWS rows of a tile at a time. */
#define TILE_LOOP(NAME, ROWS)                                                               \
    static void NAME(const uint16_t *x, const uint16_t *w, float *y, int64_t m, int64_t n, \
                     int64_t k, int64_t n0, int64_t n1) {                                   \
        const int64_t pairs = k / 2;                                                        \
        for (int64_t c = n0; c < n1; c += 16 * COL_VECS) {                                  \
            const int vecs = (n1 - c) / 16 < COL_VECS ? (int)((n1 - c) / 16) : COL_VECS;    \
            const uint16_t *tile = w + (c / 64) * pairs * 128;                              \
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                      \
                const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;                      \
                __m512 acc[ROWS][COL_VECS];                                                 \
                for (int r = 0; r < ROWS; r++)                                              \
                    for (int v = 0; v < COL_VECS; v++) acc[r][v] = _mm512_setzero_ps();     \
                const int32_t *xr[ROWS];                                                    \
                for (int r = 0; r < ROWS; r++)                                              \
                    xr[r] = (const int32_t *)(x + (r0 + (r < rows ? r : 0)) * k);           \
                const uint16_t *wp = tile;                                                  \
                if (vecs == COL_VECS) { /* a whole tile, unrolled */                        \
                    for (int64_t p = 0; p < pairs; p++, wp += 128) {                        \
                        __m512bh wv[COL_VECS];                                              \
                        for (int v = 0; v < COL_VECS; v++)                                  \
                            wv[v] = (__m512bh)_mm512_loadu_si512(wp + v * 32);              \
                        for (int r = 0; r < ROWS; r++) {                                    \
                            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[r][p]);      \
                            for (int v = 0; v < COL_VECS; v++)                              \
                                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);         \
                        }                                                                   \
                    }                                                                       \
                } else {                                                                    \
                    for (int64_t p = 0; p < pairs; p++, wp += 128) {                        \
                        for (int r = 0; r < ROWS; r++) {                                    \
                            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[r][p]);      \
                            for (int v = 0; v < vecs; v++) {                                \
                                const void *at = wp + v * 32;                               \
                                acc[r][v] = _mm512_dpbf16_ps(                               \
                                    acc[r][v], xv, (__m512bh)_mm512_loadu_si512(at));       \
                            }                                                               \
                        }                                                                   \
                    }                                                                       \
                }                                                                           \
                for (int r = 0; r < rows; r++)                                              \
                    for (int v = 0; v < vecs; v++)                                          \
                        _mm512_storeu_ps(y + (r0 + r) * n + c + v * 16, acc[r][v]);         \
            }                                                                               \
        }                                                                                   \
    }

TILE_LOOP(rows_by_4, 4) /* 16 accumulators */
TILE_LOOP(rows_by_8, 8) /* 32: some spill, but 5-16 rows read a tile once */

void linear_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t m, int64_t n,
                 int64_t k, int64_t n0, int64_t n1) {
    if (m > 4 && m <= 16)
        rows_by_8(x, w, y, m, n, k, n0, n1);
    else
        rows_by_4(x, w, y, m, n, k, n0, n1);
}
#endif
