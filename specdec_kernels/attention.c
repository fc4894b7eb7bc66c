/* The CPU path of ragged_attention (specdec_kernels/attention.py) for the few queries of a
 * decoding, verification or tree step, in float32.
 *
 * The torch path spends a decoding step's attention in a dozen ops (two batched GEMMs, masks,
 * a softmax) whose dispatch outweighs their work at a few queries over a short cache, the more
 * so right after a matmul has streamed its weights through the core's caches. Here one call
 * computes every (row, query, head): the scores of the keys the query sees, their softmax and
 * the weighted sum of the values, reading only keys below the row's length. attention.py runs
 * it up to a work bound (rows x queries x heads x cache positions) past which torch's GEMMs,
 * which read each key once for every query sharing it, are faster at most shapes.
 *
 * Each (row, query, head) is computed alone, in the same order whatever the other queries, so a
 * query's output does not depend on how many queries share the call, and a tree mask equal to
 * the causal mask gives the causal output to the bit. Built with panels.c by
 * specdec_kernels/_native.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64), aligned(4))); /* 16 floats */
typedef int32_t ivec __attribute__((vector_size(64), aligned(4)));
enum { LANES = 16 };

static inline vec splat(float x) { return (vec){0} + x; }
static inline vec choose(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

/* exp of 16 floats: Cephes' expf (reduction by ln 2, a degree-6 polynomial, about 1 ulp); 0
 * below -87.3 (so exp(-inf) = 0), NaN stays NaN. */
static inline vec exp16(vec x) {
  ivec under = x < splat(-87.3365448f);
  x = choose(x > splat(88.3762626f), splat(88.3762626f), x);
  x = choose(under, splat(-87.0f), x);
  vec shifted = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds x / ln 2 to an integer n */
  ivec n = (ivec)shifted - 0x4B400000;
  vec nf = shifted - 12582912.0f;
  vec r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  vec p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  return choose(under, splat(0.0f), (vec)((ivec)p + (n << 23))); /* times 2^n */
}

typedef int32_t lanes __attribute__((vector_size(64)));
#define FOLD(x, y, LO, HI) (__builtin_shuffle(x, y, (lanes)LO) + __builtin_shuffle(x, y, (lanes)HI))

/* out[j] = the sum of a[j]'s lanes, for 16 vectors; each sum only from its own vector's lanes. */
static inline vec sums16(const vec* a) {
  vec c[8], d[4], e[2];
  for (int i = 0; i < 8; i++)
    c[i] = FOLD(a[2 * i], a[2 * i + 1], ((lanes){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                ((lanes){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
  for (int i = 0; i < 4; i++)
    d[i] = FOLD(c[2 * i], c[2 * i + 1], ((lanes){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}),
                ((lanes){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}));
  for (int i = 0; i < 2; i++)
    e[i] = FOLD(d[2 * i], d[2 * i + 1], ((lanes){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}),
                ((lanes){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}));
  return FOLD(e[0], e[1], ((lanes){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}),
              ((lanes){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}));
}

/* scores[j] = scale * q . k[j] for j < count, keys `stride` floats apart. With D a multiple of 16
 * the products are summed in vector lanes, 16 keys at a time (a last partial group gets zeros
 * for the missing keys, so every key's sum is formed the same way). */
static inline __attribute__((always_inline)) void dot_keys(const float* q, const float* k, int64_t stride,
                                                           const int64_t D, int64_t count, float scale,
                                                           float* scores) {
  if (D % LANES) {
    for (int64_t j = 0; j < count; j++) {
      float s = 0;
      for (int64_t d = 0; d < D; d++) s += q[d] * k[j * stride + d];
      scores[j] = s * scale;
    }
    return;
  }
  for (int64_t j0 = 0; j0 < count; j0 += LANES) {
    vec acc[LANES];
    for (int64_t j = 0; j < LANES; j++) {
      vec a = {0};
      if (j0 + j < count)
        for (int64_t d = 0; d < D; d += LANES) a += *(const vec*)(q + d) * *(const vec*)(k + (j0 + j) * stride + d);
      acc[j] = a;
    }
    *(vec*)(scores + j0) = sums16(acc) * scale; /* scores has room for a whole last group */
  }
}

/* o[0 .. D) = sum over j < count of p[j] v[j] (keys `stride` floats apart), skipping zero weights
 * (hidden keys). With D a multiple of 16 up to 256 the sums stay in registers. */
static inline __attribute__((always_inline)) void weigh_values(const float* p, const float* v, int64_t stride,
                                                               const int64_t D, int64_t count, float* o) {
  if (D % LANES || D > 16 * LANES) {
    memset(o, 0, D * sizeof(float));
    for (int64_t j = 0; j < count; j++)
      if (p[j] != 0.0f)
        for (int64_t d = 0; d < D; d++) o[d] += p[j] * v[j * stride + d];
    return;
  }
  vec acc[16];
  for (int64_t c = 0; c < D / LANES; c++) acc[c] = (vec){0};
  for (int64_t j = 0; j < count; j++)
    if (p[j] != 0.0f)
      for (int64_t c = 0; c < D / LANES; c++) acc[c] += p[j] * *(const vec*)(v + j * stride + c * LANES);
  for (int64_t c = 0; c < D / LANES; c++) memcpy(o + c * LANES, &acc[c], sizeof(vec));
}

/* One query's output o [D] over keys k, values v [count, D] (`stride` floats apart), hidden keys
 * -inf in the scores s [count + 16] it fills first. */
static inline __attribute__((always_inline)) void one_query(const float* q, const float* k, const float* v,
                                                            int64_t stride, const int64_t D, int64_t count,
                                                            float scale, const uint8_t* sees, int64_t new_from,
                                                            float* s, float* o) {
  dot_keys(q, k, stride, D, count, scale, s);
  if (sees) /* a tree: the new tokens (from new_from on) this query does not see */
    for (int64_t j = new_from; j < count; j++)
      if (!sees[j - new_from]) s[j] = -INFINITY;
  float m = -INFINITY;
  for (int64_t j = 0; j < count; j++) m = s[j] > m ? s[j] : m;
  for (int64_t j = count; j < count + LANES; j++) s[j] = -INFINITY;
  for (int64_t j = 0; j < count; j += LANES) *(vec*)(s + j) = exp16(*(vec*)(s + j) - m);
  float sum = 0;
  for (int64_t j = 0; j < count; j++) sum += s[j];
  float inv = 1.0f / sum;
  for (int64_t j = 0; j < count; j++) s[j] *= inv;
  weigh_values(s, v, stride, D, count, o);
}

/* out [B, T, Hq, D] from q [B, T, Hq, D] (both contiguous) and the caches k, v [B, Lmax, Hkv, D]
 * with element strides (sb, sl, sh, 1). Row b's real queries are its first n = q_seqlens[b] (T
 * where q_seqlens is NULL), at positions L - n .. L - 1 with L = cache_seqlens[b]; query t sees
 * keys up to its own, only the last `window` of them when window > 0, or with a tree ([B, T, T]
 * bytes, 0 or 1) the keys before the new tokens and new token j where tree[b][t][j]. Padding
 * queries get zeros; a row whose lengths are out of range (which attention.py's checks refuse
 * before the call) gets NaN without reading the caches. scratch: threads * (Lmax + 16) floats. */
void ragged_attention_few_queries(const float* q, int64_t B, int64_t T, int64_t Hq, int64_t D, const float* k,
                                  const float* v, int64_t sb, int64_t sl, int64_t sh, int64_t Hkv, int64_t Lmax,
                                  const int64_t* cache_seqlens, const int64_t* q_seqlens, int64_t window,
                                  const uint8_t* tree, float scale, float* out, float* scratch, int threads) {
  int64_t G = Hq / Hkv;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < B * Hkv * T * G; task++) {
    /* KV head major: a thread's consecutive tasks read the same keys and values. */
    int64_t g = task % G, t = task / G % T, kvh = task / (G * T) % Hkv, b = task / (G * T * Hkv);
    int64_t h = kvh * G + g, n = q_seqlens ? q_seqlens[b] : T, L = cache_seqlens[b];
    float* o = out + ((b * T + t) * Hq + h) * D;
    if (n < 1 || n > T || L < n || L > Lmax) {
      for (int64_t d = 0; d < D; d++) o[d] = NAN;
      continue;
    }
    if (t >= n) {
      memset(o, 0, D * sizeof(float));
      continue;
    }
    int64_t start = L - n, last = start + t;
    int64_t first = !tree && window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    int64_t count = (tree ? L : last + 1) - first;
    const float* qr = q + ((b * T + t) * Hq + h) * D;
    const float* kh = k + b * sb + kvh * sh + first * sl;
    const float* vh = v + b * sb + kvh * sh + first * sl;
    const uint8_t* sees = tree ? tree + (b * T + t) * T : 0;
    float* s = scratch + (int64_t)omp_get_thread_num() * (Lmax + LANES);
    switch (D) { /* the common head dims with constant loop bounds */
      case 64: one_query(qr, kh, vh, sl, 64, count, scale, sees, start - first, s, o); break;
      case 128: one_query(qr, kh, vh, sl, 128, count, scale, sees, start - first, s, o); break;
      default: one_query(qr, kh, vh, sl, D, count, scale, sees, start - first, s, o);
    }
  }
}
