/* The CPU engine's work-sharing threads: a caller that never waits for a thread that has not started.
 *
 * Why: an OpenMP region (and MKL's threaded GEMM) splits its work statically and ends at a barrier, so a step
 * advances only as fast as the slowest thread gets a core. Behind `strata serve` the API process and the clients
 * take a core in bursts of a few ms; whenever they displace one engine thread, the other waits for it at the next
 * barrier (measured: the served engine's main thread slept 13% of the time in libgomp's barrier futex).
 *
 * Here a job is n chunks handed out one at a time: the caller takes chunks too, so if a worker is asleep or off its
 * core the caller simply runs more of them, and it waits only for chunks a worker has already started.
 * Between jobs a worker spins (the engine issues them back to back), offering its core to any other runnable
 * process every yield_ns, and after spin_ns sleeps on a futex until the next job.
 *
 * A claim is one compare-and-swap on a 64-bit word holding the job's generation, its chunk count and the next
 * chunk, so a worker that wakes late cannot take a chunk of a later job. A second caller arriving while a job runs
 * (two engines in one process) runs its own chunks itself.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#define MAX_THREADS 64
#define MAX_CHUNKS 0xffff

typedef void (*chunk_fn)(void *ctx, int64_t chunk);

static struct {
    _Atomic uint64_t claim;   /* generation << 32 | chunks << 16 | next chunk */
    _Atomic uint32_t gen;     /* futex word the workers sleep on */
    _Atomic uint32_t done;    /* chunks of this job finished (futex word the caller sleeps on) */
    _Atomic int32_t sleepers; /* workers in, or about to enter, their futex wait */
    _Atomic int32_t caller_sleeping;
    chunk_fn fn;
    void *ctx;
    int threads; /* started, the caller included */
    int64_t spin_ns, yield_ns;
    pthread_mutex_t caller;
} P = {.caller = PTHREAD_MUTEX_INITIALIZER};

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take and run chunks of generation g until none is left. */
static void work(uint32_t g) {
    uint64_t v = atomic_load_explicit(&P.claim, memory_order_acquire);
    for (;;) {
        const uint32_t n = (uint32_t)(v >> 16) & MAX_CHUNKS, c = (uint32_t)v & MAX_CHUNKS;
        if ((uint32_t)(v >> 32) != g || c >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&P.claim, &v, v + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        P.fn(P.ctx, c); /* the job cannot end before this chunk does, so fn and ctx are still its own */
        if (atomic_fetch_add_explicit(&P.done, 1, memory_order_acq_rel) + 1 == n &&
            atomic_load_explicit(&P.caller_sleeping, memory_order_acquire))
            futex(&P.done, FUTEX_WAKE_PRIVATE, 1);
        v = atomic_load_explicit(&P.claim, memory_order_acquire);
    }
}

static int (*mkl_local)(const int *) = NULL; /* mkl_set_num_threads_local, Fortran interface: takes a pointer */
static const int ONE = 1;

static void *worker(void *arg) {
    (void)arg;
    if (mkl_local) mkl_local(&ONE); /* MKL called from a chunk stays on this thread */
    uint32_t seen = atomic_load(&P.gen);
    for (;;) {
        uint32_t g;
        int64_t t = now_ns(), until = t + P.spin_ns, next_yield = t + P.yield_ns;
        int k = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++k & 63) continue;
            t = now_ns();
            if (t > until) {
                atomic_fetch_add(&P.sleepers, 1);
                futex(&P.gen, FUTEX_WAIT_PRIVATE, seen);
                atomic_fetch_sub(&P.sleepers, 1);
                t = now_ns();
                until = t + P.spin_ns;
            } else if (P.yield_ns > 0 && t > next_yield) {
                sched_yield(); /* another process waiting for this core gets it; with none this returns at once */
                next_yield = now_ns() + P.yield_ns;
            }
        }
        seen = g;
        work(g);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* the workers did not survive the fork: the child runs every chunk on its calling thread */
    P.threads = 1;
    pthread_mutex_init(&P.caller, NULL);
}

/* Start `threads` threads in all (the caller is one of them); later calls only report the size.
 * mkl_local_fn: MKL's mkl_set_num_threads_local (Fortran interface), so that MKL called inside a chunk stays on its
 * thread (NULL: not needed). */
int strata_pool_start(int threads, int64_t spin_ns, int64_t yield_ns, void *mkl_local_fn) {
    if (P.threads) return P.threads;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    P.spin_ns = spin_ns;
    P.yield_ns = yield_ns;
    *(void **)&mkl_local = mkl_local_fn;
    pthread_atfork(NULL, NULL, after_fork_child);
    P.threads = 1;
    for (int i = 1; i < threads; ++i) {
        pthread_t tid;
        if (pthread_create(&tid, NULL, worker, NULL) != 0) break;
        pthread_detach(tid);
        P.threads++;
    }
    return P.threads;
}

/* Run fn(ctx, c) for every c in [0, n) on the pool's threads; returns when all have finished. */
void strata_pool_run(chunk_fn fn, void *ctx, int64_t n) {
    if (n <= 0) return;
    if (n == 1 || n > MAX_CHUNKS || P.threads <= 1 || pthread_mutex_trylock(&P.caller) != 0) {
        for (int64_t c = 0; c < n; ++c) fn(ctx, c);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    const uint32_t g = atomic_load_explicit(&P.gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&P.claim, (uint64_t)g << 32 | (uint64_t)n << 16, memory_order_release);
    atomic_store_explicit(&P.gen, g, memory_order_release);
    if (atomic_load(&P.sleepers) > 0) futex(&P.gen, FUTEX_WAKE_PRIVATE, INT32_MAX);
    work(g);
    /* what is left was started by a worker: spin a little, then sleep until its last chunk ends */
    const int64_t until = now_ns() + P.spin_ns;
    int k = 0;
    uint32_t d;
    while ((int64_t)(d = atomic_load_explicit(&P.done, memory_order_acquire)) < n) {
        cpu_relax();
        if ((++k & 63) == 0 && now_ns() > until) {
            atomic_store(&P.caller_sleeping, 1);
            d = atomic_load(&P.done);
            if ((int64_t)d < n) futex(&P.done, FUTEX_WAIT_PRIVATE, d);
            atomic_store(&P.caller_sleeping, 0);
        }
    }
    pthread_mutex_unlock(&P.caller);
}

/* ------------------------------------------------------------------ float32 linear through BLAS sgemm */
typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *, const int *);

/* A tile's m rows (ldy apart) of n outputs start as the bias: as torch's addmm, the product is then added with
 * beta = 1. */
static void fill_bias(float *y, int64_t ldy, const float *bias, int m, int n) {
    for (int r = 0; r < m; ++r)
        for (int j = 0; j < n; ++j) y[(int64_t)r * ldy + j] = bias[j];
}

struct linear_ctx {
    sgemm_t sgemm;
    const float *x, *w, *bias;
    float *y;
    int64_t ldx, m, n, k, mc, nc, n_tiles;
};

static void linear_chunk(void *p, int64_t c) {
    const struct linear_ctx *L = p;
    const int64_t m0 = (c / L->n_tiles) * L->mc, n0 = (c % L->n_tiles) * L->nc;
    const int m = (int)(L->m - m0 < L->mc ? L->m - m0 : L->mc), n = (int)(L->n - n0 < L->nc ? L->n - n0 : L->nc);
    const int k = (int)L->k, ldx = (int)L->ldx, ldy = (int)L->n;
    const float one = 1.0f, zero = 0.0f;
    float *y = L->y + m0 * L->n + n0;
    if (L->bias) fill_bias(y, L->n, L->bias + n0, m, n);
    /* row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T = w x^T */
    L->sgemm("T", "N", &n, &m, &k, &one, L->w + n0 * L->k, &k, L->x + m0 * L->ldx, &ldx, L->bias ? &one : &zero,
             y, &ldy);
}

/* y (contiguous [m, n]) = x ([m, k], rows ldx apart) @ w ([n, k], contiguous)^T (+ bias [n]), in tiles of mc rows
 * by nc columns, each one single-threaded call of sgemm_fn (BLAS sgemm_, Fortran interface). */
void strata_linear(void *sgemm_fn, const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t m, int64_t n, int64_t k, int64_t mc, int64_t nc) {
    struct linear_ctx L = {(sgemm_t)sgemm_fn, x, w, bias, y, ldx, m, n, k, mc, nc, (n + nc - 1) / nc};
    const int before = mkl_local ? mkl_local(&ONE) : 0; /* the caller's own chunks stay on its thread too */
    strata_pool_run(linear_chunk, &L, ((m + mc - 1) / mc) * L.n_tiles);
    if (mkl_local) mkl_local(&before);
}

/* ------------------------------------------------------------------ float32 linear over weights packed once */
/* MKL's cblas_sgemm_compute (row-major, LP64 ints): C = op(A) * B, B given in the packed format of
 * cblas_sgemm_pack, which folded alpha in. */
typedef void (*sgemm_compute_t)(int layout, int transa, int transb, int m, int n, int k, const float *a, int lda,
                                const float *b, int ldb, float beta, float *c, int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, PACKED = 151 };

struct packed_ctx {
    sgemm_compute_t compute;
    const float *x, *bias;
    const void *const *packed; /* one packed weight slice per column tile */
    float *y;
    int64_t ldx, m, n, k, mc, nc, n_tiles;
};

static void packed_chunk(void *p, int64_t c) {
    const struct packed_ctx *L = p;
    const int64_t m0 = (c / L->n_tiles) * L->mc, j = c % L->n_tiles, n0 = j * L->nc;
    const int m = (int)(L->m - m0 < L->mc ? L->m - m0 : L->mc), n = (int)(L->n - n0 < L->nc ? L->n - n0 : L->nc);
    float *y = L->y + m0 * L->n + n0;
    if (L->bias) fill_bias(y, L->n, L->bias + n0, m, n);
    L->compute(ROW_MAJOR, NO_TRANS, PACKED, m, n, (int)L->k, L->x + m0 * L->ldx, (int)L->ldx, L->packed[j],
               (int)L->k, L->bias ? 1.0f : 0.0f, y, (int)L->n);
}

/* y (contiguous [m, n]) = x ([m, k], rows ldx apart) @ w^T (+ bias), w given as its column tiles of nc output
 * features each, packed by cblas_sgemm_pack (B, transposed); tiles of mc rows by nc columns. */
void strata_linear_packed(void *compute_fn, const float *x, int64_t ldx, const void *const *packed, const float *bias,
                          float *y, int64_t m, int64_t n, int64_t k, int64_t mc, int64_t nc) {
    struct packed_ctx L = {(sgemm_compute_t)compute_fn, x, bias, packed, y, ldx, m, n, k, mc, nc, (n + nc - 1) / nc};
    const int before = mkl_local ? mkl_local(&ONE) : 0;
    strata_pool_run(packed_chunk, &L, ((m + mc - 1) / mc) * L.n_tiles);
    if (mkl_local) mkl_local(&before);
}
