/* The "panels" matmul form (specdec_kernels/matmul.py): y = x @ w^T in float32 for the few rows of
 * a decoding or verification step, reading each weight once at the memory's bandwidth.
 *
 * At 1-16 rows a decoding step's matmuls stream their weights from memory, and the arithmetic is
 * a few fused multiply-adds per weight loaded; yet MKL's and oneDNN's GEMMs slow down with each
 * row: on a 2-core x86 VM MKL's took 1.34x its one-row time at 5 rows and 1.46x at 8
 * (docs/performance.md). Here the weight is packed once into panels of 16 outputs,
 * panel[p][i][j] = w[16 p + j][i] (the last panel zero-padded), so that a step of the inner loop
 * loads 16 consecutive weights of one input column and adds x[r][i] times them into row r's
 * 16 accumulators, for two panels and up to ROWS rows at once: the accumulators stay in
 * registers, the loads are sequential, and more rows cost registers, not bytes. Rows beyond
 * ROWS take further passes over the panel pair, from the cache.
 *
 * Built at first use with the system's C compiler (specdec_kernels/_native.py), for the CPU it
 * runs on; OpenMP is the one torch loaded (same soname, so the loader shares it), with the thread
 * count the caller passes (torch's). Each output is a sum over i in order, in float32 with fused
 * multiply-adds: the same product as F.linear's up to rounding. The _bf16 functions read
 * bfloat16 weights (the "panels_bfloat16" form, for drafts): half the bytes, the rest float32.
 */
#include <stdint.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64), aligned(4)));                 /* 16 floats */
typedef uint16_t vec16 __attribute__((vector_size(32), aligned(2)));            /* 16 bfloat16 */
typedef uint32_t vec32 __attribute__((vector_size(64)));

enum { LANES = 16, PREFETCH = 32 /* panel steps ahead (2 KiB of float32) */ };
#ifdef __AVX512F__
#define ROWS 12 /* 2 panels x 12 rows: 24 of the 32 vector registers */
#else
#define ROWS 3 /* AVX2: a vec is two of the 16 registers */
#endif

/* w [n, k] row-major into out [ceil(n / 16), k, 16], of 4-byte (float32) or 2-byte (bfloat16
 * bits) elements. */
static inline __attribute__((always_inline)) void pack(const void* w, int64_t n, int64_t k, void* out,
                                                       const int size, int threads) {
  int64_t panels = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p++)
    for (int64_t i = 0; i < k; i++)
      for (int64_t j = 0; j < LANES; j++) {
        int64_t row = p * LANES + j, to = (p * k + i) * LANES + j;
        if (size == 4) ((float*)out)[to] = row < n ? ((const float*)w)[row * k + i] : 0.0f;
        else ((uint16_t*)out)[to] = row < n ? ((const uint16_t*)w)[row * k + i] : 0;
      }
}

void panels_pack(const float* w, int64_t n, int64_t k, float* out, int threads) { pack(w, n, k, out, 4, threads); }

void panels_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int threads) {
  pack(w, n, k, out, 2, threads);
}

/* 16 weights of a panel as float32 (bfloat16 bits are float32's upper half). */
static inline __attribute__((always_inline)) vec load(const void* panel, int64_t at, const int half) {
  if (!half) return *(const vec*)((const float*)panel + at);
  return (vec)(__builtin_convertvector(*(const vec16*)((const uint16_t*)panel + at), vec32) << 16);
}

/* rows (<= ROWS) rows of x [rows, k] times np (1 or 2) panels from pa, into y's columns col...;
 * constant np, rows and half (the callers' cases) unroll the row loops and keep acc in registers. */
static inline __attribute__((always_inline)) void tile(const float* x, int64_t k, const void* pa, const int np,
                                                       const int rows, const int half, float* y, int64_t n,
                                                       int64_t col) {
  vec acc0[ROWS], acc1[ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = (vec){0};
  const char* pb = (const char*)pa + k * LANES * (half ? 2 : 4);
  for (int64_t i = 0; i < k; i++) {
    vec a = load(pa, i * LANES, half), b;
    __builtin_prefetch((const char*)pa + (i + PREFETCH) * LANES * (half ? 2 : 4));
    if (np == 2) {
      b = load(pb, i * LANES, half);
      __builtin_prefetch(pb + (i + PREFETCH) * LANES * (half ? 2 : 4));
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
      float s = x[r * k + i];
      acc0[r] += a * s;
      if (np == 2) acc1[r] += b * s;
    }
  }
  int64_t width0 = n - col < LANES ? n - col : LANES, width1 = n - col - LANES < LANES ? n - col - LANES : LANES;
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) {
    memcpy(y + r * n + col, &acc0[r], width0 * sizeof(float));
    if (np == 2) memcpy(y + r * n + col + LANES, &acc1[r], width1 * sizeof(float));
  }
}

#define CASE(R)                                                                      \
  case R:                                                                            \
    if (np == 2) tile(xr, k, pa, 2, R, half, yr, n, col); else tile(xr, k, pa, 1, R, half, yr, n, col); \
    break;

/* y [m, n] = x [m, k] @ w^T from packed = pack(w) (float32, or bfloat16 with half); x and y
 * contiguous float32. */
static inline __attribute__((always_inline)) void matmul(const float* x, int64_t m, int64_t k, const void* packed,
                                                         int64_t n, float* y, const int half, int threads) {
  int64_t panels = (n + LANES - 1) / LANES, pairs = (panels + 1) / 2, size = half ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t q = 0; q < pairs; q++) {
    int64_t p = 2 * q, col = p * LANES;
    int np = p + 1 < panels ? 2 : 1;
    const void* pa = (const char*)packed + p * k * LANES * size;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
      const float* xr = x + r0 * k;
      float* yr = y + r0 * n;
      switch (m - r0 < ROWS ? (int)(m - r0) : ROWS) {
        CASE(1) CASE(2) CASE(3)
#if ROWS > 3
        CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#endif
      }
    }
  }
}

void panels_matmul(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, float* y, int threads) {
  matmul(x, m, k, packed, n, y, 0, threads);
}

/* The same from bfloat16 weights (panels_pack_bf16 of their bits): x stays float32, each product
 * and sum is float32's; only the weights are rounded. */
void panels_matmul_bf16(const float* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n, float* y,
                        int threads) {
  matmul(x, m, k, packed, n, y, 1, threads);
}
