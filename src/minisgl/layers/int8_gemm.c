// Weight-only int8 GEMM for a few rows (decode): y[m, n] = sum_g s[n, g] * sum_{k in g} x[m, k] * q[n, k].
//
// q is int8 [N, K] row-major, s float32 [N, K / G] (one scale per group of G inputs), x float32 [M, K], y float32
// [M, N]. Built by layers/cpu_kernel.py with the host compiler for the host CPU (-march=native): AVX-512 or AVX2
// paths where the compiler targets them, plain C otherwise. The output channels are split over the OpenMP
// threads of the process (torch's own pool: the library links the libgomp torch loaded).
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload_q(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vset1(float s) { return _mm512_set1_ps(s); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload_q(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vset1(float s) { return _mm256_set1_ps(s); }
static inline float vsum(vec a) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#else
#define LANES 1
typedef float vec;
static inline vec vzero(void) { return 0.0f; }
static inline vec vload_q(const int8_t *p) { return (float)*p; }
static inline vec vload(const float *p) { return *p; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline vec vset1(float s) { return s; }
static inline float vsum(vec a) { return a; }
#endif

#define MAX_ROWS 4
#define BLOCK 4     // output channels per step: independent accumulator chains, one load of x for all of them
#define PREFETCH 1024  // bytes ahead in the packed weight stream

// The packed layout: BLOCK channels side by side, LANES inputs at a time, so that a block's weights are one
// sequential stream ([N / BLOCK][K / LANES][BLOCK][LANES]); the scales likewise ([N / BLOCK][K / G][BLOCK]).
// A remainder of N % BLOCK channels is packed the same way with a block of that many channels.
static inline int64_t block_width(int64_t n, int64_t n0) { return n - n0 < BLOCK ? n - n0 : BLOCK; }

void int8_pack(const int8_t *q, const float *s, int8_t *packed_q, float *packed_s, int64_t n, int64_t k, int64_t g) {
    for (int64_t n0 = 0; n0 < n; n0 += BLOCK) {
        const int64_t nb = block_width(n, n0);
        int8_t *pq = packed_q + n0 * k;
        for (int64_t i = 0; i < k; i += LANES)
            for (int64_t c = 0; c < nb; c++)
                for (int64_t l = 0; l < LANES; l++) *pq++ = q[(n0 + c) * k + i + l];
        float *ps = packed_s + n0 * (k / g);
        for (int64_t j = 0; j < k / g; j++)
            for (int64_t c = 0; c < nb; c++) *ps++ = s[(n0 + c) * (k / g) + j];
    }
}

// Output channels [n0, n0 + nb) for rows [0, m): per group, each channel's dot products in lanes, then scaled into
// its total (one horizontal sum per channel and row at the end).
static inline __attribute__((always_inline)) void channels(const float *x, const int8_t *pq, const float *ps, float *y,
                                                           int64_t m, int64_t nb, int64_t k, int64_t g, int64_t n0,
                                                           int64_t ldy) {
    vec total[BLOCK][MAX_ROWS], part[BLOCK][MAX_ROWS];
    const int8_t *q = pq + n0 * k;
    const float *s = ps + n0 * (k / g);
    for (int64_t c = 0; c < nb; c++)
        for (int64_t r = 0; r < m; r++) total[c][r] = vzero();
    for (int64_t k0 = 0; k0 < k; k0 += g) {
        for (int64_t c = 0; c < nb; c++)
            for (int64_t r = 0; r < m; r++) part[c][r] = vzero();
        for (int64_t i = k0; i < k0 + g; i += LANES) {
            vec xs[MAX_ROWS];
            for (int64_t r = 0; r < m; r++) xs[r] = vload(x + r * k + i);
            __builtin_prefetch(q + PREFETCH);
            for (int64_t c = 0; c < nb; c++) {
                vec w = vload_q(q);
                q += LANES;
                for (int64_t r = 0; r < m; r++) part[c][r] = vfma(w, xs[r], part[c][r]);
            }
        }
        for (int64_t c = 0; c < nb; c++) {
            vec scale = vset1(*s++);
            for (int64_t r = 0; r < m; r++) total[c][r] = vfma(part[c][r], scale, total[c][r]);
        }
    }
    for (int64_t c = 0; c < nb; c++)
        for (int64_t r = 0; r < m; r++) y[r * ldy + n0 + c] = vsum(total[c][r]);
}

// y = x W^T over int8_pack's layout. Returns 0, or -1 when the shapes are outside what this kernel takes.
int int8_gemm(const float *x, const int8_t *pq, const float *ps, float *y, int64_t m, int64_t n, int64_t k,
              int64_t g) {
    if (m < 1 || m > MAX_ROWS || g < LANES || g % LANES != 0 || k % g != 0) return -1;
    const int64_t blocks = n / BLOCK;
// The row count as a constant, so that each case keeps its accumulators in registers.
#define ROWS(M)                                                                                                    \
    case M:                                                                                                        \
        _Pragma("omp parallel for schedule(static)") for (int64_t b = 0; b < blocks; b++)                          \
            channels(x, pq, ps, y, M, BLOCK, k, g, b * BLOCK, n);                                                  \
        if (blocks * BLOCK < n) channels(x, pq, ps, y, M, n - blocks * BLOCK, k, g, blocks * BLOCK, n);            \
        break;
    switch (m) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) }
    return 0;
}

int int8_gemm_lanes(void) { return LANES; }
