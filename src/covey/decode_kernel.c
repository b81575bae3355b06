/* covey's decode kernel (float32, AVX-512), loaded by covey/decode_kernel.py, which builds it with
   -march=native for the CPU it runs on.

   covey_decode_linear: a few rows of activations x (M x K) times a list of weight matrices W_j (N_j x K,
   row-major, as a model holds them), outputs side by side:
       y[m, off_j + n] = sum_k x[m, k] W_j[n, k] (+ b_j[n])
   With so few rows, a product is bound by streaming the weights from memory. Each thread streams its
   share of the weight rows once, prefetching far ahead of the rows it multiplies (what general matrix
   libraries do not do for so few rows), and multiplies 4 weight rows by up to 4 rows of x at a time in
   registers; with more rows of x, a tile of weight rows makes several passes, and the prefetches are
   spread over them. Every output is summed in the same order whatever the number of threads.

   covey_decode_step: one token per row through a whole Llama-family layer stack (norms, products,
   rotary embedding, cache writes, attention, MLP) in one parallel region. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define W_ROWS 4   /* weight rows per tile */
#define X_ROWS 4   /* rows of x per pass of a tile, at most */
#define AHEAD 2048 /* floats of the weight stream prefetched ahead of the rows multiplied */

/* sum of a[i] * b[i] */
static inline float dot(const float *a, const float *b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

/* Adds the sums of v[4m + r] (r, m < 4) to y[m * ldy + r] for m < mb: the 16 horizontal sums in one
   tree of shuffles and adds, each row of x's four sums stored together. */
static inline __m512 lane_sums_of_4(__m512 a, __m512 b, __m512 c, __m512 d) {
  /* each 128-bit lane i: the sums of a, b, c, d over their own lane i */
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
}

static inline void add_sums_4x4(const __m512 *v, float *y, long ldy, int mb) {
  __m512 u0 = lane_sums_of_4(v[0], v[1], v[2], v[3]), u1 = lane_sums_of_4(v[4], v[5], v[6], v[7]);
  __m512 u2 = lane_sums_of_4(v[8], v[9], v[10], v[11]), u3 = lane_sums_of_4(v[12], v[13], v[14], v[15]);
  __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
  float out[16];
  _mm512_storeu_ps(out, sums); /* lane m holds row m of x's sums with weight rows 0-3 */
  for (int m = 0; m < mb; m++)
    for (int r = 0; r < 4; r++) y[m * ldy + r] += out[4 * m + r];
}

/* The W_ROWS (4) weight rows at w (stride K) times MB rows of x (stride K); the 16 sums are added to
   y[m * ldy + r]. The weight stream's prefetches stand at *ahead and move `lines` cache lines on per
   16 columns. */
#define GROUP(MB)                                                                                        \
  static inline __attribute__((always_inline)) void group_##MB(const float *w, const float *x, int K,    \
                                                               float *y, long ldy, const char **ahead,   \
                                                               int lines) {                              \
    __m512 acc[4][MB];                                                                                   \
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                                                  \
      _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();              \
    const char *p = *ahead;                                                                              \
    int k = 0;                                                                                           \
    for (; k + 16 <= K; k += 16, p += 64 * lines) {                                                      \
      _mm_prefetch(p, _MM_HINT_T0);                                                                      \
      if (lines > 1) _mm_prefetch(p + 64, _MM_HINT_T0);                                                  \
      if (lines > 2) _mm_prefetch(p + 128, _MM_HINT_T0), _mm_prefetch(p + 192, _MM_HINT_T0);             \
      __m512 wv[4];                                                                                      \
      _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) wv[r] = _mm512_loadu_ps(w + (long)r * K + k);  \
      _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++) {                                             \
        __m512 xv = _mm512_loadu_ps(x + (long)m * K + k);                                                \
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]); \
      }                                                                                                  \
    }                                                                                                    \
    *ahead = p;                                                                                          \
    if (k < K) { /* the last K % 16 columns */                                                           \
      __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);                                                 \
      _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++) {                                             \
        __m512 xv = _mm512_maskz_loadu_ps(tail, x + (long)m * K + k);                                    \
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                                              \
          acc[r][m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + (long)r * K + k), xv, acc[r][m]);  \
      }                                                                                                  \
    }                                                                                                    \
    __m512 v[16];                                                                                        \
    _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++)                                                  \
      _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                                                \
        v[4 * m + r] = m < MB ? acc[r][m % MB] : _mm512_setzero_ps();                                    \
    add_sums_4x4(v, y, ldy, MB);                                                                         \
  }
GROUP(1) GROUP(2) GROUP(3) GROUP(4)

/* A weight tile (W_ROWS rows at w) times all M rows of x, X_ROWS at a time. Its passes over the
   rows of x prefetch the weight stream AHEAD floats on between them, so that memory stays busy
   through every pass, not only the first. */
static void tile(const float *w, const float *x, int M, int K, float *y, long ldy) {
  int passes = (M + X_ROWS - 1) / X_ROWS, lines = (W_ROWS + passes - 1) / passes;
  const char *ahead = (const char *)(w + AHEAD);
  for (int m0 = 0; m0 < M; m0 += X_ROWS) {
    const float *xm = x + (long)m0 * K;
    float *out = y + m0 * ldy;
    switch (M - m0 < X_ROWS ? M - m0 : X_ROWS) {
      case 4: group_4(w, xm, K, out, ldy, &ahead, lines); break;
      case 3: group_3(w, xm, K, out, ldy, &ahead, lines); break;
      case 2: group_2(w, xm, K, out, ldy, &ahead, lines); break;
      default: group_1(w, xm, K, out, ldy, &ahead, lines);
    }
  }
}

/* one weight row (a matrix's last, short of a tile) times the M rows of x */
static void single_row(const float *w, const float *x, int M, int K, float *y, long ldy) {
  for (int m = 0; m < M; m++) y[m * ldy] += dot(w, x + (long)m * K, K);
}

/* y (M x width, width = sum of N) = x times the matrices, plus their biases; with `accumulate`, added
   to what y holds. Called by every thread of a parallel region: the work is shared among them. */
static void multiply(const float *x, int M, int K, int n_mats, const float *const *W, const float *const *b,
                     const int *N, float *y, int accumulate) {
  long width = 0, tiles = 0; /* y's row length; tiles of W_ROWS weight rows over all matrices */
  for (int j = 0; j < n_mats; j++) width += N[j], tiles += (N[j] + W_ROWS - 1) / W_ROWS;
#pragma omp for schedule(static)
  for (int m = 0; m < M; m++) { /* the bias (or zero) first: the tiles add to it */
    float *row = y + m * width;
    for (int j = 0; j < n_mats; row += N[j], j++)
      for (int n = 0; n < N[j]; n++) row[n] = (accumulate ? row[n] : 0.0f) + (b[j] ? b[j][n] : 0.0f);
  }
#pragma omp for schedule(static)
  for (long t = 0; t < tiles; t++) {
    int j = 0;
    long first = t, offset = 0; /* tile t is tile `first` of matrix j, whose outputs start at `offset` */
    while (first >= (N[j] + W_ROWS - 1) / W_ROWS) first -= (N[j] + W_ROWS - 1) / W_ROWS, offset += N[j], j++;
    int n = (int)(W_ROWS * first), rows = N[j] - n < W_ROWS ? N[j] - n : W_ROWS;
    const float *w = W[j] + (long)n * K;
    float *out = y + offset + n;
    if (rows == W_ROWS) tile(w, x, M, K, out, width);
    else /* a matrix's last rows, short of a tile */
      for (int r = 0; r < rows; r++) single_row(w + (long)r * K, x, M, K, out + r, width);
  }
}

void covey_decode_linear(const float *x, int M, int K, int n_mats, const float *const *W, const float *const *b,
                         const int *N, float *y, int threads) {
#pragma omp parallel num_threads(threads)
  multiply(x, M, K, n_mats, W, b, N, y, 0);
}

/* ---- a whole decode step of a Llama-family layer stack, one token per row ------------------------------ */

/* y[i] += a * x[i] */
static inline void add_scaled(float *y, float a, const float *x, int n) {
  __m512 av = _mm512_set1_ps(a);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; i++) y[i] += a * x[i];
}

/* e^x lane by lane, within 2 ulp over float's range; 0 below it (e^-inf included) */
static inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, x)); /* x - n ln 2, |r| <= ln 2 / 2 */
  __m512 p = _mm512_set1_ps(1.9875691500e-4f); /* e^r - 1 - r, as r^2 times a polynomial */
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~underflow, _mm512_scalef_ps(p, n));
}

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row */
static void rms_norm(const float *x, int M, int H, const float *weight, float eps, float *out) {
#pragma omp for schedule(static)
  for (int m = 0; m < M; m++) {
    const float *row = x + (long)m * H;
    float inverse = 1.0f / sqrtf(dot(row, row, H) / H + eps);
    for (int i = 0; i < H; i++) out[(long)m * H + i] = row[i] * inverse * weight[i];
  }
}

/* The pointers of one layer, in this order (biases may be NULL): its products as LayerStack.PRODUCTS
   lists them, each its weights then its biases; its norms; its cache. */
enum { Q, K_, V_, Q_BIAS, K_BIAS, V_BIAS, O, O_BIAS, GATE, UP, GATE_BIAS, UP_BIAS, DOWN, DOWN_BIAS, ATTN_NORM,
       MLP_NORM, KEYS, VALUES, LAYER_POINTERS };

int covey_layer_pointers(void) { return LAYER_POINTERS; }

/* x (B x H): the rows' residual stream, embeddings in, the last layer's output out. Row b's cache is row
   slots[b] of KEYS/VALUES (n x n_kv x max_length x hd): its new key and value go to position `position`
   there, and it attends to the positions up to it where attend (B x max_length) is nonzero. cos/sin
   (B x hd): the rotary embedding of each row's position. Returns 0, or -1 (and changes nothing) when its
   scratch memory cannot be had. */
int covey_decode_step(float *x, int B, int H, int n_heads, int n_kv, int hd, int I, int n_layers, float eps,
                       float scale, const float *cos, const float *sin, const unsigned char *attend,
                       const int *slots, int position, int max_length, void *const *layers, int threads) {
  int q_width = n_heads * hd, kv_width = n_kv * hd, qkv_width = q_width + 2 * kv_width, half = hd / 2;
  int per_group = n_heads / n_kv;
  float *normed = malloc(sizeof(float) * B * (H > I ? H : I));
  float *qkv = malloc(sizeof(float) * B * qkv_width);
  float *attn = malloc(sizeof(float) * B * q_width);
  float *gate_up = malloc(sizeof(float) * B * 2 * I);
  long own = position + 1 + hd; /* each thread's scratch: attention scores, a rotated head */
  float *scratch = malloc(sizeof(float) * own * threads);
  if (!normed || !qkv || !attn || !gate_up || !scratch) {
    free(normed), free(qkv), free(attn), free(gate_up), free(scratch);
    return -1;
  }
#pragma omp parallel num_threads(threads)
  {
    float *scores = scratch + own * omp_get_thread_num(), *rotated = scores + position + 1;
    for (int l = 0; l < n_layers; l++) {
      void *const *p = layers + (long)l * LAYER_POINTERS;
      const float *qkv_w[3] = {p[Q], p[K_], p[V_]}, *qkv_b[3] = {p[Q_BIAS], p[K_BIAS], p[V_BIAS]};
      const int qkv_n[3] = {q_width, kv_width, kv_width};
      float *keys = p[KEYS], *values = p[VALUES];
      rms_norm(x, B, H, p[ATTN_NORM], eps, normed);
      multiply(normed, B, H, 3, qkv_w, qkv_b, qkv_n, qkv, 0);
      /* rotary embedding of the query and key heads; the key and value into the cache */
#pragma omp for schedule(static)
      for (int bh = 0; bh < B * (n_heads + n_kv); bh++) {
        int b = bh / (n_heads + n_kv), h = bh % (n_heads + n_kv);
        float *t = qkv + (long)b * qkv_width + (long)h * hd;
        const float *c = cos + (long)b * hd, *s = sin + (long)b * hd;
        for (int d = 0; d < hd; d++) rotated[d] = t[d] * c[d] + (d < half ? -t[d + half] : t[d - half]) * s[d];
        if (h < n_heads) memcpy(t, rotated, sizeof(float) * hd);
        else {
          long at = (((long)slots[b] * n_kv + (h - n_heads)) * max_length + position) * hd;
          memcpy(keys + at, rotated, sizeof(float) * hd);
          memcpy(values + at, t + kv_width, sizeof(float) * hd);
        }
      }
      /* attention of each query head over its row's cache */
#pragma omp for schedule(static)
      for (int bh = 0; bh < B * n_heads; bh++) {
        int b = bh / n_heads, h = bh % n_heads, g = h / per_group;
        const float *q = qkv + (long)b * qkv_width + (long)h * hd;
        long cache = ((long)slots[b] * n_kv + g) * max_length * hd;
        const float *k = keys + cache, *v = values + cache;
        const unsigned char *seen = attend + (long)b * max_length;
        float top = -INFINITY;
        for (int t = 0; t <= position; t++) {
          scores[t] = seen[t] ? dot(q, k + (long)t * hd, hd) * scale : -INFINITY;
          if (scores[t] > top) top = scores[t];
        }
        __m512 sum = _mm512_setzero_ps();
        int t = 0;
        for (; t + 16 <= position + 1; t += 16) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t), _mm512_set1_ps(top)));
          _mm512_storeu_ps(scores + t, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (t <= position) {
          __mmask16 tail = (__mmask16)((1u << (position + 1 - t)) - 1);
          __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + t), _mm512_set1_ps(top)));
          e = _mm512_maskz_mov_ps(tail, e);
          _mm512_mask_storeu_ps(scores + t, tail, e);
          sum = _mm512_add_ps(sum, e);
        }
        float total = _mm512_reduce_add_ps(sum);
        float *out = attn + (long)b * q_width + (long)h * hd;
        for (int d = 0; d < hd; d++) out[d] = 0.0f;
        for (int t = 0; t <= position; t++)
          if (seen[t]) add_scaled(out, scores[t], v + (long)t * hd, hd);
        for (int d = 0; d < hd; d++) out[d] /= total;
      }
      const float *o_w[1] = {p[O]}, *o_b[1] = {p[O_BIAS]};
      multiply(attn, B, q_width, 1, o_w, o_b, &H, x, 1);
      rms_norm(x, B, H, p[MLP_NORM], eps, normed);
      const float *gu_w[2] = {p[GATE], p[UP]}, *gu_b[2] = {p[GATE_BIAS], p[UP_BIAS]};
      const int gu_n[2] = {I, I};
      multiply(normed, B, H, 2, gu_w, gu_b, gu_n, gate_up, 0);
#pragma omp for schedule(static)
      for (int m = 0; m < B; m++) { /* silu(gate) * up */
        const float *gate = gate_up + (long)m * 2 * I, *up = gate + I;
        float *out = normed + (long)m * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
          __m512 g = _mm512_loadu_ps(gate + i);
          __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
          _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
        for (; i < I; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
      }
      const float *down_w[1] = {p[DOWN]}, *down_b[1] = {p[DOWN_BIAS]};
      multiply(normed, B, I, 1, down_w, down_b, &H, x, 1);
    }
  }
  free(normed), free(qkv), free(attn), free(gate_up), free(scratch);
  return 0;
}
