/* Float32 prompt chunks of cpu_paged_attention.c as matrix products on BLAS sgemm (torch's MKL, handed over by
 * strata_set_blas). Included by that file after exp_nonpos, par_run, grown, scratch and window_start.
 *
 * Why: a query row alone reads each of its keys for one dot product per head, so a long prompt's attention ran at
 * ~15 GFLOP/s per core against ~150 for MKL's sgemm; at 2,048 tokens it was 60% of a Qwen3-0.6B-shaped prefill.
 * Here a tile of TILE_ROWS consecutive query rows of one sequence and the g query heads of one KV head share every
 * key read:
 *     S = Q K^T   (rows x heads of the tile by keys, one sgemm),
 *     P = exp(S - row max) with the causal / window mask, row sums l,
 *     O = P V / l (one sgemm),
 * the exact softmax over the tile's key range, not an online one. The keys a tile needs run from its first row's
 * window start to its last row's position; the tile's later rows see more of them, and the mask zeroes what a row
 * may not see (at most TILE_ROWS^2 / 2 entries per tile).
 * First each long sequence's K and V are copied out of the blocks, one KV head at a time, into contiguous
 * [keys, D] matrices (one pass, shared by all of that sequence's tiles).
 * Tiles of 64 rows timed best against 32 and 128. Against the rows, a fresh prompt's tiles took 0.75-0.86 of the
 * time at 128 rows and 0.32-0.55 at 512, but 1.02-1.16 at 64 (one and two threads, head dims 32-128): chunks
 * shorter than GEMM_MIN_ROWS stay on the rows. */
#define TILE_ROWS 64
#define GEMM_MIN_ROWS 128 /* a sequence with at least this many query rows in the step takes the tiles */

typedef void (*attn_sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                             const float *, const int *, const float *, const int *, const float *, float *,
                             const int *);
static attn_sgemm_t attn_sgemm = NULL;
static int (*attn_mkl_local)(const int *) = NULL; /* mkl_set_num_threads_local (Fortran interface) */

/* BLAS sgemm_ (Fortran interface) and MKL's mkl_set_num_threads_local, so that each tile's products run
 * single-threaded on the thread that took the tile. NULL sgemm: prompt rows take the row path. */
void strata_set_blas(void *sgemm, void *mkl_local) {
    *(void **)&attn_sgemm = sgemm;
    *(void **)&attn_mkl_local = mkl_local;
}

struct gemm_ctx {
    const struct attn_ctx *a;
    const int32_t *seqs;  /* the long sequences */
    const int64_t *kv_at; /* seqs[i]'s K/V copy starts at kv + kv_at[i] (floats) */
    const int32_t *tile;  /* per tile: (index into seqs, first row, KV head) */
    float *kv;            /* per sequence, per KV head: K [keys, D] then V [keys, D] */
};

/* Copy sequence seqs[c / hkv]'s keys of KV head c % hkv out of the blocks: those its first query row's window
 * reaches and after (all of them without a window), each at its own index. */
static void gather_chunk(void *p, int64_t c) {
    const struct gemm_ctx *G = p;
    const struct attn_ctx *a = G->a;
    const int i = (int)(c / a->hkv), kh = (int)(c % a->hkv), s = G->seqs[i], n = a->kv_lens[s], d = a->d;
    const int from = window_start(n - a->q_len[s], a->window);
    const int32_t *bt = a->block_tables + (size_t)s * a->bt_stride;
    const size_t tok = (size_t)a->hkv * d, block = (size_t)a->bs * tok;
    float *k = G->kv + G->kv_at[i] + (size_t)kh * 2 * n * d, *v = k + (size_t)n * d;
    for (int t = from; t < n; ++t) {
        const size_t at = (size_t)bt[t / a->bs] * block + (size_t)(t % a->bs) * tok + (size_t)kh * d;
        memcpy(k + (size_t)t * d, (const float *)a->k_cache + at, sizeof(float) * d);
        memcpy(v + (size_t)t * d, (const float *)a->v_cache + at, sizeof(float) * d);
    }
}

static void tile_chunk(void *p, int64_t c) {
    const struct gemm_ctx *G = p;
    struct attn_ctx *a = (struct attn_ctx *)G->a;
    const int i = G->tile[3 * c], j0 = G->tile[3 * c + 1], kh = G->tile[3 * c + 2], s = G->seqs[i];
    const int d = a->d, hq = a->hq, g = hq / a->hkv, n = a->kv_lens[s], ql = a->q_len[s];
    const int rows = ql - j0 < TILE_ROWS ? ql - j0 : TILE_ROWS, m = rows * g, window = a->window;
    const int first = n - ql + j0, last = first + rows - 1; /* positions of the tile's first and last rows */
    const int lo = window_start(first, window), keys = last + 1 - lo;
    float *buf = scratch((size_t)m * (2 * d + keys + 1));
    if (!buf) {
        a->failed = 1;
        return;
    }
    float *q = buf, *o = q + (size_t)m * d, *sc = o + (size_t)m * d, *sum = sc + (size_t)m * keys;
    for (int r = 0; r < rows; ++r) { /* tile row x = r * g + hh: query head kh * g + hh of row j0 + r */
        const float *src = (const float *)a->q + (size_t)(a->q_start[s] + j0 + r) * a->q_row_stride +
                           (size_t)kh * g * d;
        float *dst = q + (size_t)r * g * d;
        for (int e = 0; e < g * d; ++e) dst[e] = src[e] * a->scale;
    }
    const float *k = G->kv + G->kv_at[i] + (size_t)kh * 2 * n * d, *v = k + (size_t)n * d;
    const float one = 1.0f, zero = 0.0f;
    const int before = attn_mkl_local ? attn_mkl_local(&(const int){1}) : 0;
    /* row-major S[m, keys] = Q[m, d] K[lo:, d]^T, i.e. column-major S^T = K Q^T */
    attn_sgemm("T", "N", &keys, &m, &d, &one, k + (size_t)lo * d, &d, q, &d, &zero, sc, &keys);
    for (int x = 0; x < m; ++x) {
        const int pos = first + x / g;
        const int from = window_start(pos, window) - lo, to = pos + 1 - lo; /* pos >= first: from >= 0 */
        float *row = sc + (size_t)x * keys, mx = row[from], l = 0.0f;
#pragma omp simd reduction(max:mx)
        for (int t = from + 1; t < to; ++t) mx = row[t] > mx ? row[t] : mx;
        for (int t = 0; t < from; ++t) row[t] = 0.0f;
#pragma omp simd reduction(+:l)
        for (int t = from; t < to; ++t) {
            row[t] = exp_nonpos(row[t] - mx);
            l += row[t];
        }
        for (int t = to; t < keys; ++t) row[t] = 0.0f;
        sum[x] = l;
    }
    /* row-major O[m, d] = P[m, keys] V[lo:, d], i.e. column-major O^T = V^T P^T */
    attn_sgemm("N", "N", &d, &m, &keys, &one, v + (size_t)lo * d, &d, sc, &keys, &zero, o, &d);
    if (attn_mkl_local) attn_mkl_local(&before);
    for (int r = 0; r < rows; ++r) {
        float *dst = (float *)a->out + (size_t)(a->q_start[s] + j0 + r) * hq * d + (size_t)kh * g * d;
        for (int hh = 0; hh < g; ++hh) {
            const float inv = 1.0f / sum[r * g + hh], *src = o + (size_t)(r * g + hh) * d;
            for (int e = 0; e < d; ++e) dst[(size_t)hh * d + e] = src[e] * inv;
        }
    }
}

/* The caller's copy of the long sequences' K/V, kept between calls (each calling thread has its own). */
#define GATHERED_KEEP ((size_t)16 << 20) /* floats (64 MiB) of K/V copy kept between calls; more is freed */
static __thread float *gathered_buf = NULL;
static __thread size_t gathered_cap = 0;
static float *gathered(size_t floats) { return grown(&gathered_buf, &gathered_cap, floats); }

/* Attention of the sequences listed in seqs (n of them, float32, each with >= GEMM_MIN_ROWS query rows) by tiles.
 * Returns 0, or -3 when out of memory. */
static int gemm_attention(struct attn_ctx *a, const int32_t *seqs, int n) {
    int64_t *kv_at = malloc(sizeof(int64_t) * (size_t)n);
    int tiles = 0;
    int64_t floats = 0;
    for (int i = 0; kv_at && i < n; ++i) {
        kv_at[i] = floats;
        floats += (int64_t)2 * a->hkv * a->kv_lens[seqs[i]] * a->d;
        tiles += (a->q_len[seqs[i]] + TILE_ROWS - 1) / TILE_ROWS * a->hkv;
    }
    int32_t *tile = kv_at ? malloc(sizeof(int32_t) * 3 * (size_t)tiles) : NULL;
    float *kv = tile ? gathered((size_t)floats) : NULL;
    if (!kv) {
        free(kv_at);
        free(tile);
        return -3;
    }
    for (int i = 0, t = 0; i < n; ++i) /* longest-first within a sequence: the last rows see the most keys */
        for (int j0 = (a->q_len[seqs[i]] - 1) / TILE_ROWS * TILE_ROWS; j0 >= 0; j0 -= TILE_ROWS)
            for (int kh = 0; kh < a->hkv; ++kh, ++t) {
                tile[3 * t] = i;
                tile[3 * t + 1] = j0;
                tile[3 * t + 2] = kh;
            }
    struct gemm_ctx G = {a, seqs, kv_at, tile, kv};
    par_run(gather_chunk, &G, (int64_t)n * a->hkv);
    par_run(tile_chunk, &G, tiles);
    free(kv_at);
    free(tile);
    if (gathered_cap > GATHERED_KEEP) { /* a long context's copy is not held after its step */
        free(gathered_buf);
        gathered_buf = NULL;
        gathered_cap = 0;
    }
    return a->failed ? -3 : 0;
}
