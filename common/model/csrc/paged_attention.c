/* Paged attention on the CPU that reads each sequence's KV blocks in place.
 *
 * Query row t (hq heads of d floats) attends the first lens[t] keys of block table row
 * rows[t] (row t without ``rows``); kv head g serves query heads [g * group, (g + 1) *
 * group). A query row is computed by the same code in the same order whatever else is in
 * the call: its output does not depend on the batch, the padding, the thread count or
 * how a caller splits the rows (the decode of common/model/cpu_attention.py is batch
 * invariant).
 *
 * Head by head: the scores of every key, their softmax (max, exp and sum in key order),
 * then the V rows weighted in key order; a page read for the first head serves the rest
 * from the cache (prefetching the next pages measured no faster).
 *
 * The KV memory is common/kv/memory.py's [block, layer, K/V, slot, kv head, d] in
 * float32 or bfloat16; strides and offsets are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_value(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline float f32_value(float x) { return x; }

typedef struct {
    const int64_t *tables;   /* [rows, table_width] block ids */
    int64_t table_width;
    const int64_t *rows;     /* [T] the table row of each query row; NULL: row t */
    const int32_t *lens;     /* [T] keys each query row attends */
    int hq, hkv, d, bs;
    int64_t block_stride, layer_off, v_off, token_stride;
    float scale;
} Layout;

/* One query row for D-wide heads (a constant in the specialised copies: the loops unroll
 * and vectorise). Head by head, so that a head's query or output stays in registers over
 * all its keys; a page read for the first head serves the rest from the cache.
 * scratch: lens[t] floats. */
#define ITEM(NAME, T, VALUE)                                                                \
    static inline void NAME(const Layout *L, const float *q, const T *kv, int64_t t,        \
                            int D, float *out, float *scores) {                             \
        const int group = L->hq / L->hkv;                                                   \
        const int64_t n = L->lens[t];                                                       \
        const int64_t *table = L->tables + (L->rows ? L->rows[t] : t) * L->table_width;     \
        const T *base = kv + L->layer_off;                                                  \
        for (int h = 0; h < L->hq; h++) {                                                   \
            const float *qh = q + (t * L->hq + h) * D;                                      \
            const int64_t col = (h / group) * D;                                            \
            float m = -INFINITY, total = 0.0f;                                              \
            for (int64_t first = 0, b = 0; first < n; first += L->bs, b++) {                \
                const T *page = base + table[b] * L->block_stride + col;                    \
                const int64_t slots = n - first < L->bs ? n - first : L->bs;                \
                for (int64_t s = 0; s < slots; s++) {                                       \
                    const T *k = page + s * L->token_stride;                                \
                    float dot = 0.0f;                                                       \
                    for (int i = 0; i < D; i++) dot += qh[i] * VALUE(k[i]);                 \
                    dot *= L->scale;                                                        \
                    scores[first + s] = dot;                                                \
                    m = dot > m ? dot : m;                                                  \
                }                                                                           \
            }                                                                               \
            for (int64_t j = 0; j < n; j++) scores[j] = expf(scores[j] - m);                \
            for (int64_t j = 0; j < n; j++) total += scores[j];                             \
            float acc[D];                                                                   \
            for (int i = 0; i < D; i++) acc[i] = 0.0f;                                      \
            for (int64_t first = 0, b = 0; first < n; first += L->bs, b++) {                \
                const T *page = base + table[b] * L->block_stride + L->v_off + col;         \
                const int64_t slots = n - first < L->bs ? n - first : L->bs;                \
                for (int64_t s = 0; s < slots; s++) {                                       \
                    const T *v = page + s * L->token_stride;                                \
                    const float p = scores[first + s];                                      \
                    for (int i = 0; i < D; i++) acc[i] += p * VALUE(v[i]);                  \
                }                                                                           \
            }                                                                               \
            float *oh = out + (t * L->hq + h) * D;                                          \
            for (int i = 0; i < D; i++) oh[i] = acc[i] / total;                             \
        }                                                                                   \
    }

ITEM(item_f32, float, f32_value)
ITEM(item_bf16, uint16_t, bf16_value)

/* Items [first, last) of a call; the head width dispatches to an unrolled copy. */
#define ENTRY(NAME, T, ITEM_FN)                                                             \
    void NAME(const Layout *L, const float *q, const T *kv, int64_t first, int64_t last,    \
              float *out, float *scratch) {                                                 \
        for (int64_t item = first; item < last; item++) {  /* a query row */                                   \
            if (L->d == 64) ITEM_FN(L, q, kv, item, 64, out, scratch);                      \
            else if (L->d == 128) ITEM_FN(L, q, kv, item, 128, out, scratch);               \
            else ITEM_FN(L, q, kv, item, L->d, out, scratch);                               \
        }                                                                                   \
    }

ENTRY(paged_attention_f32, float, item_f32)
ENTRY(paged_attention_bf16, uint16_t, item_bf16)
