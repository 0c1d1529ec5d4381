/* Decode-sized projections on the CPU: Y[r, n] = sum_k X[r, k] * W[n, k] for R rows of X (fp32, row-major).
 *
 * A decode step is a product of a few rows against every weight, so its speed is how fast the weights stream: each
 * row of W is read once for all R rows of X. Each dot product keeps two 8-float accumulators (even and odd chunks of
 * 16) and sums them in one fixed order, so a row's result is the same bits whether 1, 2, 3 or 4 rows share the call:
 * a draft forward's clean rows equal the AR step's. Built at first use by studio/engine/kernels/cpu.py. */
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

#define BLOCK(RB)                                                                                 \
static void block##RB(const float *w, const float *X, float *Y, long N, long K, long n) {       \
    v8 a[RB], b[RB];                                                                              \
    for (int r = 0; r < RB; r++) { a[r] = (v8){0}; b[r] = (v8){0}; }                             \
    long k = 0;                                                                                   \
    for (; k + 16 <= K; k += 16) {                                                                \
        v8 w0 = load(w + k), w1 = load(w + k + 8);                                                \
        for (int r = 0; r < RB; r++) {                                                            \
            a[r] += w0 * load(X + r * K + k);                                                     \
            b[r] += w1 * load(X + r * K + k + 8);                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < RB; r++) {                                                                \
        float s = hsum(a[r] + b[r]);                                                              \
        for (long j = k; j < K; j++) s += w[j] * X[r * K + j];                                    \
        Y[r * N + n] = s;                                                                         \
    }                                                                                             \
}
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4)

/* Any R works (blocks of 4 rows over a weight row still in L1), but past 4 rows the loads of X bound it and oneDNN
 * is faster: cpu.py sends it 1-4 rows. */
void skinny(const float *W, const float *X, float *Y, long N, long K, long R, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        const float *w = W + n * K;
        for (long r0 = 0; r0 < R; r0 += 4) {
            const float *x = X + r0 * K;
            float *y = Y + r0 * N;
            switch (R - r0) {
                case 1: block1(w, x, y, N, K, n); break;
                case 2: block2(w, x, y, N, K, n); break;
                case 3: block3(w, x, y, N, K, n); break;
                default: block4(w, x, y, N, K, n);
            }
        }
    }
}

/* A gated LoRA on a run of rows: Y[i, :] += scale * B (A X[i, :]) for `rows` rows of X [rows, K] and Y [rows, N]
 * (row i of Y at Y + i * ldy: a fused product's slice), with A [r, K] and B [N, r], r <= 64 -- R-ISD's MASK rows in
 * every projection, in one call instead of torch's five small ops (their overhead was most of the LoRA's cost in a
 * decode step). */
void lora_rows(const float *X, float *Y, const float *A, const float *B, long rows, long K, long N, long r,
               long ldy, float scale) {
    float low[64];
    for (long i = 0; i < rows; i++) {
        const float *x = X + i * K;
        for (long j = 0; j < r; j++) {
            const float *a = A + j * K;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (long k = 0; k < K; k++) s += a[k] * x[k];
            low[j] = s * scale;
        }
        float *y = Y + i * ldy;
        for (long n = 0; n < N; n++) {
            const float *b = B + n * r;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (long j = 0; j < r; j++) s += b[j] * low[j];
            y[n] += s;
        }
    }
}
