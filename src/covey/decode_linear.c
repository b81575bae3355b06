/* The matrix products of a decode step: a few rows of activations x (M x K) times a list of float32
   weight matrices W_j (N_j x K, row-major, as a model holds them), outputs side by side:
       y[m, off_j + n] = sum_k x[m, k] W_j[n, k] (+ b_j[n])
   With so few rows, a product is bound by streaming the weights from memory. Each thread streams its
   share of the weight rows once, prefetching far ahead of the rows it multiplies (what general
   matrix libraries do not do for so few rows), and multiplies 4 weight rows by up to 4 rows of x at a
   time in registers. Built with -march=native by covey/decode_kernel.py; needs AVX-512F. */
#include <immintrin.h>

#define W_ROWS 4   /* weight rows per tile */
#define X_ROWS 4   /* rows of x per tile, at most */
#define AHEAD 2048 /* floats of the weight stream prefetched ahead of the tile */

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

/* R weight rows (w, stride K) times MB rows of x (stride K); the sums are added to y[m * ldy + r] */
#define TILE(R, MB)                                                                                     \
  static void tile_##R##_##MB(const float *w, const float *x, int K, float *y, long ldy) {              \
    __m512 acc[R][MB];                                                                                  \
    for (int r = 0; r < R; r++)                                                                         \
      for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();                                     \
    int k = 0;                                                                                          \
    for (; k + 16 <= K; k += 16) {                                                                      \
      /* the tile's rows are contiguous: R cache lines per step, AHEAD floats on */                     \
      for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + AHEAD + R * k + 16 * r), _MM_HINT_T0); \
      __m512 wv[R];                                                                                     \
      for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + (long)r * K + k);                          \
      for (int m = 0; m < MB; m++) {                                                                    \
        __m512 xv = _mm512_loadu_ps(x + (long)m * K + k);                                               \
        for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);                  \
      }                                                                                                 \
    }                                                                                                   \
    if (k < K) { /* the last K % 16 columns */                                                          \
      __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);                                                \
      for (int m = 0; m < MB; m++) {                                                                    \
        __m512 xv = _mm512_maskz_loadu_ps(tail, x + (long)m * K + k);                                   \
        for (int r = 0; r < R; r++)                                                                     \
          acc[r][m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + (long)r * K + k), xv, acc[r][m]); \
      }                                                                                                 \
    }                                                                                                   \
    if (R == 4) {                                                                                       \
      __m512 v[16];                                                                                     \
      for (int m = 0; m < 4; m++)                                                                       \
        for (int r = 0; r < 4; r++) v[4 * m + r] = m < MB ? acc[r % R][m % MB] : _mm512_setzero_ps();   \
      add_sums_4x4(v, y, ldy, MB);                                                                      \
    } else                                                                                              \
      for (int m = 0; m < MB; m++)                                                                      \
        for (int r = 0; r < R; r++) y[m * ldy + r] += _mm512_reduce_add_ps(acc[r][m]);                  \
  }
TILE(4, 1) TILE(4, 2) TILE(4, 3) TILE(4, 4) /* W_ROWS = 4 */
TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)

typedef void (*tile_fn)(const float *, const float *, int, float *, long);
static const tile_fn full_tiles[X_ROWS + 1] = {0, tile_4_1, tile_4_2, tile_4_3, tile_4_4};
static const tile_fn single_row_tiles[X_ROWS + 1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};

void covey_decode_linear(const float *x, int M, int K, int n_mats, const float *const *W, const float *const *b,
                         const int *N, float *y, int threads) {
  long width = 0, tiles = 0; /* y's row length; tiles of W_ROWS weight rows over all matrices */
  for (int j = 0; j < n_mats; j++) width += N[j], tiles += (N[j] + W_ROWS - 1) / W_ROWS;
  for (int m = 0; m < M; m++) { /* the bias (or zero) first: the tiles add to it */
    float *row = y + m * width;
    for (int j = 0; j < n_mats; row += N[j], j++)
      for (int n = 0; n < N[j]; n++) row[n] = b[j] ? b[j][n] : 0.0f;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long t = 0; t < tiles; t++) {
    int j = 0;
    long first = t, offset = 0; /* tile t is tile `first` of matrix j, whose outputs start at `offset` */
    while (first >= (N[j] + W_ROWS - 1) / W_ROWS) first -= (N[j] + W_ROWS - 1) / W_ROWS, offset += N[j], j++;
    int n = (int)(W_ROWS * first), rows = N[j] - n < W_ROWS ? N[j] - n : W_ROWS;
    const float *w = W[j] + (long)n * K;
    for (int m0 = 0; m0 < M; m0 += X_ROWS) {
      int mb = M - m0 < X_ROWS ? M - m0 : X_ROWS;
      float *out = y + m0 * width + offset + n;
      if (rows == W_ROWS) full_tiles[mb](w, x + (long)m0 * K, K, out, width);
      else /* a matrix's last rows, short of a tile */
        for (int r = 0; r < rows; r++) single_row_tiles[mb](w + (long)r * K, x + (long)m0 * K, K, out + r, width);
    }
  }
}
