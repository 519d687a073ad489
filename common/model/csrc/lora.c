/* LoRA updates of a fused linear's outputs (common/model/lora.py), each row alone:
 *
 *     y[r] += B (A x[r])
 *
 * A^T [k, rank] holds the stacked A matrices of the linear's adapted parts, transposed;
 * B^T [rank, n] their B matrices (scaled); both float32, or both bfloat16 (``bf16``: a
 * worker whose linears multiply in it), made float32 as loaded; part p's outputs are columns [cols[2p],
 * cols[2p + 1]) and take only its A rows [ranks[p], ranks[p + 1]) (B is block-diagonal:
 * its zero blocks are never read, nor an unadapted part's columns touched). Both steps
 * of a row run in one call: a decode step's few rows cost one call a linear instead of
 * two matmuls and an add.
 *
 * Both steps are outer products, as csrc/linear_f32.c's tiles: t = sum_i x[i] A^T[i, :],
 * then y += sum_j t[j] B^T[j, :], each output lane a chain of multiply-adds in order,
 * BLOCK rows a pass sharing each weight vector they load. A row's chain is the same
 * whatever rows share its pass (or none), threads or addresses (unaligned loads, tails
 * masked): its update does not depend on the batch.
 */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MAX_RANK 1024
#define BLOCK 4 /* rows a pass */
#define WIDE 4  /* vectors of 16 outputs a pass: t's 64 lanes, or y's 64 columns */
#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 tail(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 weights from element ``at`` of ``w``: float32, or (``bf16``, a constant where inlined)
 * bfloat16 made float32 exactly (its bits the high half). */
INLINE __m512 weights(__mmask16 m, const void *w, int64_t at, const int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)w + at);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* t[r][j0 .. j0 + 16 nv) of ``nr`` rows (both constants where inlined) */
INLINE void shrink_pass(const float *const *x, int64_t k, const void *at, int64_t rank,
                        int64_t j0, float (*t)[MAX_RANK], const int nr, const int nv,
                        const int bf16) {
    __m512 acc[BLOCK][WIDE];
    __mmask16 m[WIDE];
    for (int v = 0; v < nv; v++) m[v] = tail(rank - j0 - 16 * v);
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 a[WIDE];
        for (int v = 0; v < nv; v++)
            a[v] = weights(m[v], at, i * rank + j0 + 16 * v, bf16);
        for (int r = 0; r < nr; r++) {
            const __m512 xi = _mm512_set1_ps(x[r][i]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(xi, a[v], acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(t[r] + j0 + 16 * v, m[v], acc[r][v]);
}

/* y's columns [c, c + 16 nv) (up to ``end``) of ``nr`` rows += B^T[j0 .. j1, :] t[r] */
INLINE void expand_pass(float *const *y, int64_t n, const void *bt, int64_t c, int64_t end,
                        int64_t j0, int64_t j1, float (*t)[MAX_RANK], const int nr,
                        const int nv, const int bf16) {
    __m512 acc[BLOCK][WIDE];
    __mmask16 m[WIDE];
    for (int v = 0; v < nv; v++) m[v] = tail(end - c - 16 * v);
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        __m512 b[WIDE];
        for (int v = 0; v < nv; v++) b[v] = weights(m[v], bt, j * n + c + 16 * v, bf16);
        for (int r = 0; r < nr; r++) {
            const __m512 tj = _mm512_set1_ps(t[r][j]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(tj, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)  /* the update, then added: as y + B (A x) */
        for (int v = 0; v < nv; v++) {
            float *at = y[r] + c + 16 * v;
            _mm512_mask_storeu_ps(at, m[v], _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], at),
                                                          acc[r][v]));
        }
}

/* A pass's vectors (1 .. WIDE) made a constant, for the registers */
#define BY_WIDTH(nv, CALL)                                                                  \
    switch (nv) {                                                                           \
    case 1: CALL(1); break;                                                                 \
    case 2: CALL(2); break;                                                                 \
    case 3: CALL(3); break;                                                                 \
    default: CALL(4); break;                                                                \
    }

INLINE int64_t vectors(int64_t left) {
    const int64_t v = (left + 15) / 16;
    return v < WIDE ? v : WIDE;
}

INLINE void lora_rows(const float *const *x, float *const *y, int64_t k, int64_t n,
                      const void *at, const void *bt, const int64_t *cols,
                      const int64_t *ranks, int64_t parts, float (*t)[MAX_RANK], const int nr,
                      const int bf16) {
    const int64_t rank = ranks[parts];
    for (int64_t j0 = 0; j0 < rank; j0 += 16 * WIDE) {
#define SHRINK(NV) shrink_pass(x, k, at, rank, j0, t, nr, NV, bf16)
        BY_WIDTH(vectors(rank - j0), SHRINK)
#undef SHRINK
    }
    for (int64_t p = 0; p < parts; p++) {
        const int64_t end = cols[2 * p + 1];
        for (int64_t c = cols[2 * p]; c < end; c += 16 * WIDE) {
#define EXPAND(NV) expand_pass(y, n, bt, c, end, ranks[p], ranks[p + 1], t, nr, NV, bf16)
            BY_WIDTH(vectors(end - c), EXPAND)
#undef EXPAND
        }
    }
}

int64_t lora_max_rank(void) { return MAX_RANK; }

/* Rows rows[first .. last) (NULL: first .. last) of x [*, k] and y [*, n], BLOCK at a
 * time, the rest one at a time (csrc/parallel.c's lora_f32_par splits the rows). */
void lora_f32(const float *x, float *y, const int64_t *rows, int64_t k, int64_t n,
              const void *at, const void *bt, int64_t bf16, const int64_t *cols,
              const int64_t *ranks, int64_t parts, int64_t first, int64_t last) {
    float t[BLOCK][MAX_RANK];
    const float *xs[BLOCK];
    float *ys[BLOCK];
    for (int64_t i = first; i < last;) {
        const int nr = last - i >= BLOCK ? BLOCK : 1;
        for (int r = 0; r < nr; r++) {
            const int64_t row = rows ? rows[i + r] : i + r;
            xs[r] = x + row * k;
            ys[r] = y + row * n;
        }
        if (bf16 && nr == BLOCK)
            lora_rows(xs, ys, k, n, at, bt, cols, ranks, parts, t, BLOCK, 1);
        else if (bf16)
            lora_rows(xs, ys, k, n, at, bt, cols, ranks, parts, t, 1, 1);
        else if (nr == BLOCK)
            lora_rows(xs, ys, k, n, at, bt, cols, ranks, parts, t, BLOCK, 0);
        else
            lora_rows(xs, ys, k, n, at, bt, cols, ranks, parts, t, 1, 0);
        i += nr;
    }
}
#endif
