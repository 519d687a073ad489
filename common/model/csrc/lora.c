/* LoRA updates of a fused linear's outputs (common/model/lora.py), each row alone:
 *
 *     y[r] += B (A x[r])
 *
 * A [rank, k] holds the stacked A matrices of the linear's adapted parts, B^T [rank, n]
 * their B matrices (scaled); part p's outputs are columns [cols[2p], cols[2p + 1]) and
 * take only its A rows [ranks[p], ranks[p + 1]) (B is block-diagonal: its zero blocks
 * are never read, nor an unadapted part's columns touched).
 * Both steps of a row run in one call: its rank values stay in registers' reach, and a
 * decode step's few rows cost one call a linear instead of two matmuls and an add.
 *
 * A row's sums run in one fixed order whatever the call's rows, threads or addresses
 * (unaligned loads, the tail masked): its update does not depend on the batch.
 */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define MAX_RANK 1024
#define BLOCK 4 /* rows a pass: each A and B^T vector loaded once for them */
#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* t[r][j] = A_j . x_r for ``nr`` rows (a constant where inlined): per row two sums, over
 * the even and the odd 16-vectors (the last one masked into the first sum), then reduced:
 * the same operations in the same order for a row whatever rows share its pass. */
INLINE void shrink(const float *const *x, int64_t k, const float *a, int64_t rank,
                   float (*t)[MAX_RANK], const int nr) {
    for (int64_t j = 0; j < rank; j++) {
        const float *aj = a + j * k;
        __m512 s0[BLOCK], s1[BLOCK];
        for (int r = 0; r < nr; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= k; i += 32) {
            const __m512 a0 = _mm512_loadu_ps(aj + i), a1 = _mm512_loadu_ps(aj + i + 16);
            for (int r = 0; r < nr; r++) {
                s0[r] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(x[r] + i), s0[r]);
                s1[r] = _mm512_fmadd_ps(a1, _mm512_loadu_ps(x[r] + i + 16), s1[r]);
            }
        }
        for (; i < k; i += 16) {
            const __mmask16 m = tail(k - i);
            const __m512 a0 = _mm512_maskz_loadu_ps(m, aj + i);
            for (int r = 0; r < nr; r++)
                s0[r] = _mm512_fmadd_ps(a0, _mm512_maskz_loadu_ps(m, x[r] + i), s0[r]);
        }
        for (int r = 0; r < nr; r++) t[r][j] = _mm512_reduce_add_ps(_mm512_add_ps(s0[r], s1[r]));
    }
}

/* y_r's columns of each part += its B^T rows times t[r]: per 16 columns the update summed
 * from zero over the part's rank, in order, then added to y (as y + B (A x)). */
INLINE void expand(float *const *y, int64_t n, const float *bt, const int64_t *cols,
                   const int64_t *ranks, int64_t parts, float (*t)[MAX_RANK], const int nr) {
    for (int64_t p = 0; p < parts; p++) {
        for (int64_t c = cols[2 * p]; c < cols[2 * p + 1]; c += 16) {
            const __mmask16 m = tail(cols[2 * p + 1] - c);
            __m512 acc[BLOCK];
            for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t j = ranks[p]; j < ranks[p + 1]; j++) {
                const __m512 b = _mm512_maskz_loadu_ps(m, bt + j * n + c);
                for (int r = 0; r < nr; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(t[r][j]), b, acc[r]);
            }
            for (int r = 0; r < nr; r++)
                _mm512_mask_storeu_ps(y[r] + c, m,
                                      _mm512_add_ps(_mm512_maskz_loadu_ps(m, y[r] + c), acc[r]));
        }
    }
}

int64_t lora_max_rank(void) { return MAX_RANK; }

/* Rows rows[first .. last) (NULL: first .. last) of x [*, k] and y [*, n], BLOCK at a
 * time, the rest one at a time (csrc/parallel.c's lora_f32_par splits the rows). */
void lora_f32(const float *x, float *y, const int64_t *rows, int64_t k, int64_t n,
              const float *a, const float *bt, const int64_t *cols, const int64_t *ranks,
              int64_t parts, int64_t first, int64_t last) {
    float t[BLOCK][MAX_RANK];
    const int64_t rank = ranks[parts];
    const float *xs[BLOCK];
    float *ys[BLOCK];
    for (int64_t i = first; i < last;) {
        const int nr = last - i >= BLOCK ? BLOCK : 1;
        for (int r = 0; r < nr; r++) {
            const int64_t row = rows ? rows[i + r] : i + r;
            xs[r] = x + row * k;
            ys[r] = y + row * n;
        }
        if (nr == BLOCK) {
            shrink(xs, k, a, rank, t, BLOCK);
            expand(ys, n, bt, cols, ranks, parts, t, BLOCK);
        } else {
            shrink(xs, k, a, rank, t, 1);
            expand(ys, n, bt, cols, ranks, parts, t, 1);
        }
        i += nr;
    }
}
#endif
