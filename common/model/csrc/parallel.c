/* The kernels of a call split over threads with OpenMP (``*_par``, ``threads`` of them).
 *
 * The team is torch's own: the library needs libgomp.so.1, and the dynamic loader hands it
 * the copy torch loaded already (same soname), so the kernels and torch's ops take turns on
 * one team of threads. A pool of our own beside it was slower on 2 cores than no split at
 * all: torch's OpenMP workers spin for a while after each of its ops, on the cores our
 * threads wanted. Built without OpenMP (a compiler without it), every call runs whole on
 * the calling thread.
 *
 * Each thread computes whole output tiles or query rows, each alone, so a row's result
 * does not depend on how many threads split the call.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#define EACH(threads, ...)                                                                  \
    _Pragma("omp parallel num_threads(threads)") {                                          \
        const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();           \
        __VA_ARGS__                                                                         \
    }
#else
#define EACH(threads, ...)                                                                  \
    {                                                                                       \
        const int64_t part = 0, parts = 1;                                                  \
        (void)threads;                                                                      \
        __VA_ARGS__                                                                         \
    }
#endif

int crescent_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Piece ``part`` of ``parts`` of [0, n) in whole ``grain``s: [*first, *last). */
static void piece(int64_t n, int64_t grain, int64_t part, int64_t parts, int64_t *first,
                  int64_t *last) {
    const int64_t per = ((n + grain - 1) / grain + parts - 1) / parts * grain;
    *first = part * per < n ? part * per : n;
    *last = (part + 1) * per < n ? (part + 1) * per : n;
}

/* The body (the macro's last argument) for each unit of a tile of 64 outputs by ``block``
 * rows of a call of m rows and n outputs, a contiguous run of units a thread, tile by
 * tile (a thread's rows of one tile read its weights from the cache): a prompt's many
 * rows split over many threads even where the outputs are few tiles (576 outputs: 9).
 * The body sees the unit's first output c, the end of its outputs c1, its first row r0
 * and its count of rows. */
#define TILES_BY_ROWS(threads, m, n, block, ...)                                           \
    {                                                                                       \
        const int64_t blocks_ = ((m) + (block) - 1) / (block), tiles_ = ((n) + 63) / 64;    \
        EACH(threads, {                                                                     \
            int64_t first, last;                                                            \
            piece(tiles_ * blocks_, 1, part, parts, &first, &last);                         \
            for (int64_t u = first; u < last; u++) {                                        \
                const int64_t c = u / blocks_ * 64, r0 = u % blocks_ * (block);             \
                const int64_t rows = (m) - r0 < (block) ? (m) - r0 : (block);               \
                const int64_t c1 = c + 64 < (n) ? c + 64 : (n);                             \
                __VA_ARGS__                                                                 \
            }                                                                               \
        })                                                                                  \
    }

/* TILES_BY_ROWS over the linears of one shape of a mixture of experts, in one team: linear
 * e takes the call's rows [starts[e], starts[e + 1]) (``starts``: experts + 1 offsets).
 * The units, expert by expert, then tile by tile, split in contiguous runs over the
 * threads; the body also sees the unit's expert e (r0 counts from the call's first row). */
#define EXPERT_TILES(threads, experts, starts, n, block, ...)                              \
    {                                                                                       \
        const int64_t tiles_ = ((n) + 63) / 64;                                             \
        int64_t total_ = 0;                                                                 \
        for (int64_t e_ = 0; e_ < (experts); e_++)                                          \
            total_ += tiles_ * ((starts[e_ + 1] - starts[e_] + (block) - 1) / (block));     \
        EACH(threads, {                                                                     \
            int64_t first, last, e = 0, base = 0, blocks_ = 0;                              \
            piece(total_, 1, part, parts, &first, &last);                                   \
            for (int64_t u = first; u < last; u++) {                                        \
                for (;;) { /* the expert of unit u: those before it end at base */          \
                    blocks_ = (starts[e + 1] - starts[e] + (block) - 1) / (block);          \
                    if (u < base + tiles_ * blocks_) break;                                 \
                    base += tiles_ * blocks_;                                               \
                    e++;                                                                    \
                }                                                                           \
                const int64_t v = u - base, c = v / blocks_ * 64;                           \
                const int64_t r0 = starts[e] + v % blocks_ * (block);                       \
                const int64_t rows = starts[e + 1] - r0 < (block) ? starts[e + 1] - r0 : (block); \
                const int64_t c1 = c + 64 < (n) ? c + 64 : (n);                             \
                __VA_ARGS__                                                                 \
            }                                                                               \
        })                                                                                  \
    }

/* paged_attention.c */
typedef struct Layout Layout;
void paged_attention_f32(const Layout *L, const float *q, const float *kv, int64_t first,
                         int64_t last, float *out, float *scratch);
void paged_attention_bf16(const Layout *L, const float *q, const uint16_t *kv, int64_t first,
                          int64_t last, float *out, float *scratch);
void chunk_rows(const Layout *L, const float *q, const float *kt, const float *vv,
                int64_t start, int64_t T, int64_t part, int64_t parts, float *out);

/* Decode attention of query rows [0, t): contiguous runs of rows a thread, each with
 * ``per_thread`` floats of ``scratch`` (threads x per_thread: heads x (the longest row's
 * keys rounded up to 16, plus the head width): a row's scores and sums). */
#define ATTENTION_PAR(NAME, T)                                                              \
    void NAME##_par(const Layout *L, const float *q, const T *kv, int64_t t, float *out,    \
                    float *scratch, int64_t per_thread, int64_t threads) {                  \
        EACH(threads, {                                                                     \
            int64_t first, last;                                                            \
            piece(t, 1, part, parts, &first, &last);                                        \
            if (first < last) NAME(L, q, kv, first, last, out, scratch + part * per_thread);\
        })                                                                                  \
    }

ATTENTION_PAR(paged_attention_f32, float)
ATTENTION_PAR(paged_attention_bf16, uint16_t)

/* A prompt chunk's rows: chunk_rows interleaves its tiles between the parts. */
void chunk_rows_par(const Layout *L, const float *q, const float *kt, const float *vv,
                    int64_t start, int64_t T, float *out, int64_t threads) {
    EACH(threads, { chunk_rows(L, q, kt, vv, start, T, part, parts, out); })
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* linear_bf16.c */
void linear_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t m, int64_t n,
                 int64_t k, int64_t n0, int64_t n1);

/* All n outputs, in whole tiles of 64 a thread. */
void linear_bf16_par(const uint16_t *x, const uint16_t *w, float *y, int64_t m, int64_t n,
                     int64_t k, int64_t threads) {
    EACH(threads, {
        int64_t first, last;
        piece(n, 64, part, parts, &first, &last);
        if (first < last) linear_bf16(x, w, y, m, n, k, first, last);
    })
}
#endif

#if defined(__AVX512F__)
/* linear_f32.c */
void linear_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k,
                int64_t n0, int64_t n1);

/* All m rows and n outputs, in units of a tile by ``block`` rows (TILES_BY_ROWS). */
void linear_f32_par(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k,
                    int64_t block, int64_t threads) {
    TILES_BY_ROWS(threads, m, n, block,
                  { linear_f32(x + r0 * k, w, y + r0 * n, rows, n, k, c, c1); })
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* lora.c */
void lora_f32(const float *x, float *y, const int64_t *rows, int64_t k, int64_t n,
              const void *at, const void *bt, int64_t bf16, const int64_t *cols,
              const int64_t *ranks, int64_t parts, int64_t first, int64_t last);

/* A LoRA update of m rows: contiguous runs of rows a thread. */
void lora_f32_par(const float *x, float *y, const int64_t *rows, int64_t m, int64_t k,
                  int64_t n, const void *at, const void *bt, int64_t bf16,
                  const int64_t *cols, const int64_t *ranks, int64_t linear_parts,
                  int64_t threads) {
    EACH(threads, {
        int64_t first, last;
        piece(m, 1, part, parts, &first, &last);
        if (first < last)
            lora_f32(x, y, rows, k, n, at, bt, bf16, cols, ranks, linear_parts, first, last);
    })
}
#endif

#if defined(__AVX512F__)

/* linear_q.c */
void linear_q(const float *x, const uint8_t *codes, const float *params, float *y, int64_t m,
              int64_t n, int64_t k, int64_t group, int64_t bits, int64_t n0, int64_t n1);

/* As linear_f32_par (a tile's weights are made once a unit: at a prompt's rows, once per
 * ``block`` of them). */
void linear_q_par(const float *x, const uint8_t *codes, const float *params, float *y,
                  int64_t m, int64_t n, int64_t k, int64_t group, int64_t bits, int64_t block,
                  int64_t threads) {
    TILES_BY_ROWS(threads, m, n, block, {
        linear_q(x + r0 * k, codes, params, y + r0 * n, rows, n, k, group, bits, c, c1);
    })
}

/* Each expert's rows by its own weights (``codes``, ``params``: an address an expert), in
 * one team (EXPERT_TILES). */
void linear_q_experts_par(const float *x, const int64_t *starts, int64_t experts,
                          const int64_t *codes, const int64_t *params, float *y, int64_t n,
                          int64_t k, int64_t group, int64_t bits, int64_t block,
                          int64_t threads) {
    EXPERT_TILES(threads, experts, starts, n, block, {
        linear_q(x + r0 * k, (const uint8_t *)codes[e], (const float *)params[e], y + r0 * n,
                 rows, n, k, group, bits, c, c1);
    })
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* linear_int8.c */
void int8_row(const float *x, int64_t k, int64_t group, int8_t *q, float *d, float *s);
void linear_int8(const int8_t *q, const float *d, const float *s, const uint8_t *codes,
                 const float *params, float *y, int64_t m, int64_t n, int64_t k,
                 int64_t group, int64_t bits, int64_t n0, int64_t n1);

/* The rows rounded (``q``, ``d``, ``s``: the caller's scratch), a run of rows a thread;
 * then units of a tile by ``block`` rows (TILES_BY_ROWS). */
void linear_int8_par(const float *x, int8_t *q, float *d, float *s, const uint8_t *codes,
                     const float *params, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t group, int64_t bits, int64_t block, int64_t threads) {
    const int64_t groups = k / group;
    EACH(threads, {
        int64_t first, last;
        piece(m, 1, part, parts, &first, &last);
        for (int64_t r = first; r < last; r++)
            int8_row(x + r * k, k, group, q + r * k, d + r * groups, s + r * groups);
    })
    TILES_BY_ROWS(threads, m, n, block, {
        linear_int8(q + r0 * k, d + r0 * groups, s + r0 * groups, codes, params, y + r0 * n,
                    rows, n, k, group, bits, c, c1);
    })
}

/* linear_int8_par for each expert's rows (EXPERT_TILES), all rows rounded first. */
void linear_int8_experts_par(const float *x, int8_t *q, float *d, float *s,
                             const int64_t *starts, int64_t experts, const int64_t *codes,
                             const int64_t *params, float *y, int64_t n, int64_t k,
                             int64_t group, int64_t bits, int64_t block, int64_t threads) {
    const int64_t groups = k / group;
    EACH(threads, {
        int64_t first, last;
        piece(starts[experts], 1, part, parts, &first, &last);
        for (int64_t r = first; r < last; r++)
            int8_row(x + r * k, k, group, q + r * k, d + r * groups, s + r * groups);
    })
    EXPERT_TILES(threads, experts, starts, n, block, {
        linear_int8(q + r0 * k, d + r0 * groups, s + r0 * groups, (const uint8_t *)codes[e],
                    (const float *)params[e], y + r0 * n, rows, n, k, group, bits, c, c1);
    })
}
#endif
