/* Routed experts of a few tokens on one CPU thread, weights fp32 or bfloat16 (kernels/cpu_moe.py builds and
 * calls it).
 *
 * out[t] += sum over t's chosen experts e held here of weight[t, j] * down[e]^T (silu(gate) * up), where
 * [gate | up] = x[t] @ gate_up[e]. Shapes: x [T, H]; expert_ids int64 [T, K] (global ids); weights [T, K];
 * gate_up [E_local, H, 2I]; down [E_local, I, H]; out [T, H], accumulated into (the caller zeroes it); x, the
 * routing weights, the intermediate and out are fp32, so a bfloat16 model's experts round only at the end.
 *
 * Why not torch: a decode step gives each expert 1-4 rows, and MKL's sgemm at that row count streams a cold
 * [512, 384] weight at 7-9 GB/s where one core reads memory at 20+ GB/s. Here every weight row is read once,
 * in order (the hardware prefetcher's best case), and applied to all of the expert's rows while it is in L1;
 * the rows' partial results (h: M x 2I floats) stay in L1/L2. An expert no token chose is never read.
 * The inner loops are plain C that gcc vectorizes; target_clones builds them for AVX-512, AVX2 and baseline
 * x86-64 and picks one at load, so the library runs on any x86-64 CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MULTIVERSION
#endif

/* A weight value as fp32: fp32 as is; bfloat16's 16 bits are fp32's upper half, so widening is exact. */
static inline float from_f32(float v) { return v; }

static inline float from_bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* run_expert_<suffix>: one expert over its m rows, weights of type W; h [m, 2I] fp32 scratch, rows [m] token ids,
 * scales [m] routing weights. One function per weight type (no branch inside the loops gcc vectorizes). */
#define DEFINE_RUN_EXPERT(suffix, W, widen)                                                                      \
    MULTIVERSION                                                                                                  \
    static void run_expert_##suffix(const float *restrict x, int64_t hidden, const W *restrict gate_up,          \
                                    const W *restrict down, int64_t inter, const int64_t *rows,                  \
                                    const float *scales, int64_t m, float *restrict h, float *restrict out) {    \
        const int64_t width = 2 * inter;                                                                          \
        memset(h, 0, sizeof(float) * (size_t)(m * width));                                                        \
        for (int64_t k = 0; k < hidden; k++) { /* gate_up row k: read once, applied to every row */              \
            const W *w = gate_up + k * width;                                                                     \
            for (int64_t r = 0; r < m; r++) {                                                                     \
                float *restrict acc = h + r * width;                                                              \
                const float a = x[rows[r] * hidden + k];                                                          \
                for (int64_t n = 0; n < width; n++) acc[n] += a * widen(w[n]);                                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int64_t r = 0; r < m; r++) { /* h[r, :I] <- scale * silu(gate) * up */                             \
            float *g = h + r * width;                                                                             \
            for (int64_t i = 0; i < inter; i++) g[i] = scales[r] * g[i] / (1.0f + expf(-g[i])) * g[inter + i];   \
        }                                                                                                         \
        for (int64_t i = 0; i < inter; i++) { /* down row i: read once */                                        \
            const W *w = down + i * hidden;                                                                       \
            for (int64_t r = 0; r < m; r++) {                                                                     \
                float *restrict acc = out + rows[r] * hidden;                                                     \
                const float a = h[r * width + i];                                                                 \
                for (int64_t n = 0; n < hidden; n++) acc[n] += a * widen(w[n]);                                   \
            }                                                                                                     \
        }                                                                                                         \
    }

DEFINE_RUN_EXPERT(f32, float, from_f32)
DEFINE_RUN_EXPERT(bf16, uint16_t, from_bf16)

/* Returns 0, or -1 when scratch could not be allocated (out untouched then). is_bf16: gate_up and down hold
 * bfloat16 (as uint16), else fp32. */
int moe_experts(const float *x, int64_t num_tokens, int64_t hidden, const int64_t *expert_ids, const float *weights,
                int64_t top_k, const void *gate_up, const void *down, int is_bf16, int64_t num_local, int64_t inter,
                int64_t expert_offset, float *out) {
    const int64_t num_pairs = num_tokens * top_k;
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(num_pairs > 0 ? num_pairs : 1));
    float *scales = malloc(sizeof(float) * (size_t)(num_pairs > 0 ? num_pairs : 1));
    /* an expert's rows are at most every pair (a token naming one expert twice gets a row per naming) */
    float *h = malloc(sizeof(float) * (size_t)((num_pairs > 0 ? num_pairs : 1) * 2 * inter));
    if (!rows || !scales || !h) {
        free(rows); free(scales); free(h);
        return -1;
    }
    for (int64_t e = 0; e < num_local; e++) {
        int64_t m = 0;
        for (int64_t p = 0; p < num_pairs; p++) {
            if (expert_ids[p] - expert_offset == e) {
                rows[m] = p / top_k;
                scales[m] = weights[p];
                m++;
            }
        }
        if (m == 0) continue;
        if (is_bf16)
            run_expert_bf16(x, hidden, (const uint16_t *)gate_up + e * hidden * 2 * inter,
                            (const uint16_t *)down + e * inter * hidden, inter, rows, scales, m, h, out);
        else
            run_expert_f32(x, hidden, (const float *)gate_up + e * hidden * 2 * inter,
                           (const float *)down + e * inter * hidden, inter, rows, scales, m, h, out);
    }
    free(rows); free(scales); free(h);
    return 0;
}
