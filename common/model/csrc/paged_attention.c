/* Paged attention on the CPU that reads each sequence's KV blocks in place.
 *
 * Query row t (hq heads of d floats) attends the first lens[t] keys of block table row
 * rows[t] (row t without ``rows``), or of them the last ``window`` (a sliding layer's: the
 * blocks before its window are not read); kv head g serves query heads [g * group,
 * (g + 1) * group). A query row is computed by the same code in the same order whatever else is in
 * the call: its output does not depend on the batch, the padding, the thread count or
 * how a caller splits the rows (the decode of common/model/cpu_attention.py is batch
 * invariant).
 *
 * Heads 64 or 128 wide (any multiple of 16 up to 16 x MAX_V: latent attention's 576) go
 * in vectors, block by block: a block's keys for every head, then every head's softmax,
 * then the blocks' values, with the next block's bytes prefetched meanwhile. Heads wider
 * than 256 (latent attention: many query heads to one KV head) go four query heads a
 * pass, each key's vectors loaded once for them (one a pass took 1.6x the time,
 * Moonlight's 16 heads at 1,024 keys). At a decode step's batch the reads of scattered
 * blocks bound it (B8 x 600 keys: 4-6 GB/s, 2.3x faster when the layer is in the cache;
 * huge pages help too). Other widths go head by head in scalar code.
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
    int64_t window;          /* keys a query sees, itself included (sliding); 0: all before */
} Layout;

/* The first key a query at ``pos`` sees. */
static inline int64_t first_key(const Layout *L, int64_t pos) {
    return L->window > 0 && pos >= L->window ? pos - L->window + 1 : 0;
}

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* exp(x) for x <= 0, 0 below -87 (and for -inf): range reduction by ln 2 and a degree-6
 * polynomial, within ~2 ulp of expf; no libm call, the same on every machine with IEEE
 * float32 arithmetic in this order. */
static inline v16 v16_exp(v16 x) {
    const vi16 live = x >= -87.0f;  /* all ones where exp(x) is a normal float */
    x = (v16)(((vi16)x & live) | ((vi16)((v16){0} - 87.0f) & ~live));
    const vi16 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi16);
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    v16 p = (v16){0} + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16 scale = (v16)((n + 127) << 23);
    return (v16)((vi16)(p * scale) & live);
}

/* Lanes folded in halves (a fixed tree: 4 steps, not a chain of 15). */
#define FOLD(x, OP, k) OP(x, __builtin_shufflevector(x, x, (0 + k) % 16, (1 + k) % 16,      \
    (2 + k) % 16, (3 + k) % 16, (4 + k) % 16, (5 + k) % 16, (6 + k) % 16, (7 + k) % 16,     \
    (8 + k) % 16, (9 + k) % 16, (10 + k) % 16, (11 + k) % 16, (12 + k) % 16, (13 + k) % 16, \
    (14 + k) % 16, (15 + k) % 16))
#define ADD(a, b) ((a) + (b))
#define MAX(a, b) ((v16)(((vi16)(a) & ((a) >= (b))) | ((vi16)(b) & ~((a) >= (b)))))

static inline float v16_max(v16 x) {
    x = FOLD(x, MAX, 8); x = FOLD(x, MAX, 4); x = FOLD(x, MAX, 2); x = FOLD(x, MAX, 1);
    return x[0];
}

static inline float v16_sum(v16 x) {
    x = FOLD(x, ADD, 8); x = FOLD(x, ADD, 4); x = FOLD(x, ADD, 2); x = FOLD(x, ADD, 1);
    return x[0];
}

/* One query row, any head width (the self-check's small case, widths not a multiple of
 * 16): head by head, the scores of every key, their softmax, then the V rows weighted in
 * key order. scratch: lens[t] floats. */
#define ITEM(NAME, T, VALUE)                                                                \
    static inline void NAME(const Layout *L, const float *q, const T *kv, int64_t t,        \
                            int D, float *out, float *scores) {                             \
        const int group = L->hq / L->hkv;                                                   \
        const int64_t n = L->lens[t], start = first_key(L, n - 1);                          \
        const int64_t *table = L->tables + (L->rows ? L->rows[t] : t) * L->table_width;     \
        const T *base = kv + L->layer_off;                                                  \
        for (int h = 0; h < L->hq; h++) {                                                   \
            const float *qh = q + (t * L->hq + h) * D;                                      \
            const int64_t col = (h / group) * D;                                            \
            float m = -INFINITY, total = 0.0f;                                              \
            for (int64_t j = start; j < n; j++) {                                           \
                const T *k = base + table[j / L->bs] * L->block_stride + col                \
                             + (j % L->bs) * L->token_stride;                               \
                float dot = 0.0f;                                                           \
                for (int i = 0; i < D; i++) dot += qh[i] * VALUE(k[i]);                     \
                dot *= L->scale;                                                            \
                scores[j - start] = dot;                                                    \
                m = dot > m ? dot : m;                                                      \
            }                                                                               \
            for (int64_t j = 0; j < n - start; j++) scores[j] = expf(scores[j] - m);        \
            for (int64_t j = 0; j < n - start; j++) total += scores[j];                     \
            float acc[D];                                                                   \
            for (int i = 0; i < D; i++) acc[i] = 0.0f;                                      \
            for (int64_t j = start; j < n; j++) {                                           \
                const T *v = base + table[j / L->bs] * L->block_stride + L->v_off + col     \
                             + (j % L->bs) * L->token_stride;                               \
                const float p = scores[j - start];                                          \
                for (int i = 0; i < D; i++) acc[i] += p * VALUE(v[i]);                      \
            }                                                                               \
            float *oh = out + (t * L->hq + h) * D;                                          \
            for (int i = 0; i < D; i++) oh[i] = acc[i] / total;                             \
        }                                                                                   \
    }

/* 16 keys' or values' elements as float32 lanes. */
static inline v16 load16_f32(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline v16 load16_bf16(const uint16_t *p) {
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, vi16) << 16);
}

/* One query row for heads D wide, D a multiple of 16 up to 16 x MAX_V (64 and 128 as
 * constants: the loops unroll), in vectors of 16 lanes, reading each KV block once: per
 * block, per kv head, the query heads it serves in passes of up to MAX_GH (a constant
 * count, so that a pass's registers hold its queries' products or its accumulators).
 * A head's dot product with a key is a fixed tree (lane-wise products summed in element
 * order, then the lanes folded), its softmax goes 16 scores at a time (v16_exp, the sum
 * folded the same way), and its output adds the V rows in key order: a row's result is
 * the same whatever else is in the call, and whichever order the passes run in.
 * scratch: hq x (lens[t] rounded up to 16, then D) floats: the scores, then the sums
 * (from the block of the row's first key, the keys before it masked). */
#define MAX_GH 4
#define MAX_V 36 /* vectors of a head: 576 floats (DeepSeek's latent and rotated key) */

/* The next block's keys or values on their way into the cache while this one's compute. */
static inline void prefetch_block(const void *start, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)start + i);
}

/* Scores of ``GH`` query heads ``qh`` against ``slots`` keys from ``k`` on. */
#define KPASS(NAME, T, LOAD)                                                                \
    static inline __attribute__((always_inline)) void NAME(                                 \
            const T *k, int64_t stride, int64_t slots, const float *qh, int D, int GH,      \
            float scale, float *scores, int64_t width) {                                    \
        const int V = D / 16;                                                               \
        for (int64_t s = 0; s < slots; s++, k += stride) {                                  \
            v16 kx[MAX_V];                                                                  \
            for (int i = 0; i < V; i++) kx[i] = LOAD(k + i * 16);                           \
            for (int h = 0; h < GH; h++) {                                                  \
                v16 acc = load16_f32(qh + h * D) * kx[0];                                   \
                for (int i = 1; i < V; i++) acc += load16_f32(qh + h * D + i * 16) * kx[i]; \
                scores[h * width + s] = v16_sum(acc) * scale;                               \
            }                                                                               \
        }                                                                                   \
    }

/* ``GH`` heads' sums ``sums`` (GH x D) plus their probabilities ``p`` times ``slots``
 * values from ``v`` on. */
#define VPASS(NAME, T, LOAD)                                                                \
    static inline __attribute__((always_inline)) void NAME(                                 \
            const T *v, int64_t stride, int64_t slots, const float *p, int64_t width, int D,\
            int GH, float *sums) {                                                          \
        const int V = D / 16;                                                               \
        v16 acc[MAX_GH * MAX_V]; /* GH x V: 4 x 4, 2 x 8, 1 x 16, or 4 x up to MAX_V */  \
        for (int i = 0; i < GH * V; i++) acc[i] = load16_f32(sums + i * 16);                \
        for (int64_t s = 0; s < slots; s++, v += stride) {                                  \
            v16 vx[MAX_V];                                                                  \
            for (int i = 0; i < V; i++) vx[i] = LOAD(v + i * 16);                           \
            for (int h = 0; h < GH; h++) {                                                  \
                const float ph = p[h * width + s];                                          \
                for (int i = 0; i < V; i++) acc[h * V + i] += ph * vx[i];                   \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < GH * V; i++) memcpy(sums + i * 16, &acc[i], sizeof acc[i]);     \
    }

/* PASS(FN, h0, gh) over the query heads of kv head g, gh of them a pass (a constant). */
#define EACH_PASS(g, PASS, FN)                                                              \
    for (int h0 = (g) * group; h0 < ((g) + 1) * group;) {                                   \
        const int left = ((g) + 1) * group - h0, gh = left < most ? left : most;            \
        switch (gh) {                                                                       \
            case 4: PASS(FN, h0, 4); break;                                                 \
            case 3: PASS(FN, h0, 3); break;                                                 \
            case 2: PASS(FN, h0, 2); break;                                                 \
            default: PASS(FN, h0, 1); break;                                                \
        }                                                                                   \
        h0 += gh;                                                                           \
    }

#define VITEM(NAME, T, K_PASS, V_PASS)                                                      \
    static inline __attribute__((always_inline)) void NAME(                                 \
            const Layout *L, const float *q, const T *kv, int64_t t, int D, float *out,     \
            float *scratch) {                                                               \
        const int group = L->hq / L->hkv, V = D / 16;                                       \
        const int most = D <= 64 ? 4 : D <= 128 ? 2 : D <= 256 ? 1 : 4; /* wide: GQA */    \
        /* keys from the block of the row's first: scores[j] is key origin + j */           \
        const int64_t n = L->lens[t], start = first_key(L, n - 1);                          \
        const int64_t b0 = start / L->bs, origin = b0 * L->bs;                              \
        const int64_t width = (n - origin + 15) / 16 * 16;                                  \
        const int64_t *table = L->tables + (L->rows ? L->rows[t] : t) * L->table_width;     \
        const T *base = kv + L->layer_off;                                                  \
        const float *qt = q + t * L->hq * D;                                                \
        float *scores = scratch, *sums = scratch + L->hq * width;                           \
        for (int64_t first = origin, b = b0; first < n; first += L->bs, b++) {              \
            const T *page = base + table[b] * L->block_stride;                              \
            const int64_t slots = n - first < L->bs ? n - first : L->bs;                    \
            if (first + L->bs < n) prefetch_block(base + table[b + 1] * L->block_stride,     \
                                                  L->bs * L->token_stride * sizeof(T));     \
            for (int g = 0; g < L->hkv; g++) EACH_PASS(g, SCORE, K_PASS)                    \
        }                                                                                   \
        float total[L->hq];                                                                 \
        for (int h = 0; h < L->hq; h++) {                                                   \
            float *sh = scores + h * width;                                                 \
            for (int64_t j = 0; j < start - origin; j++) sh[j] = -INFINITY;                 \
            for (int64_t j = n - origin; j < width; j++) sh[j] = -INFINITY;                 \
            v16 top = load16_f32(sh);                                                       \
            for (int64_t j = 16; j < width; j += 16) top = MAX(top, load16_f32(sh + j));    \
            const float m = v16_max(top);                                                   \
            v16 sum = {0};                                                                  \
            for (int64_t j = 0; j < width; j += 16) {                                       \
                const v16 p = v16_exp(load16_f32(sh + j) - m);                              \
                memcpy(sh + j, &p, sizeof p);                                               \
                sum += p;                                                                   \
            }                                                                               \
            total[h] = v16_sum(sum);                                                        \
        }                                                                                   \
        memset(sums, 0, sizeof(float) * L->hq * D);                                         \
        for (int64_t first = origin, b = b0; first < n; first += L->bs, b++) {              \
            const T *page = base + table[b] * L->block_stride + L->v_off;                   \
            const int64_t slots = n - first < L->bs ? n - first : L->bs;                    \
            if (first + L->bs < n)                                                          \
                prefetch_block(base + table[b + 1] * L->block_stride + L->v_off,            \
                               L->bs * L->token_stride * sizeof(T));                        \
            for (int g = 0; g < L->hkv; g++) EACH_PASS(g, WEIGH, V_PASS)                    \
        }                                                                                   \
        for (int h = 0; h < L->hq; h++) {                                                   \
            const v16 sum = (v16){0} + total[h];                                            \
            for (int i = 0; i < V; i++) {                                                   \
                const v16 o = load16_f32(sums + h * D + i * 16) / sum;                      \
                memcpy(out + (t * L->hq + h) * D + i * 16, &o, sizeof o);                   \
            }                                                                               \
        }                                                                                   \
    }
#define SCORE(FN, h0, GH) FN(page + g * D, L->token_stride, slots, qt + (h0) * D, D, GH,   \
                               L->scale, scores + (h0) * width + first - origin, width)
#define WEIGH(FN, h0, GH) FN(page + g * D, L->token_stride, slots,                           \
                               scores + (h0) * width + first - origin, width, D, GH,        \
                               sums + (h0) * D)

ITEM(item_f32, float, f32_value)
ITEM(item_bf16, uint16_t, bf16_value)
KPASS(kpass_f32, float, load16_f32)
KPASS(kpass_bf16, uint16_t, load16_bf16)
VPASS(vpass_f32, float, load16_f32)
VPASS(vpass_bf16, uint16_t, load16_bf16)
VITEM(vitem_f32, float, kpass_f32, vpass_f32)
VITEM(vitem_bf16, uint16_t, kpass_bf16, vpass_bf16)

/* Items [first, last) of a call; the head width dispatches to an unrolled copy. */
#define ENTRY(NAME, T, ITEM_FN, VITEM_FN)                                                   \
    void NAME(const Layout *L, const float *q, const T *kv, int64_t first, int64_t last,    \
              float *out, float *scratch) {                                                 \
        for (int64_t item = first; item < last; item++) {  /* a query row */                \
            if (L->d == 64) VITEM_FN(L, q, kv, item, 64, out, scratch);                     \
            else if (L->d == 128) VITEM_FN(L, q, kv, item, 128, out, scratch);              \
            else if (L->d % 16 == 0 && L->d <= 16 * MAX_V)                                  \
                VITEM_FN(L, q, kv, item, L->d, out, scratch);                               \
            else ITEM_FN(L, q, kv, item, L->d, out, scratch);                               \
        }                                                                                   \
    }

ENTRY(paged_attention_f32, float, item_f32, vitem_f32)
ENTRY(paged_attention_bf16, uint16_t, item_bf16, vitem_bf16)

/* ------------------------------------------------------------------------------------
 * A prompt chunk's attention over its sequence's blocks: query rows at positions
 * [start, end) of one sequence, row t (position start + t) attending keys [0, start + t]
 * (of them the last ``window``: a block wholly before a row's window is skipped as one
 * after it is, and the chunk's copy starts at its first row's window).
 *
 * Row invariant like the decode rows above: a row's output is computed by the same
 * operations in the same order whatever the chunk it is in (where it starts and ends),
 * the other rows of its tile, or the thread count, so a prompt's KV and first token do
 * not depend on how the load cut it into chunks. Keys go 16 at a time (one KV block:
 * the block size must be 16), in the lanes of a vector; a block's scores, then an online
 * softmax step (the running max, the rescaled sum and output). A block past a row's
 * position is skipped: processing it would change nothing (its probabilities are 0, its
 * rescale factor exactly 1), so where the tile's other rows stop does not matter.
 *
 * ``chunk_gather`` first copies the blocks [first, ceil(end / 16)) of the layer
 * (``chunk_first_block``), as float32,
 * keys transposed ([block, kv head, d, 16]) and values as they are ([block, kv head, 16,
 * d]); ``chunk_rows`` then computes the query rows from that copy (threads take
 * interleaved tiles of them). Query rows hold every head ([T, hq, d] float32), as does the output.
 */
#if defined(__AVX512F__)
#define ROWS 16  /* query rows a tile: their scores stay in registers */
#else
#define ROWS 8
#endif

/* The first block a chunk starting at ``start`` reads: its first row's window's. */
int64_t chunk_first_block(const Layout *L, int64_t start) {
    return first_key(L, start) / 16;
}

#define GATHER(NAME, T, VALUE)                                                              \
    void NAME(const Layout *L, const T *kv, int64_t start, int64_t end, float *kt,          \
              float *vv) {                                                                  \
        const int64_t b0 = chunk_first_block(L, start), nb = (end + 15) / 16 - b0;          \
        const int64_t D = L->d, H = L->hkv;                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                  \
            const T *page = kv + L->layer_off + L->tables[b0 + b] * L->block_stride;        \
            for (int64_t g = 0; g < H; g++) {                                               \
                float *kb = kt + (b * H + g) * D * 16, *vb = vv + (b * H + g) * 16 * D;     \
                for (int64_t j = 0; j < 16; j++) {                                          \
                    const T *k = page + j * L->token_stride + g * D;                        \
                    const T *v = k + L->v_off;                                              \
                    for (int64_t i = 0; i < D; i++) {                                       \
                        kb[i * 16 + j] = VALUE(k[i]);                                       \
                        vb[j * D + i] = VALUE(v[i]);                                        \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

GATHER(chunk_gather_f32, float, f32_value)
GATHER(chunk_gather_bf16, uint16_t, bf16_value)

/* Rows [t0, t0 + rn) of head h (positions start + t), D-wide heads. */
static inline void chunk_tile(const Layout *L, const float *q, const float *kt,
                              const float *vv, int64_t start, int64_t t0, int rn, int h,
                              int D, float *out) {
    const int group = L->hq / L->hkv, H = L->hkv, g = h / group, V = D / 16;
    float m[ROWS], l[ROWS];
    v16 acc[ROWS][MAX_V];  /* D <= 16 x MAX_V */
    for (int r = 0; r < rn; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int k = 0; k < V; k++) acc[r][k] = (v16){0};
    }
    float qt[D * ROWS];  /* the tile's queries of head h, [d][row], rows past rn zero */
    for (int i = 0; i < D; i++) {
        for (int r = 0; r < ROWS; r++) qt[i * ROWS + r] = r < rn ? q[((t0 + r) * L->hq + h) * D + i] : 0.0f;
    }
    const int64_t blocks = (start + t0 + rn - 1) / 16 + 1, b0 = chunk_first_block(L, start);
    for (int64_t b = first_key(L, start + t0) / 16; b < blocks; b++) {
        const float *kb = kt + ((b - b0) * H + g) * D * 16;
        const float *vb = vv + ((b - b0) * H + g) * 16 * D;
        v16 s[ROWS];  /* every row of the tile: a fixed count keeps them in registers */
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) s[r] = (v16){0};
        for (int i = 0; i < D; i++) {
            const v16 kd = *(const v16 *)(kb + i * 16);
#pragma GCC unroll 16
            for (int r = 0; r < ROWS; r++) s[r] += qt[i * ROWS + r] * kd;
        }
        for (int r = 0; r < rn; r++) {
            const int64_t seen = start + t0 + r - b * 16;  /* last key of the block it sees */
            const int64_t before = first_key(L, start + t0 + r) - b * 16;  /* keys unseen */
            if (seen < 0 || before > 15) continue;  /* the whole block after or before it */
            v16 x = s[r] * L->scale;
            if (seen < 15) {
                for (int j = (int)seen + 1; j < 16; j++) x[j] = -INFINITY;
            }
            for (int j = 0; j < before; j++) x[j] = -INFINITY;
            const float mn = fmaxf(m[r], v16_max(x));
            float p[16];
            *(v16 *)p = v16_exp(x - mn);
            if (mn != m[r]) {  /* else the factor is exactly 1 */
                const float c = expf(m[r] - mn);
                l[r] *= c;
                for (int k = 0; k < V; k++) acc[r][k] *= c;
            }
            l[r] += v16_sum(*(v16 *)p);
            for (int j = 0; j < 16; j++) {
                const v16 *vj = (const v16 *)(vb + j * D);
                for (int k = 0; k < V; k++) acc[r][k] += p[j] * vj[k];
            }
            m[r] = mn;
        }
    }
    for (int r = 0; r < rn; r++) {
        v16 *o = (v16 *)(out + ((t0 + r) * L->hq + h) * D);
        for (int k = 0; k < V; k++) o[k] = acc[r][k] / l[r];
    }
}

/* Part ``part`` of ``parts`` of the chunk's T query rows at ``start``, every head: tiles
 * of ROWS rows, tile i in part i % parts (a thread each: rows late in the chunk see more
 * keys, so interleaved tiles share the work evenly). */
void chunk_rows(const Layout *L, const float *q, const float *kt, const float *vv,
                int64_t start, int64_t T, int64_t part, int64_t parts, float *out) {
    for (int h = 0; h < L->hq; h++) {
        for (int64_t t0 = part * ROWS; t0 < T; t0 += parts * ROWS) {
            const int rn = T - t0 < ROWS ? (int)(T - t0) : ROWS;
            if (L->d == 64) chunk_tile(L, q, kt, vv, start, t0, rn, h, 64, out);
            else if (L->d == 128) chunk_tile(L, q, kt, vv, start, t0, rn, h, 128, out);
            else if (L->d == 256) chunk_tile(L, q, kt, vv, start, t0, rn, h, 256, out);
            else chunk_tile(L, q, kt, vv, start, t0, rn, h, (int)L->d, out);  /* latent's */
        }
    }
}
