/* y = x W^T in float32 for any number of rows, on CPUs with AVX-512 (common/model/
 * cpu_linear.py ``PackedLinear``; ``Linear`` of a float32 model on the CPU).
 *
 * Weights are packed once as [N / 64, K, 64] (N padded with zero rows): for each k the
 * weights of a tile's 64 outputs side by side, four vectors, so each k is four vector
 * loads and one broadcast of x[k] a row, with no horizontal sums; a tile is one contiguous
 * run of memory, which streams from DRAM once and from the cache for its further rows.
 * A tile computes ROW_TILE rows x 64 outputs at a time (24 accumulators, 4 weight
 * vectors: 28 of the 32 registers). At a decode step's few rows reading the weights
 * bounds it (SmolLM2's projections at 21-26 GB/s on one AMD EPYC core, where oneDNN's
 * float32 path read them at 10-14); at a prompt's hundreds of rows it computes as fast
 * as oneDNN (BENCHMARKS.md, "Engine").
 *
 * Row invariant: every row, whichever slot of a row tile it takes and however many rows
 * the call has, runs the same loop (a short tile repeats its first row in the slots it
 * lacks and stores only its own), each output summing x[k] w[n][k] over k = 0, 1, ... in
 * order: a row's result does not depend on the batch, nor on how threads split the
 * outputs.
 *
 * Without AVX-512 the library has no ``linear_f32`` (the caller keeps oneDNN): GCC's
 * 64-byte vectors lowered for AVX2 ran 4-30x slower than oneDNN.
 */
#include <stdint.h>

#if defined(__AVX512F__)

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define ROW_TILE 6
#define COL_VECS 4 /* 64 outputs a tile */

/* Rows [0, m) of x ([m, k] float32), outputs [n0, n1) (n0 a multiple of 64) of the packed
 * weights w into y ([m, n] float32). */
void linear_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k,
                int64_t n0, int64_t n1) {
    for (int64_t c = n0; c < n1; c += 16 * COL_VECS) {
        const float *tile = w + (c / 64) * k * 64;
        const int64_t cols = n1 - c < 64 ? n1 - c : 64;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int rows = m - r0 < ROW_TILE ? (int)(m - r0) : ROW_TILE;
            const float *xr[ROW_TILE];
            for (int r = 0; r < ROW_TILE; r++) xr[r] = x + (r0 + (r < rows ? r : 0)) * k;
            v16 acc[ROW_TILE][COL_VECS];
            for (int r = 0; r < ROW_TILE; r++)
                for (int v = 0; v < COL_VECS; v++) acc[r][v] = (v16){0};
            const float *wp = tile;
            for (int64_t p = 0; p < k; p++, wp += 64) {
                v16 wv[COL_VECS];
                for (int v = 0; v < COL_VECS; v++) wv[v] = *(const v16 *)(wp + v * 16);
                for (int r = 0; r < ROW_TILE; r++) {
                    const float xs = xr[r][p];
                    for (int v = 0; v < COL_VECS; v++) acc[r][v] += xs * wv[v];
                }
            }
            for (int r = 0; r < rows; r++) {
                float *out = y + (r0 + r) * n + c;
                if (cols == 64) {
                    for (int v = 0; v < COL_VECS; v++) *(v16 *)(out + v * 16) = acc[r][v];
                } else {
                    for (int64_t j = 0; j < cols; j++) out[j] = acc[r][j / 16][j % 16];
                }
            }
        }
    }
}
#endif
