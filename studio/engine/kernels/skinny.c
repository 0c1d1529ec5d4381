/* Decode-sized projections on the CPU: Y[r, n] = sum_k X[r, k] * W[n, k] for R rows of X (fp32, row-major).
 *
 * A decode step is a product of a few rows against every weight, so its speed is how fast the weights stream: each
 * row of W is read once for all R rows of X. Each dot product keeps two 8-float accumulators (even and odd chunks of
 * 16) and sums them in one fixed order, so a row's result is the same bits whether 1, 2, 3 or 4 rows share the call:
 * a draft forward's clean rows equal the AR step's. Built at first use by studio/engine/kernels/cpu.py. */
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef signed char c8 __attribute__((vector_size(8)));

static inline v8 load(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
/* 8 int8 weights widened to floats (exactly: every int8 is a float). GCC scalarises __builtin_convertvector from
 * int8 (a sign extension and a conversion per weight), so x86 gets the widening instructions by name. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load_i8(const signed char *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(__SSE4_1__)
#include <immintrin.h>
static inline v8 load_i8(const signed char *p) {
    int lo, hi;
    memcpy(&lo, p, 4);
    memcpy(&hi, p + 4, 4);
    __m128 halves[2] = {_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(lo))),
                        _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(hi)))};
    v8 v;
    memcpy(&v, halves, sizeof v);
    return v;
}
#else
static inline v8 load_i8(const signed char *p) { c8 c; memcpy(&c, p, sizeof c); return __builtin_convertvector(c, v8); }
#endif
static inline float hsum(v8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* One weight row against RB rows of X; weights of type T read by LOAD, the sum times the row's scale (1 for fp32
 * weights: a product by 1.0f is exact, so the fp32 kernel's bits are its own) */
#define BLOCK(NAME, T, LOAD, RB)                                                                  \
static void NAME##RB(const T *w, float scale, const float *X, float *Y, long N, long K, long n) { \
    v8 a[RB], b[RB];                                                                              \
    for (int r = 0; r < RB; r++) { a[r] = (v8){0}; b[r] = (v8){0}; }                             \
    long k = 0;                                                                                   \
    for (; k + 16 <= K; k += 16) {                                                                \
        v8 w0 = LOAD(w + k), w1 = LOAD(w + k + 8);                                                \
        for (int r = 0; r < RB; r++) {                                                            \
            a[r] += w0 * load(X + r * K + k);                                                     \
            b[r] += w1 * load(X + r * K + k + 8);                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < RB; r++) {                                                                \
        float s = hsum(a[r] + b[r]);                                                              \
        for (long j = k; j < K; j++) s += (float)w[j] * X[r * K + j];                             \
        Y[r * N + n] = s * scale;                                                                 \
    }                                                                                             \
}
BLOCK(block, float, load, 1) BLOCK(block, float, load, 2) BLOCK(block, float, load, 3) BLOCK(block, float, load, 4)
BLOCK(qblock, signed char, load_i8, 1) BLOCK(qblock, signed char, load_i8, 2) BLOCK(qblock, signed char, load_i8, 3)
BLOCK(qblock, signed char, load_i8, 4)

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
                case 1: block1(w, 1.0f, x, y, N, K, n); break;
                case 2: block2(w, 1.0f, x, y, N, K, n); break;
                case 3: block3(w, 1.0f, x, y, N, K, n); break;
                default: block4(w, 1.0f, x, y, N, K, n);
            }
        }
    }
}

/* The same product for weight-only int8: W [N, K] int8 with one scale per row, S [N]; a quarter of the bytes to
 * stream, and every row's result the same bits at any row count, as above (cpu.py sends it up to 16 rows). */
void skinny_i8(const signed char *W, const float *S, const float *X, float *Y, long N, long K, long R, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        const signed char *w = W + n * K;
        for (long r0 = 0; r0 < R; r0 += 4) {
            const float *x = X + r0 * K;
            float *y = Y + r0 * N;
            switch (R - r0) {
                case 1: qblock1(w, S[n], x, y, N, K, n); break;
                case 2: qblock2(w, S[n], x, y, N, K, n); break;
                case 3: qblock3(w, S[n], x, y, N, K, n); break;
                default: qblock4(w, S[n], x, y, N, K, n);
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
