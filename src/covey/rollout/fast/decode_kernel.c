/* covey's decode kernel (AVX-512; bfloat16 weights through AMX tiles), loaded by covey/decode_kernel.py,
   which builds it with -march=native for the CPU it runs on.

   covey_decode_linear: a few rows of activations x (M x K) times a list of weight matrices W_j (N_j x K,
   row-major, as a model holds them), outputs side by side:
       y[m, off_j + n] = sum_k x[m, k] W_j[n, k] (+ b_j[n])
   With so few rows, a product is bound by streaming the weights from memory. Each thread streams its
   share of the weight rows once, prefetching far ahead of the rows it multiplies (what general matrix
   libraries do not do for so few rows), and multiplies 4 weight rows by up to 4 rows of x at a time in
   registers; with more rows of x, a tile of weight rows makes several passes, and the prefetches are
   spread over them. Every output is summed in the same order whatever the number of threads.
   bfloat16 weights (where the CPU has AMX) multiply x rounded to bfloat16, 16 weight rows by 16 rows of x
   per tile product, sums in float32: the products then cost next to nothing beside the stream.

   covey_decode_step: one token per row through a whole Llama-family layer stack (norms, products,
   rotary embedding, cache writes, attention, MLP) in one parallel region.

   covey_tile_bf16: a float32 matrix rounded to bfloat16 and laid out in the tiles, in one pass. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W_ROWS 4   /* weight rows per tile */
#define X_ROWS 4   /* rows of x per pass of a tile, at most */
#define AHEAD 2048 /* floats of the weight stream prefetched ahead of the rows multiplied */

/* the first n lanes (all for n >= 16) */
static inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* sum of a[i] * b[i] */
static inline float dot(const float *a, const float *b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    __mmask16 tail = first_lanes(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

/* each 128-bit lane i: the sums of a, b, c, d over their own lane i */
static inline __m512 lane_sums_of_4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
}

/* lane i: the sum of v[i]'s lanes, for i < 16, in one tree of shuffles and adds */
static inline __m512 sums_of_16(const __m512 *v) {
  __m512 u0 = lane_sums_of_4(v[0], v[1], v[2], v[3]), u1 = lane_sums_of_4(v[4], v[5], v[6], v[7]);
  __m512 u2 = lane_sums_of_4(v[8], v[9], v[10], v[11]), u3 = lane_sums_of_4(v[12], v[13], v[14], v[15]);
  __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Adds the sums of v[4m + r] (r, m < 4) to y[m * ldy + r] for m < mb, each row of x's four sums stored together. */
static inline void add_sums_4x4(const __m512 *v, float *y, long ldy, int mb) {
  float out[16];
  _mm512_storeu_ps(out, sums_of_16(v)); /* lane 4m + r holds row m of x's sum with weight row r */
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
      __mmask16 tail = first_lanes(K - k);                                                               \
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

/* ---- bfloat16 weights, through AMX tiles ----------------------------------------------------------- */

/* A bfloat16 matrix (N x K) comes laid out in tiles (decode_kernel.py's `tile_bf16`): per 16 rows, per 32
   columns, a 1 KB block holding, for each of its 16 pairs of columns, the pair of each of its 16 rows (the
   layout of a tile product's second operand), zero-padded to whole blocks, so that the stream is one run of
   memory in the order it is multiplied. Each tile product: A, the same 32 columns of 16 rows of x, rounded to
   bfloat16 (`pack_x`, once per product, row by row); B, such a block; C, the 16 x 16 float32 sums, laid out
   as y is (a row of x's outputs per row). */
#define T_ROWS 16                           /* weight rows, and rows of x, per tile */
#define CHUNK 32                            /* columns per tile */
#define TILE_BYTES (T_ROWS * CHUNK * 2)     /* of a weight tile (1 KB) */
#define AHEAD_BYTES 8192                    /* of the weight stream, prefetched ahead of the tile multiplied */

static inline int chunks_of(int K) { return (K + CHUNK - 1) / CHUNK; } /* tiles across K columns */
static inline int blocks_of(int M) { return (M + T_ROWS - 1) / T_ROWS; } /* tiles down M rows */

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

/* Asks Linux for the AMX tile state, which a process needs before its first tile instruction. 0 if granted. */
int covey_amx_ready(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* tile data */) == 0 ? 0 : -1; }

/* tiles 0 (A), 1 and 2 (B), 3 and 4 (C): 16 rows of 64 bytes each */
AMX static void configure_tiles(void) {
  struct { uint8_t palette, start_row, reserved[14]; uint16_t bytes[16]; uint8_t rows[16]; } config = {0};
  config.palette = 1;
  for (int t = 0; t < 5; t++) config.bytes[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

AMX static void release_tiles(void) { _tile_release(); }

/* columns k..k + 31 of row m of x (M x K) rounded to bfloat16 (round to nearest even), as 16 pairs; zero past
   M and K */
AMX static inline __m512bh rounded_pairs(const float *x, int M, int K, int m, int k) {
  int left = m < M ? K - k : 0;
  const float *row = x + (long)(m < M ? m : 0) * K + k;
  return _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(first_lanes(left - 16), row + 16), _mm512_maskz_loadu_ps(first_lanes(left), row));
}

/* w (N x K, float32) rounded to bfloat16 into `tiles`, laid out as decode_kernel.py's `tile_bf16` lays them
   out (the tile products' second operand): per block of 16 rows and 32 columns, each pair of columns of its
   16 rows; zero past N and K. */
AMX int covey_tile_bf16(const float *w, int N, int K, uint32_t *tiles, int threads) {
  int chunks = chunks_of(K);
  __m512i pair_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(T_ROWS));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long t = 0; t < (long)blocks_of(N) * chunks; t++) /* a thread fills whole tiles */
    for (int r = 0; r < T_ROWS; r++)
      _mm512_i32scatter_epi32(tiles + t * (T_ROWS * CHUNK / 2) + r, pair_offsets,
                              (__m512i)rounded_pairs(w, N, K, (int)(t / chunks) * T_ROWS + r, (int)(t % chunks) * CHUNK), 4);
  return 0;
}

/* x (M x K) rounded to bfloat16 into `packed`, row by row (rows of chunks_of(K) * 64 bytes, whole cache
   lines: no line is written by two threads), rows past M up to a whole tile and columns past K zero. */
AMX static void pack_x(const float *x, int M, int K, uint16_t *packed) {
  int chunks = chunks_of(K);
#pragma omp for schedule(static)
  for (int m = 0; m < blocks_of(M) * T_ROWS; m++)
    for (int c = 0; c < chunks; c++) {
      int k = c * CHUNK;
      _mm512_store_si512(packed + ((long)m * chunks + c) * CHUNK, (__m512i)rounded_pairs(x, M, K, m, k));
    }
}

/* The tiles of `rows` (at most 16) weight rows at w, times the M rows of x packed; the sums added to
   y[m * ldy + r] (stored there, given `store`). Prefetches the stream AHEAD_BYTES on. */
AMX static void tile_bf16(const uint16_t *w, int rows, const uint16_t *packed, int M, int K, float *y, long ldy,
                          int store) {
  int chunks = chunks_of(K), blocks = blocks_of(M), stride = chunks * CHUNK * 2; /* bytes of a row of x packed */
  long block = (long)T_ROWS * chunks * CHUNK; /* bfloat16 of a block of x packed */
  const char *ahead = (const char *)w + AHEAD_BYTES;
  __mmask16 outputs = first_lanes(rows);
  float sums[T_ROWS * T_ROWS];
  for (int b = 0; b < blocks; b += 2) { /* two blocks of 16 rows of x at a time */
    const uint16_t *first = packed + b * block, *second = first + block;
    _tile_zero(3);
    _tile_zero(4);
    for (int c = 0; c < chunks; c++) {
      if (b == 0)
        for (int line = 0; line < TILE_BYTES; line += 64) _mm_prefetch(ahead + (long)c * TILE_BYTES + line, _MM_HINT_T0);
      _tile_loadd(2, w + (long)c * T_ROWS * CHUNK, 64);
      _tile_loadd(0, first + c * CHUNK, stride);
      _tile_dpbf16ps(3, 0, 2);
      if (b + 1 < blocks) {
        _tile_loadd(1, second + c * CHUNK, stride);
        _tile_dpbf16ps(4, 1, 2);
      }
    }
    for (int half = 0; half < 2 && b + half < blocks; half++) {
      if (half == 0) _tile_stored(3, sums, 64);
      else _tile_stored(4, sums, 64);
      int m0 = (b + half) * T_ROWS, mb = M - m0 < T_ROWS ? M - m0 : T_ROWS;
      for (int m = 0; m < mb; m++) {
        float *out = y + (m0 + m) * ldy;
        __m512 before = store ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(outputs, out);
        _mm512_mask_storeu_ps(out, outputs, _mm512_add_ps(before, _mm512_loadu_ps(sums + m * T_ROWS)));
      }
    }
  }
}
#else
int covey_amx_ready(void) { return -1; }
#endif

/* room for M rows of K columns of x packed for the tile products, aligned to cache lines */
static uint16_t *alloc_packed_x(int M, int K) {
  return aligned_alloc(64, sizeof(uint16_t) * blocks_of(M) * T_ROWS * chunks_of(K) * CHUNK);
}

/* y (M x width, width = sum of N) = x times the matrices, plus their biases; with `accumulate`, added
   to what y holds. The matrices are float32, or bfloat16 in tiles given `packed_x` (room for x packed;
   the biases float32 either way). Called by every thread of a parallel region: the work is shared among
   them. */
static void multiply(const float *x, int M, int K, int n_mats, const void *const *W, const float *const *b,
                     const int *N, float *y, int accumulate, uint16_t *packed_x) {
  int per_tile = packed_x ? T_ROWS : W_ROWS;
  long width = 0, tiles = 0; /* y's row length; tiles of weight rows over all matrices */
  int biased = 0;
  for (int j = 0; j < n_mats; j++) width += N[j], tiles += (N[j] + per_tile - 1) / per_tile, biased |= b[j] != NULL;
  /* bfloat16 tiles store whole sums: with no bias and nothing to add to, they are y as they come */
  int store = packed_x && !accumulate && !biased;
  if (biased || (!accumulate && !store)) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) { /* the bias (or zero) first: the tiles add to it */
      float *row = y + m * width;
      for (int j = 0; j < n_mats; row += N[j], j++)
        for (int n = 0; n < N[j]; n++) row[n] = (accumulate ? row[n] : 0.0f) + (b[j] ? b[j][n] : 0.0f);
    }
  }
#ifdef AMX
  if (packed_x) pack_x(x, M, K, packed_x), configure_tiles();
#endif
#pragma omp for schedule(static)
  for (long t = 0; t < tiles; t++) {
    int j = 0;
    long first = t, offset = 0; /* tile t is tile `first` of matrix j, whose outputs start at `offset` */
    while (first >= (N[j] + per_tile - 1) / per_tile) first -= (N[j] + per_tile - 1) / per_tile, offset += N[j], j++;
    int n = (int)(per_tile * first), rows = N[j] - n < per_tile ? N[j] - n : per_tile;
    float *out = y + offset + n;
#ifdef AMX
    if (packed_x) {
      const uint16_t *w = (const uint16_t *)W[j] + first * chunks_of(K) * T_ROWS * CHUNK;
      tile_bf16(w, rows, packed_x, M, K, out, width, store);
      continue;
    }
#endif
    const float *w = (const float *)W[j] + (long)n * K;
    if (rows == W_ROWS) tile(w, x, M, K, out, width);
    else /* a matrix's last rows, short of a tile */
      for (int r = 0; r < rows; r++) single_row(w + (long)r * K, x, M, K, out + r, width);
  }
#ifdef AMX
  if (packed_x) release_tiles();
#endif
}

/* The matrices float32, or bfloat16 in tiles given `bf16`. Returns 0, or -1 (and computes nothing) when the
   room for x packed cannot be had. */
int covey_decode_linear(const float *x, int M, int K, int n_mats, const void *const *W, const float *const *b,
                        const int *N, float *y, int bf16, int threads) {
  uint16_t *packed_x = bf16 ? alloc_packed_x(M, K) : NULL;
  if (bf16 && !packed_x) return -1;
#pragma omp parallel num_threads(threads)
  multiply(x, M, K, n_mats, W, b, N, y, 0, packed_x);
  free(packed_x);
  return 0;
}

/* ---- a whole decode step of a Llama-family layer stack, one token per row ------------------------------ */

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

/* scores[t] = e^(scores[t] - their largest) for t < n, in place; returns their sum */
static float softmax_unnormalised(float *scores, int n) {
  __m512 tops = _mm512_set1_ps(-INFINITY); /* 16 lanes at a time: a scalar running maximum waits on each step */
  for (int t = 0; t < n; t += 16) tops = _mm512_max_ps(tops, _mm512_mask_loadu_ps(tops, first_lanes(n - t), scores + t));
  float top = _mm512_reduce_max_ps(tops);
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < n; t += 16) {
    __mmask16 lanes = first_lanes(n - t);
    __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + t), _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(scores + t, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

/* A row's keys (or values) of one key-value head, hd per position: positions below `until` in the cache of
   its prompt (`shared`: the rows of its group share it), the others in its own. */
struct rows_of_head { const float *shared, *own; int until; };

static inline const float *at(struct rows_of_head r, int t, int hd) { return (t < r.until ? r.shared : r.own) + (long)t * hd; }

/* asks for positions 0..n - 1 of r from memory, into L1 (else L2) */
static inline void prefetch_rows(struct rows_of_head r, int n, int hd, int into_l1) {
  for (int t = 0; t < n; t++)
    for (int line = 0; line < hd * (int)sizeof(float); line += 64)
      if (into_l1) _mm_prefetch((const char *)at(r, t, hd) + line, _MM_HINT_T0);
      else _mm_prefetch((const char *)at(r, t, hd) + line, _MM_HINT_T1);
}

/* The `heads` query heads at q (hd each, side by side) of one row attend over the keys k and values v of their
   key-value head at positions 0..position where seen[t]; the heads' outputs to out. The row's keys and values
   are read once for all its heads, and requested from memory before they are needed (the weight stream has
   pushed them out of the caches since the last step). Scores 16 positions at a time; each head's output summed
   in registers. scores: room for heads * (position + 1). */
static inline __attribute__((always_inline)) void attend_group(const float *q, int heads, struct rows_of_head k,
                                                               struct rows_of_head v, const unsigned char *seen,
                                                               int position, int hd, float scale, float *scores,
                                                               float *out) {
  int n = position + 1, slices = (hd + 15) / 16; /* of 16 lanes across a head */
  prefetch_rows(k, n, hd, 1);
  prefetch_rows(v, n, hd, 0);
  for (int t = 0; t < n; t += 16) {
    __mmask16 here = first_lanes(n - t), visible = _mm_test_epi8_mask(_mm_maskz_loadu_epi8(here, seen + t), _mm_set1_epi8(-1));
    for (int j = 0; j < heads; j++) {
      __m512 products[16]; /* lane by lane, of q and the keys at positions t to t + 15 */
      for (int u = 0; u < 16; u++) {
        products[u] = _mm512_setzero_ps();
        for (int s = 0; s < slices && t + u < n; s++) {
          __mmask16 lanes = first_lanes(hd - 16 * s);
          products[u] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, q + (long)j * hd + 16 * s),
                                        _mm512_maskz_loadu_ps(lanes, at(k, t + u, hd) + 16 * s), products[u]);
        }
      }
      __m512 dots = _mm512_mul_ps(sums_of_16(products), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + (long)j * n + t, here, _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), dots));
    }
  }
  for (int j = 0; j < heads; j++) {
    float *s = scores + (long)j * n, total = softmax_unnormalised(s, n); /* 0 where not seen */
    for (int d0 = 0; d0 < hd; d0 += 16 * 8) { /* 8 slices of the head at a time, in registers */
      __m512 sums[8];
      int width = hd - d0 < 16 * 8 ? (hd - d0 + 15) / 16 : 8;
      for (int i = 0; i < width; i++) sums[i] = _mm512_setzero_ps();
      for (int t = 0; t < n; t++) {
        __m512 weight = _mm512_set1_ps(s[t]);
        for (int i = 0; i < width; i++)
          sums[i] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(first_lanes(hd - d0 - 16 * i), at(v, t, hd) + d0 + 16 * i), sums[i]);
      }
      for (int i = 0; i < width; i++)
        _mm512_mask_storeu_ps(out + (long)j * hd + d0 + 16 * i, first_lanes(hd - d0 - 16 * i),
                              _mm512_div_ps(sums[i], _mm512_set1_ps(total)));
    }
  }
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
   there, and it attends to the positions up to it where attend (B x max_length) is nonzero; positions below
   prefix_length (its prompt's, shared with the other rows of its group) it reads from row prefix_slots[b]. cos/sin
   (B x hd): the rotary embedding of each row's position. The products' matrices are float32, or bfloat16
   in tiles given `bf16`; everything else is float32. Returns 0, or -1 (and changes nothing) when its scratch memory
   cannot be had. */
int covey_decode_step(float *x, int B, int H, int n_heads, int n_kv, int hd, int I, int n_layers, float eps,
                       float scale, const float *cos, const float *sin, const unsigned char *attend,
                       const int *slots, const int *prefix_slots, int prefix_length, int position, int max_length,
                       void *const *layers, int bf16, int threads) {
  int q_width = n_heads * hd, kv_width = n_kv * hd, qkv_width = q_width + 2 * kv_width, half = hd / 2;
  int per_group = n_heads / n_kv;
  float *normed = malloc(sizeof(float) * B * (H > I ? H : I));
  float *qkv = malloc(sizeof(float) * B * qkv_width);
  float *attn = malloc(sizeof(float) * B * q_width);
  float *gate_up = malloc(sizeof(float) * B * 2 * I);
  long per_thread = (long)per_group * (position + 1) + hd; /* each thread's scratch: a group's attention scores, a rotated head */
  float *scratch = malloc(sizeof(float) * per_thread * threads);
  int widest = H > I ? H : I; /* the products' longest rows of x */
  uint16_t *x16 = bf16 ? alloc_packed_x(B, widest > q_width ? widest : q_width) : NULL;
  if (!normed || !qkv || !attn || !gate_up || !scratch || (bf16 && !x16)) {
    free(normed), free(qkv), free(attn), free(gate_up), free(scratch), free(x16);
    return -1;
  }
#pragma omp parallel num_threads(threads)
  {
    float *scores = scratch + per_thread * omp_get_thread_num(), *rotated = scores + (long)per_group * (position + 1);
    for (int l = 0; l < n_layers; l++) {
      void *const *p = layers + (long)l * LAYER_POINTERS;
      const void *qkv_w[3] = {p[Q], p[K_], p[V_]};
      const float *qkv_b[3] = {p[Q_BIAS], p[K_BIAS], p[V_BIAS]};
      const int qkv_n[3] = {q_width, kv_width, kv_width};
      float *keys = p[KEYS], *values = p[VALUES];
      rms_norm(x, B, H, p[ATTN_NORM], eps, normed);
      multiply(normed, B, H, 3, qkv_w, qkv_b, qkv_n, qkv, 0, x16);
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
      /* attention of each group of query heads over its row's cache (of their key-value head) */
#pragma omp for schedule(static)
      for (int bg = 0; bg < B * n_kv; bg++) {
        int b = bg / n_kv, g = bg % n_kv;
        long own = ((long)slots[b] * n_kv + g) * max_length * hd;
        long shared = ((long)(prefix_length ? prefix_slots[b] : slots[b]) * n_kv + g) * max_length * hd;
        struct rows_of_head k = {keys + shared, keys + own, prefix_length}, v = {values + shared, values + own, prefix_length};
        const float *q = qkv + (long)b * qkv_width + (long)g * per_group * hd;
        float *out = attn + (long)b * q_width + (long)g * per_group * hd;
        const unsigned char *seen = attend + (long)b * max_length;
        switch (hd) { /* the common head sizes compiled for their own */
          case 64: attend_group(q, per_group, k, v, seen, position, 64, scale, scores, out); break;
          case 128: attend_group(q, per_group, k, v, seen, position, 128, scale, scores, out); break;
          default: attend_group(q, per_group, k, v, seen, position, hd, scale, scores, out);
        }
      }
      const void *o_w[1] = {p[O]};
      const float *o_b[1] = {p[O_BIAS]};
      multiply(attn, B, q_width, 1, o_w, o_b, &H, x, 1, x16);
      rms_norm(x, B, H, p[MLP_NORM], eps, normed);
      const void *gu_w[2] = {p[GATE], p[UP]};
      const float *gu_b[2] = {p[GATE_BIAS], p[UP_BIAS]};
      const int gu_n[2] = {I, I};
      multiply(normed, B, H, 2, gu_w, gu_b, gu_n, gate_up, 0, x16);
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
      const void *down_w[1] = {p[DOWN]};
      const float *down_b[1] = {p[DOWN_BIAS]};
      multiply(normed, B, I, 1, down_w, down_b, &H, x, 1, x16);
    }
  }
  free(normed), free(qkv), free(attn), free(gate_up), free(scratch), free(x16);
  return 0;
}
