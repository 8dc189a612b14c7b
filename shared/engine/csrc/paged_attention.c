/* Attention over the paged KV pool, read in place (no gather copy), fp32, AVX2 + FMA.
 *
 * Contract (shared/engine/paged_kernel.py builds this file and calls it through ctypes):
 *
 *   q    [tokens, heads, D] contiguous: the packed new tokens' queries, rotary applied.
 *   out  [tokens, heads, D] contiguous: written for every row of every sequence in meta.
 *   k, v one layer's K and V of the pool, [kv_heads, num_blocks, block_size, D] contiguous;
 *        head_stride = num_blocks * block_size * D.
 *   tables [num_seqs, table_width] block ids; meta [num_seqs, 3] = (query_start,
 *        num_queries, context_len): sequence s's new tokens are packed rows query_start ..
 *        query_start + num_queries - 1, the last num_queries of its context_len tokens, whose
 *        K/V are already in the pool. Query i sees keys 0 .. context_len - num_queries + i.
 *
 * Each query head h reads K/V head h / (heads / kv_heads) (GQA, never repeated). Per row:
 * s_j = (q . k_j) * scale, p_j = exp(s_j - max s), out = sum p_j v_j / sum p_j, all fp32.
 *
 * Work units are (sequence, kv head, chunk of chunk_tokens new tokens), spread over
 * num_threads OpenMP threads (the runtime torch itself uses). Within a unit, rows (token,
 * query head of that kv head) go four at a time, so each K and V row read serves four rows.
 * A decode reads K rows in place (dot products summed across lanes); a sequence with several
 * new tokens first copies its unit's keys transposed, eight keys by D, so each score is one
 * FMA chain over the dimensions with no cross-lane sum.
 *
 * Returns 0, or -1 if D is not a multiple of 8 or above 256, -2 if memory ran out.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 4
#define MAX_D 256

typedef struct {
    int64_t seq, kv_head, first_token, end_token;
} unit_t;

typedef struct {
    const float *q;
    float *out;
    const float *k, *v;
    int64_t head_stride, block_size, table_width, heads, kv_heads, d;
    const int64_t *tables, *meta;
    float scale;
} call_t;

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 shuf = _mm_movehdup_ps(lo);
    __m128 sums = _mm_add_ps(lo, shuf);
    shuf = _mm_movehl_ps(shuf, sums);
    return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

/* exp for x <= 0 (Cephes' polynomial, as in avx_mathfun): relative error ~1e-7. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* The eight sums of a[0..7] in one vector, lane i = sum of a[i]'s lanes (a fixed order:
 * every row's score is summed the same way whatever the tile's size). */
static inline __m256 sums8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* srow[r][j0 + j] = (q_r . k_j) * scale for rows r < R and one block's keys j < nkeys, two
 * keys at a time: accumulator 2r + i holds row r, key j + i. D = 8 * nd. */
static inline __attribute__((always_inline)) void qk_block(
    const int R, const float *const *qrows, const float *kb, int64_t nkeys, int64_t nd, float *const *srow,
    int64_t j0, float scale) {
    const __m256 scale_v = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < nkeys; j += 2) {
        const int both = j + 1 < nkeys;
        const float *k0 = kb + j * nd * 8, *k1 = k0 + nd * 8;
        __m256 a[2 * TILE_ROWS];
        for (int i = 0; i < 2 * TILE_ROWS; i++) a[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nd; c++) {
            __m256 x0 = _mm256_loadu_ps(k0 + 8 * c);
            __m256 x1 = both ? _mm256_loadu_ps(k1 + 8 * c) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                __m256 qv = _mm256_loadu_ps(qrows[r] + 8 * c);
                a[2 * r] = _mm256_fmadd_ps(qv, x0, a[2 * r]);
                a[2 * r + 1] = _mm256_fmadd_ps(qv, x1, a[2 * r + 1]);
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_mul_ps(sums8(a), scale_v));
        for (int r = 0; r < R; r++) {
            srow[r][j0 + j] = lanes[2 * r];
            if (both) srow[r][j0 + j + 1] = lanes[2 * r + 1];
        }
    }
}

/* acc[r] += p[r][j] * v_j over one block's keys, for 16 columns starting at col (8 if half). */
static inline __attribute__((always_inline)) void pv_block(
    const int R, const float *vb, int64_t nkeys, int64_t d, int64_t col, int half, float *const *prow, int64_t j0,
    __m256 *acc0, __m256 *acc1) {
    for (int64_t j = 0; j < nkeys; j++) {
        const float *vr = vb + j * d + col;
        __m256 x0 = _mm256_loadu_ps(vr);
        __m256 x1 = half ? _mm256_setzero_ps() : _mm256_loadu_ps(vr + 8);
        for (int r = 0; r < R; r++) {
            __m256 p = _mm256_broadcast_ss(prow[r] + j0 + j);
            acc0[r] = _mm256_fmadd_ps(p, x0, acc0[r]);
            if (!half) acc1[r] = _mm256_fmadd_ps(p, x1, acc1[r]);
        }
    }
}

/* Softmax of srow[0 .. visible) in place, zeros up to padded_end; returns 1 / sum. */
static float softmax_row(float *s, int64_t visible, int64_t padded_end) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= visible; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float m = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; j < visible; j++) m = s[j] > m ? s[j] : m;
    __m256 mb = _mm256_set1_ps(m), sumv = _mm256_setzero_ps();
    for (j = 0; j + 8 <= visible; j += 8) {
        __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
        _mm256_storeu_ps(s + j, p);
        sumv = _mm256_add_ps(sumv, p);
    }
    float sum = hsum(sumv);
    if (j < visible) { /* the tail through a full vector: the buffer is padded to 8 */
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(visible - j)), lane));
        __m256 p = _mm256_and_ps(keep, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb)));
        _mm256_storeu_ps(s + j, p);
        sum += hsum(p);
        j += 8;
    }
    for (; j < padded_end; j++) s[j] = 0.0f;
    return 1.0f / sum;
}

/* dst[d][i] = src[i][d] for an 8 x 8 tile (rows src_stride floats apart, dst rows 8 apart). */
static inline void transpose8(const float *src, int64_t src_stride, float *dst) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + src_stride);
    __m256 r2 = _mm256_loadu_ps(src + 2 * src_stride), r3 = _mm256_loadu_ps(src + 3 * src_stride);
    __m256 r4 = _mm256_loadu_ps(src + 4 * src_stride), r5 = _mm256_loadu_ps(src + 5 * src_stride);
    __m256 r6 = _mm256_loadu_ps(src + 6 * src_stride), r7 = _mm256_loadu_ps(src + 7 * src_stride);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 16, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 24, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 32, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 40, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 48, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 56, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* The unit's keys 0 .. keys (rounded up to 8) as groups of eight, each [d][8]: kt[(g * d + i) * 8 + k]
 * is dimension i of key 8g + k. Keys past the context in the last group come from the same
 * block (allocated, finite) and are never used. */
static void transpose_keys(const float *kh, const int64_t *table, int64_t bs, int64_t d, int64_t keys, float *kt) {
    for (int64_t g = 0; 8 * g < keys; g++) {
        const float *src = kh + (table[8 * g / bs] * bs + 8 * g % bs) * d;
        for (int64_t c = 0; c < d; c += 8) transpose8(src + c, d, kt + (g * d + c) * 8);
    }
}

/* srow[r][8g ..] = (q_r . k) * scale over the transposed keys, sixteen keys at a time:
 * each score is one FMA chain over the dimensions in order. */
static inline __attribute__((always_inline)) void qk_transposed(
    const int R, const float *const *qrows, const float *kt, int64_t keys, int64_t d, float *const *srow,
    float scale) {
    const __m256 scale_v = _mm256_set1_ps(scale);
    const int64_t groups = (keys + 7) / 8;
    for (int64_t g = 0; g < groups; g += 2) {
        const int two = g + 1 < groups;
        const float *k0 = kt + g * d * 8, *k1 = k0 + d * 8;
        __m256 a0[TILE_ROWS], a1[TILE_ROWS];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i++) {
            __m256 x0 = _mm256_loadu_ps(k0 + 8 * i), x1 = two ? _mm256_loadu_ps(k1 + 8 * i) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                __m256 qb = _mm256_broadcast_ss(qrows[r] + i);
                a0[r] = _mm256_fmadd_ps(qb, x0, a0[r]);
                a1[r] = _mm256_fmadd_ps(qb, x1, a1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(srow[r] + 8 * g, _mm256_mul_ps(a0[r], scale_v));
            if (two) _mm256_storeu_ps(srow[r] + 8 * g + 8, _mm256_mul_ps(a1[r], scale_v));
        }
    }
}

static inline __attribute__((always_inline)) void tile(
    const int R, const call_t *c, const unit_t *u, int64_t first_row, float *scores, int64_t stride, const float *kt) {
    const int64_t d = c->d, nd = d / 8, group = c->heads / c->kv_heads, bs = c->block_size;
    const int64_t *meta = c->meta + 3 * u->seq, *table = c->tables + c->table_width * u->seq;
    const int64_t query_start = meta[0], num_queries = meta[1], context_len = meta[2];
    const float *qrows[TILE_ROWS];
    float *orows[TILE_ROWS], *srow[TILE_ROWS];
    int64_t visible[TILE_ROWS], most = 0;
    for (int r = 0; r < R; r++) {
        int64_t row = first_row + r, token = u->first_token + row / group, head = u->kv_head * group + row % group;
        qrows[r] = c->q + ((query_start + token) * c->heads + head) * d;
        orows[r] = c->out + ((query_start + token) * c->heads + head) * d;
        srow[r] = scores + r * stride;
        visible[r] = context_len - num_queries + token + 1;
        most = visible[r] > most ? visible[r] : most;
    }
    const float *kh = c->k + u->kv_head * c->head_stride, *vh = c->v + u->kv_head * c->head_stride;
    if (kt)
        qk_transposed(R, qrows, kt, most, d, srow, c->scale);
    else
        for (int64_t b = 0, j0 = 0; j0 < most; b++, j0 += bs) {
            int64_t n = most - j0 < bs ? most - j0 : bs;
            qk_block(R, qrows, kh + table[b] * bs * d, n, nd, srow, j0, c->scale);
        }
    float inv[TILE_ROWS];
    for (int r = 0; r < R; r++) inv[r] = softmax_row(srow[r], visible[r], most);
    for (int64_t col = 0; col < d; col += 16) {
        int half = d - col < 16;
        __m256 acc0[TILE_ROWS], acc1[TILE_ROWS];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int64_t b = 0, j0 = 0; j0 < most; b++, j0 += bs) {
            int64_t n = most - j0 < bs ? most - j0 : bs;
            pv_block(R, vh + table[b] * bs * d, n, d, col, half, srow, j0, acc0, acc1);
        }
        for (int r = 0; r < R; r++) {
            __m256 s = _mm256_set1_ps(inv[r]);
            _mm256_storeu_ps(orows[r] + col, _mm256_mul_ps(acc0[r], s));
            if (!half) _mm256_storeu_ps(orows[r] + col + 8, _mm256_mul_ps(acc1[r], s));
        }
    }
}

static void run_unit(const call_t *c, const unit_t *u, float *scores, int64_t stride, float *kt) {
    const int64_t *meta = c->meta + 3 * u->seq;
    const int64_t rows = (u->end_token - u->first_token) * (c->heads / c->kv_heads);
    /* A sequence with several new tokens: its keys transposed once per unit, then every tile
     * reads them as [d][8]; a decode reads K rows in place. */
    const float *keys_t = NULL;
    if (meta[1] > 1 && c->block_size % 8 == 0) {
        const int64_t keys = meta[2] - meta[1] + u->end_token;
        transpose_keys(c->k + u->kv_head * c->head_stride, c->tables + c->table_width * u->seq, c->block_size, c->d,
                       keys, kt);
        keys_t = kt;
    }
    int64_t r = 0;
    for (; r + TILE_ROWS <= rows; r += TILE_ROWS) tile(TILE_ROWS, c, u, r, scores, stride, keys_t);
    switch (rows - r) {
        case 3: tile(3, c, u, r, scores, stride, keys_t); break;
        case 2: tile(2, c, u, r, scores, stride, keys_t); break;
        case 1: tile(1, c, u, r, scores, stride, keys_t); break;
        default: break;
    }
}

int pdd_paged_attention(const float *q, float *out, const float *k, const float *v, int64_t head_stride,
                        int64_t block_size, const int64_t *tables, int64_t table_width, const int64_t *meta,
                        int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                        int64_t chunk_tokens, int64_t num_threads) {
    if (d % 8 != 0 || d > MAX_D || heads % kv_heads != 0 || chunk_tokens < 1) return -1;
    call_t c = {q, out, k, v, head_stride, block_size, table_width, heads, kv_heads, d, tables, meta, scale};
    int64_t num_units = 0, longest = 8;
    for (int64_t s = 0; s < num_seqs; s++) {
        num_units += kv_heads * ((meta[3 * s + 1] + chunk_tokens - 1) / chunk_tokens);
        longest = meta[3 * s + 2] > longest ? meta[3 * s + 2] : longest;
    }
    unit_t *units = malloc(sizeof(unit_t) * (num_units > 0 ? num_units : 1));
    if (!units) return -2;
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = 0; t < meta[3 * s + 1]; t += chunk_tokens)
            for (int64_t h = 0; h < kv_heads; h++) {
                int64_t end = t + chunk_tokens < meta[3 * s + 1] ? t + chunk_tokens : meta[3 * s + 1];
                units[n++] = (unit_t){s, h, t, end};
            }
    const int64_t stride = (longest + 7) / 8 * 8;
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads)
    {
        float *scores = aligned_alloc(64, (size_t)(TILE_ROWS * stride * sizeof(float) + 63) / 64 * 64);
        float *kt = aligned_alloc(64, (size_t)(stride * d * sizeof(float) + 63) / 64 * 64);
        if (!scores || !kt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_units; i++)
            if (scores && kt) run_unit(&c, &units[i], scores, stride, kt);
        free(scores);
        free(kt);
    }
    free(units);
    return failed ? -2 : 0;
}
