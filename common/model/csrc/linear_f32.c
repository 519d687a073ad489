/* y = x W^T in float32 for any number of rows, on CPUs with AVX-512 (common/model/
 * cpu_linear.py ``PackedLinear``; ``Linear`` of a float32 model on the CPU).
 *
 * Weights are packed once as [N / 64, K, 64] (N padded with zero rows): for each k the
 * weights of a tile's 64 outputs side by side, four vectors, so each k is four vector
 * loads and one broadcast of x[k] a row, with no horizontal sums; a tile is one contiguous
 * run of memory, which streams from DRAM once and from the cache for its further rows.
 * A tile computes 6 rows x 64 outputs at a time, or 8 where the call has 7-16 rows (a
 * decode step's: its rows then read each tile once). At a decode step's few rows reading
 * the weights bounds it (SmolLM2's projections at 21-26 GB/s on one AMD EPYC core, where
 * oneDNN's float32 path read them at 10-14); at a prompt's hundreds of rows it computes
 * as fast as oneDNN (BENCHMARKS.md, "Engine").
 *
 * Row invariant: every row, whichever slot of a row tile it takes, in tiles of 6 rows or
 * of 8, and however many rows the call has, sums x[k] w[n][k] into each output over
 * k = 0, 1, ... in order, one multiply-add at a time (a short tile repeats its first row in
 * the slots it lacks and stores only its own): a row's result does not depend on the
 * batch, nor on how threads split the rows and outputs.
 *
 * Without AVX-512 the library has no ``linear_f32`` (the caller keeps oneDNN): GCC's
 * 64-byte vectors lowered for AVX2 ran 4-30x slower than oneDNN.
 */
#include <stdint.h>

#if defined(__AVX512F__)

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define COL_VECS 4 /* 64 outputs a tile */

/* Rows [0, m) of x ([m, k] float32), outputs [n0, n1) (n0 a multiple of 64) of the packed
 * weights w into y ([m, n] float32), ROWS rows of a tile at a time. */
#define TILE_LOOP(NAME, ROWS)                                                               \
    static void NAME(const float *x, const float *w, float *y, int64_t m, int64_t n,        \
                     int64_t k, int64_t n0, int64_t n1) {                                   \
        for (int64_t c = n0; c < n1; c += 16 * COL_VECS) {                                  \
            const float *tile = w + (c / 64) * k * 64;                                      \
            const int64_t cols = n1 - c < 64 ? n1 - c : 64;                                 \
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                      \
                const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;                      \
                const float *xr[ROWS];                                                      \
                for (int r = 0; r < ROWS; r++) xr[r] = x + (r0 + (r < rows ? r : 0)) * k;   \
                v16 acc[ROWS][COL_VECS];                                                    \
                for (int r = 0; r < ROWS; r++)                                              \
                    for (int v = 0; v < COL_VECS; v++) acc[r][v] = (v16){0};                \
                const float *wp = tile;                                                     \
                for (int64_t p = 0; p < k; p++, wp += 64) {                                 \
                    v16 wv[COL_VECS];                                                       \
                    for (int v = 0; v < COL_VECS; v++) wv[v] = *(const v16 *)(wp + v * 16); \
                    for (int r = 0; r < ROWS; r++) {                                        \
                        const float xs = xr[r][p];                                          \
                        for (int v = 0; v < COL_VECS; v++) acc[r][v] += xs * wv[v];         \
                    }                                                                       \
                }                                                                           \
                for (int r = 0; r < rows; r++) {                                            \
                    float *out = y + (r0 + r) * n + c;                                      \
                    if (cols == 64) {                                                       \
                        for (int v = 0; v < COL_VECS; v++)                                  \
                            *(v16 *)(out + v * 16) = acc[r][v];                             \
                    } else {                                                                \
                        for (int64_t j = 0; j < cols; j++) out[j] = acc[r][j / 16][j % 16]; \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

TILE_LOOP(rows_by_6, 6) /* 24 accumulators and 4 weight vectors: 28 of the 32 registers */
TILE_LOOP(rows_by_8, 8) /* 32 accumulators: some spill, but 7-16 rows read a tile once */

void linear_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k,
                int64_t n0, int64_t n1) {
    if (m > 6 && m <= 16)
        rows_by_8(x, w, y, m, n, k, n0, n1);
    else
        rows_by_6(x, w, y, m, n, k, n0, n1);
}
#endif
