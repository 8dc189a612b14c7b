/* Attention over the paged KV pool, read in place (no gather copy), fp32, AVX2 + FMA or AVX-512.
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
 * One source, two builds: with -mavx512f the vectors are 16 floats wide (LANES), otherwise 8
 * (AVX2 + FMA); D must be a multiple of LANES (pdd_paged_attention_lanes() says which build
 * was loaded). Each build sums in its own fixed order, so a row's result does not depend on
 * the rest of the batch, but the two builds differ from each other in the last bits.
 *
 * Work units are (sequence, kv head, chunk of chunk_tokens new tokens), spread over
 * num_threads OpenMP threads (the runtime torch itself uses). Within a unit, rows (token,
 * query head of that kv head) go TILE_ROWS at a time (8 with AVX-512, 4 with AVX2), so each K and
 * V vector read serves that many rows.
 * A decode reads K rows in place (dot products summed across lanes); a sequence with several
 * new tokens first copies its unit's keys transposed, LANES keys by D, so each score is one
 * FMA chain over the dimensions with no cross-lane sum.
 *
 * Returns 0, or -1 if D is not a multiple of LANES or above 256, -2 if memory ran out.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
/* Rows the in-place dot products of qk_block take at once (its eight sums fill one vector). */
#define BLOCK_ROWS 4

#if defined(__AVX512F__)
#define LANES 16
/* Rows one tile computes: each K and V vector read serves this many rows. Eight fit AVX-512's
 * 32 registers; AVX2's 16 hold four. */
#define TILE_ROWS 8
typedef __m512 vec;
static inline vec v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vec x) { _mm512_storeu_ps(p, x); }
static inline vec v_set1(float x) { return _mm512_set1_ps(x); }
static inline vec v_zero(void) { return _mm512_setzero_ps(); }
static inline vec v_fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vec v_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec v_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec v_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec v_max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec v_floor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* 2^n for the integral floats n of fx (exponent bits built directly). */
static inline vec v_pow2(vec fx) {
    __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
    return _mm512_castsi512_ps(n);
}
/* x with lanes n .. LANES-1 zeroed (0 <= n < LANES). */
static inline vec v_first(vec x, int64_t n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u), x); }
static inline float v_hmax(vec x) { return _mm512_reduce_max_ps(x); }
static inline float v_hsum(vec x) { return _mm512_reduce_add_ps(x); }
/* The low and high eight lanes added: eight partial sums for sums8. */
static inline __m256 v_fold8(vec x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
#else
#define LANES 8
#define TILE_ROWS 4
typedef __m256 vec;
static inline vec v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vec x) { _mm256_storeu_ps(p, x); }
static inline vec v_set1(float x) { return _mm256_set1_ps(x); }
static inline vec v_zero(void) { return _mm256_setzero_ps(); }
static inline vec v_fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec v_fnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vec v_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec v_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec v_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec v_max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec v_floor(vec x) { return _mm256_floor_ps(x); }
static inline vec v_pow2(vec fx) {
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_castsi256_ps(n);
}
static inline vec v_first(vec x, int64_t n) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane)), x);
}
static inline float v_hmax(vec x) {
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, x);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}
static inline float v_hsum(vec v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 shuf = _mm_movehdup_ps(lo);
    __m128 sums = _mm_add_ps(lo, shuf);
    shuf = _mm_movehl_ps(shuf, sums);
    return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}
static inline __m256 v_fold8(vec x) { return x; }
#endif

/* The number of floats in this build's vectors: 16 (AVX-512) or 8 (AVX2). */
int pdd_paged_attention_lanes(void) { return LANES; }

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

/* exp for x <= 0 (Cephes' polynomial, as in avx_mathfun): relative error ~1e-7. */
static inline vec exp_nonpositive(vec x) {
    x = v_max(v_set1(-87.0f), x); /* a NaN x stays NaN (max returns its second operand on NaN) */
    vec fx = v_floor(v_fmadd(x, v_set1(1.44269504088896341f), v_set1(0.5f)));
    x = v_fnmadd(fx, v_set1(0.693359375f), x);
    x = v_fnmadd(fx, v_set1(-2.12194440e-4f), x);
    vec z = v_mul(x, x);
    vec y = v_set1(1.9875691500e-4f);
    y = v_fmadd(y, x, v_set1(1.3981999507e-3f));
    y = v_fmadd(y, x, v_set1(8.3334519073e-3f));
    y = v_fmadd(y, x, v_set1(4.1665795894e-2f));
    y = v_fmadd(y, x, v_set1(1.6666665459e-1f));
    y = v_fmadd(y, x, v_set1(5.0000001201e-1f));
    y = v_add(v_fmadd(y, z, x), v_set1(1.0f));
    return v_mul(y, v_pow2(fx));
}

/* The eight sums of a[0..7] in one vector, lane i = sum of a[i]'s lanes (a fixed order:
 * every row's score is summed the same way whatever the tile's size). */
static inline __m256 sums8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* srow[r][j0 + j] = (q_r . k_j) * scale for rows r < R <= BLOCK_ROWS and one block's keys j <
 * nkeys, two keys at a time: accumulator 2r + i holds row r, key j + i. */
static inline __attribute__((always_inline)) void qk_block(
    const int R, const float *const *qrows, const float *kb, int64_t nkeys, int64_t d, float *const *srow,
    int64_t j0, float scale) {
    const __m256 scale_v = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < nkeys; j += 2) {
        const int both = j + 1 < nkeys;
        const float *k0 = kb + j * d, *k1 = k0 + d;
        vec a[2 * BLOCK_ROWS];
        for (int i = 0; i < 2 * BLOCK_ROWS; i++) a[i] = v_zero();
        for (int64_t c = 0; c < d; c += LANES) {
            vec x0 = v_load(k0 + c);
            vec x1 = both ? v_load(k1 + c) : v_zero();
            for (int r = 0; r < R; r++) {
                vec qv = v_load(qrows[r] + c);
                a[2 * r] = v_fmadd(qv, x0, a[2 * r]);
                a[2 * r + 1] = v_fmadd(qv, x1, a[2 * r + 1]);
            }
        }
        __m256 folded[2 * BLOCK_ROWS];
        for (int i = 0; i < 2 * BLOCK_ROWS; i++) folded[i] = v_fold8(a[i]);
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_mul_ps(sums8(folded), scale_v));
        for (int r = 0; r < R; r++) {
            srow[r][j0 + j] = lanes[2 * r];
            if (both) srow[r][j0 + j + 1] = lanes[2 * r + 1];
        }
    }
}

/* acc[r] += p[r][j] * v_j over one block's keys, for 2 * LANES columns starting at col
 * (LANES if half). */
static inline __attribute__((always_inline)) void pv_block(
    const int R, const float *vb, int64_t nkeys, int64_t d, int64_t col, int half, float *const *prow, int64_t j0,
    vec *acc0, vec *acc1) {
    for (int64_t j = 0; j < nkeys; j++) {
        const float *vr = vb + j * d + col;
        vec x0 = v_load(vr);
        vec x1 = half ? v_zero() : v_load(vr + LANES);
        for (int r = 0; r < R; r++) {
            vec p = v_set1(prow[r][j0 + j]);
            acc0[r] = v_fmadd(p, x0, acc0[r]);
            if (!half) acc1[r] = v_fmadd(p, x1, acc1[r]);
        }
    }
}

/* Softmax of srow[0 .. visible) in place, zeros up to padded_end; returns 1 / sum. The
 * buffer is padded to a multiple of LANES. */
static float softmax_row(float *s, int64_t visible, int64_t padded_end) {
    vec mv = v_set1(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= visible; j += LANES) mv = v_max(mv, v_load(s + j));
    float m = v_hmax(mv);
    for (; j < visible; j++) m = s[j] > m ? s[j] : m;
    vec mb = v_set1(m), sumv = v_zero();
    for (j = 0; j + LANES <= visible; j += LANES) {
        vec p = exp_nonpositive(v_sub(v_load(s + j), mb));
        v_store(s + j, p);
        sumv = v_add(sumv, p);
    }
    float sum = v_hsum(sumv);
    if (j < visible) { /* the tail through a full vector */
        vec p = v_first(exp_nonpositive(v_sub(v_load(s + j), mb)), visible - j);
        v_store(s + j, p);
        sum += v_hsum(p);
        j += LANES;
    }
    for (; j < padded_end; j++) s[j] = 0.0f;
    return 1.0f / sum;
}

/* dst[d * dst_stride + i] = src[i][d] for an 8 x 8 tile (rows src_stride floats apart). */
static inline void transpose8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
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
    _mm256_storeu_ps(dst + 0 * dst_stride, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 1 * dst_stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * dst_stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * dst_stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* The unit's keys 0 .. keys (rounded up to LANES) as groups of LANES, each [d][LANES]:
 * kt[(g * d + i) * LANES + k] is dimension i of key LANES * g + k. They are copied eight keys
 * at a time (block_size is a multiple of 8); keys past the context in the last eight come
 * from the same block (allocated, finite) and lanes past the last eight are zeroed: neither
 * is ever used. */
static void transpose_keys(const float *kh, const int64_t *table, int64_t bs, int64_t d, int64_t keys, float *kt) {
    int64_t e = 0;
    for (; 8 * e < keys; e++) {
        const float *src = kh + (table[8 * e / bs] * bs + 8 * e % bs) * d;
        float *dst = kt + (e / (LANES / 8)) * d * LANES + (e % (LANES / 8)) * 8;
        for (int64_t c = 0; c < d; c += 8) transpose8(src + c, d, dst + c * LANES, LANES);
    }
    for (; e % (LANES / 8); e++) {
        float *dst = kt + (e / (LANES / 8)) * d * LANES + (e % (LANES / 8)) * 8;
        for (int64_t i = 0; i < d; i++) _mm256_storeu_ps(dst + i * LANES, _mm256_setzero_ps());
    }
}

/* srow[r][LANES * g ..] = (q_r . k) * scale over the transposed keys, 2 * LANES keys at a
 * time: each score is one FMA chain over the dimensions in order. */
static inline __attribute__((always_inline)) void qk_transposed(
    const int R, const float *const *qrows, const float *kt, int64_t keys, int64_t d, float *const *srow,
    float scale) {
    const vec scale_v = v_set1(scale);
    const int64_t groups = (keys + LANES - 1) / LANES;
    for (int64_t g = 0; g < groups; g += 2) {
        const int two = g + 1 < groups;
        const float *k0 = kt + g * d * LANES, *k1 = k0 + d * LANES;
        vec a0[TILE_ROWS], a1[TILE_ROWS];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = v_zero();
        for (int64_t i = 0; i < d; i++) {
            vec x0 = v_load(k0 + LANES * i), x1 = two ? v_load(k1 + LANES * i) : v_zero();
            for (int r = 0; r < R; r++) {
                vec qb = v_set1(qrows[r][i]);
                a0[r] = v_fmadd(qb, x0, a0[r]);
                a1[r] = v_fmadd(qb, x1, a1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            v_store(srow[r] + LANES * g, v_mul(a0[r], scale_v));
            if (two) v_store(srow[r] + LANES * g + LANES, v_mul(a1[r], scale_v));
        }
    }
}

static inline __attribute__((always_inline)) void tile(
    const int R, const call_t *c, const unit_t *u, int64_t first_row, float *scores, int64_t stride, const float *kt) {
    const int64_t d = c->d, group = c->heads / c->kv_heads, bs = c->block_size;
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
        for (int r0 = 0; r0 < R; r0 += BLOCK_ROWS)
            for (int64_t b = 0, j0 = 0; j0 < most; b++, j0 += bs) {
                int64_t n = most - j0 < bs ? most - j0 : bs;
                int rows = R - r0 < BLOCK_ROWS ? R - r0 : BLOCK_ROWS;
                qk_block(rows, qrows + r0, kh + table[b] * bs * d, n, d, srow + r0, j0, c->scale);
            }
    float inv[TILE_ROWS];
    for (int r = 0; r < R; r++) inv[r] = softmax_row(srow[r], visible[r], most);
    for (int64_t col = 0; col < d; col += 2 * LANES) {
        int half = d - col < 2 * LANES;
        vec acc0[TILE_ROWS], acc1[TILE_ROWS];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = v_zero();
        for (int64_t b = 0, j0 = 0; j0 < most; b++, j0 += bs) {
            int64_t n = most - j0 < bs ? most - j0 : bs;
            pv_block(R, vh + table[b] * bs * d, n, d, col, half, srow, j0, acc0, acc1);
        }
        for (int r = 0; r < R; r++) {
            vec s = v_set1(inv[r]);
            v_store(orows[r] + col, v_mul(acc0[r], s));
            if (!half) v_store(orows[r] + col + LANES, v_mul(acc1[r], s));
        }
    }
}

static void run_unit(const call_t *c, const unit_t *u, float *scores, int64_t stride, float *kt) {
    const int64_t *meta = c->meta + 3 * u->seq;
    const int64_t rows = (u->end_token - u->first_token) * (c->heads / c->kv_heads);
    /* A sequence with several new tokens: its keys transposed once per unit, then every tile
     * reads them as [d][LANES]; a decode reads K rows in place. */
    const float *keys_t = NULL;
    if (meta[1] > 1 && c->block_size % 8 == 0) {
        const int64_t keys = meta[2] - meta[1] + u->end_token;
        transpose_keys(c->k + u->kv_head * c->head_stride, c->tables + c->table_width * u->seq, c->block_size, c->d,
                       keys, kt);
        keys_t = kt;
    }
    int64_t r = 0;
    for (; r + TILE_ROWS <= rows; r += TILE_ROWS) tile(TILE_ROWS, c, u, r, scores, stride, keys_t);
    switch (rows - r) { /* each remainder its own constant, so the tile's loops unroll */
#if TILE_ROWS > 4
        case 7: tile(7, c, u, r, scores, stride, keys_t); break;
        case 6: tile(6, c, u, r, scores, stride, keys_t); break;
        case 5: tile(5, c, u, r, scores, stride, keys_t); break;
        case 4: tile(4, c, u, r, scores, stride, keys_t); break;
#endif
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
    if (d % LANES != 0 || d > MAX_D || heads % kv_heads != 0 || chunk_tokens < 1) return -1;
    call_t c = {q, out, k, v, head_stride, block_size, table_width, heads, kv_heads, d, tables, meta, scale};
    int64_t num_units = 0, longest = LANES;
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
    const int64_t stride = (longest + LANES - 1) / LANES * LANES;
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
