/* Parallel loops of the CPU kernels: through the engine's work-sharing pool (cpu_pool.c) once the runner has
 * handed its run function to the library (strata_set_pool), else through OpenMP (cpu_kernel.py hashes this
 * header into each library's name). */
#ifndef STRATA_CPU_PAR_H
#define STRATA_CPU_PAR_H
#include <stdint.h>

typedef void (*strata_chunk_fn)(void *ctx, int64_t chunk);
typedef void (*strata_run_fn)(strata_chunk_fn fn, void *ctx, int64_t n);

static strata_run_fn par_pool = 0;

void strata_set_pool(void *run) { par_pool = (strata_run_fn)run; }

/* fn(ctx, c) for c in [0, n), in parallel. */
static inline void par_run(strata_chunk_fn fn, void *ctx, int64_t n) {
    if (n == 1) {
        fn(ctx, 0);
    } else if (par_pool) {
        par_pool(fn, ctx, n);
    } else {
#pragma omp parallel for schedule(dynamic)
        for (int64_t c = 0; c < n; ++c) fn(ctx, c);
    }
}

/* Chunks for `rows` rows of `per_row` elements each: one below `par_min` elements in all, else up to 16 of at
 * least ~4k elements; chunk c covers rows [c * rows / n, (c + 1) * rows / n). */
static inline int64_t par_chunks(int64_t rows, int64_t per_row, int64_t par_min) {
    const int64_t total = rows * per_row;
    if (rows <= 1 || total < par_min) return 1;
    int64_t n = total / 4096;
    n = n < 2 ? 2 : n;
    n = n > 16 ? 16 : n;
    return n < rows ? n : rows;
}
#define PAR_LO(c, rows, n) ((c) * (rows) / (n))
#endif
