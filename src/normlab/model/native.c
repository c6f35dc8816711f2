/* normlab's native CPU kernels, behind normlab.model.native (see its docstring for why):
 * LayerNorm / RMSNorm over the last dim of a contiguous float32 [N, D] tensor, forward and
 * backward (y written and gy read through row strides: `rowmap`); RoPE's rotation; the
 * attention of one query a row; and the GELU of a training step with its derivative (the last
 * three further down this file).
 *
 * Norms. ATen's CPU kernel reduces one row at a time, so on QKV-Norm's 16-float rows it is
 * bound by each row's chain of adds (~22 ns a row). Here, with AVX2, eight rows are reduced at
 * once (a tree of horizontal adds puts the eight row sums in one register); other widths and
 * CPUs take a plain per-row loop. Rows are split over `nthreads` OpenMP threads.
 *
 * y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(mean((x - mean)^2) + eps); `center` = 0 gives
 * RMSNorm (mean = 0). `b` may be NULL. mean and rstd ([N]) are saved for the backward:
 * gx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)), gw = sum g*xhat, gb = sum g.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Where row n of a logical [N, D] sits in a strided tensor: rows in (b, t, h) order, T and H the
 * inner two counts, at b * sb + t * st + h * sh floats (d contiguous), so y can be written, or
 * gy read, in QKV-Norm's head-major layout without a copy. Contiguous rows: T = H = 1, sb = D.
 * Walked one row at a time with adds; a thread divides only where it starts. */
typedef struct {
  int64_t T, H, sb, st, sh;
} rowmap;
typedef struct {
  rowmap m;
  int64_t b, t, h;
} rowwalk;

static inline rowwalk walk_at(rowmap m, int64_t n) {
  rowwalk w = {m, 0, 0, 0};
  w.h = n % m.H;
  n /= m.H;
  w.t = n % m.T;
  w.b = n / m.T;
  return w;
}

/* the current row's offset; then steps to the next row */
static inline int64_t walk_next(rowwalk *w) {
  const int64_t o = w->b * w->m.sb + w->t * w->m.st + w->h * w->m.sh;
  if (++w->h == w->m.H) {
    w->h = 0;
    if (++w->t == w->m.T) {
      w->t = 0;
      ++w->b;
    }
  }
  return o;
}

/* rows [s, e), one at a time: any width; y's rows where `wy` walks */
static inline void fwd_rows(const float *x, const float *w, const float *b, float *y,
                            float *mean, float *rstd, int64_t s, int64_t e, int64_t D,
                            int center, float eps, rowwalk *wy, const int strided) {
  for (int64_t i = s; i < e; ++i) {
    const float *r = x + i * D;
    float *o = y + (strided ? walk_next(wy) : i * D);
    float m = 0.f, v = 0.f;
    if (center) {
      for (int64_t j = 0; j < D; ++j) m += r[j];
      m /= (float)D;
    }
    for (int64_t j = 0; j < D; ++j) v += (r[j] - m) * (r[j] - m);
    float rs = 1.f / sqrtf(v / (float)D + eps);
    for (int64_t j = 0; j < D; ++j) o[j] = (r[j] - m) * rs * w[j] + (b ? b[j] : 0.f);
    mean[i] = m;
    rstd[i] = rs;
  }
}

/* gy's rows where `wg` walks */
static inline void bwd_rows(const float *gy, const float *x, const float *w, const float *mean,
                            const float *rstd, float *gx, float *gw, float *gb, int64_t s,
                            int64_t e, int64_t D, int center, rowwalk *wg, const int strided) {
  for (int64_t i = s; i < e; ++i) {
    const float *g = gy + (strided ? walk_next(wg) : i * D), *r = x + i * D;
    float *o = gx + i * D;
    float m = mean[i], rs = rstd[i], a = 0.f, c = 0.f;
    for (int64_t j = 0; j < D; ++j) {
      float xh = (r[j] - m) * rs, gh = g[j] * w[j];
      a += gh;
      c += gh * xh;
      gw[j] += g[j] * xh;
      gb[j] += g[j];
    }
    a = center ? a / (float)D : 0.f;
    c /= (float)D;
    for (int64_t j = 0; j < D; ++j) o[j] = rs * (g[j] * w[j] - a - (r[j] - m) * rs * c);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOAD _mm256_loadu_ps
#define BCAST _mm256_broadcast_ss

/* lane q of the result = the sum of the 8 lanes of v[q] */
static inline __m256 hsum8(const __m256 *v) {
  __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                       _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* rows of D = 8K floats, eight at a time; returns the first row left for fwd_rows */
static inline int64_t fwd_rows8(const float *x, const float *w, const float *b, float *y,
                                float *mean, float *rstd, int64_t s, int64_t e, int64_t K,
                                int center, float eps, rowwalk *wy, const int strided) {
  const int64_t D = 8 * K;
  const __m256 inv_d = _mm256_set1_ps(1.f / (float)D), veps = _mm256_set1_ps(eps);
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    const float *r = x + i * D;
    __m256 acc[8], mv = _mm256_setzero_ps();
    if (center) {
      for (int q = 0; q < 8; ++q) {
        __m256 t = LOAD(r + q * D);
        for (int64_t k = 1; k < K; ++k) t = _mm256_add_ps(t, LOAD(r + q * D + 8 * k));
        acc[q] = t;
      }
      mv = _mm256_mul_ps(hsum8(acc), inv_d);
    }
    _mm256_storeu_ps(mean + i, mv);
    for (int q = 0; q < 8; ++q) {
      __m256 m = BCAST(mean + i + q), t = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        __m256 c = _mm256_sub_ps(LOAD(r + q * D + 8 * k), m);
        t = _mm256_fmadd_ps(c, c, t);
      }
      acc[q] = t;
    }
    __m256 rs = _mm256_div_ps(_mm256_set1_ps(1.f),
                              _mm256_sqrt_ps(_mm256_fmadd_ps(hsum8(acc), inv_d, veps)));
    _mm256_storeu_ps(rstd + i, rs);
    for (int q = 0; q < 8; ++q) {
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      float *yq = y + (strided ? walk_next(wy) : (i + q) * D);
      for (int64_t k = 0; k < K; ++k) {
        __m256 xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + q * D + 8 * k), m), a);
        __m256 o = b ? _mm256_fmadd_ps(xh, LOAD(w + 8 * k), LOAD(b + 8 * k))
                     : _mm256_mul_ps(xh, LOAD(w + 8 * k));
        _mm256_storeu_ps(yq + 8 * k, o);
      }
    }
  }
  return i;
}

static inline int64_t bwd_rows8(const float *gy, const float *x, const float *w,
                                const float *mean, const float *rstd, float *gx, float *gw,
                                float *gb, int64_t s, int64_t e, int64_t K, int center,
                                rowwalk *wg, const int strided) {
  const int64_t D = 8 * K;
  const __m256 inv_d = _mm256_set1_ps(1.f / (float)D);
  /* gw, gb partial sums stay in registers over all rows (K is 2 or 8 in the inlined copies) */
  __m256 aw[32], ab[32];
  for (int64_t k = 0; k < K; ++k) {
    aw[k] = LOAD(gw + 8 * k);
    ab[k] = LOAD(gb + 8 * k);
  }
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    __m256 sa[8], sc[8];
    const float *gq[8];
    for (int q = 0; q < 8; ++q) gq[q] = gy + (strided ? walk_next(wg) : (i + q) * D);
    for (int q = 0; q < 8; ++q) {
      const float *g = gq[q], *r = x + (i + q) * D;
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      __m256 ta = _mm256_setzero_ps(), tc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        __m256 gv = LOAD(g + 8 * k), xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + 8 * k), m), a);
        __m256 gh = _mm256_mul_ps(gv, LOAD(w + 8 * k));
        ta = _mm256_add_ps(ta, gh);
        tc = _mm256_fmadd_ps(gh, xh, tc);
        aw[k] = _mm256_fmadd_ps(gv, xh, aw[k]);
        ab[k] = _mm256_add_ps(gv, ab[k]);
      }
      sa[q] = ta;
      sc[q] = tc;
    }
    float av[8], cv[8];
    _mm256_storeu_ps(av, center ? _mm256_mul_ps(hsum8(sa), inv_d) : _mm256_setzero_ps());
    _mm256_storeu_ps(cv, _mm256_mul_ps(hsum8(sc), inv_d));
    /* gx may be gy's own buffer: each float of g is read before its gx is written */
    for (int q = 0; q < 8; ++q) {
      const float *g = gq[q], *r = x + (i + q) * D;
      __m256 m = BCAST(mean + i + q), a = BCAST(rstd + i + q);
      __m256 A = BCAST(av + q), C = BCAST(cv + q);
      for (int64_t k = 0; k < K; ++k) {
        __m256 xh = _mm256_mul_ps(_mm256_sub_ps(LOAD(r + 8 * k), m), a);
        __m256 gh = _mm256_mul_ps(LOAD(g + 8 * k), LOAD(w + 8 * k));
        __m256 t = _mm256_fnmadd_ps(xh, C, _mm256_sub_ps(gh, A));
        _mm256_storeu_ps(gx + (i + q) * D + 8 * k, _mm256_mul_ps(t, a));
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm256_storeu_ps(gw + 8 * k, aw[k]);
    _mm256_storeu_ps(gb + 8 * k, ab[k]);
  }
  return i;
}
#define HAVE_ROWS8 1
#else
#define HAVE_ROWS8 0
#endif

/* this thread's rows [s, e) of N */
static void my_rows(int64_t N, int64_t *s, int64_t *e) {
  int64_t t = 0, T = 1;
#ifdef _OPENMP
  t = omp_get_thread_num();
  T = omp_get_num_threads();
#endif
  *s = N * t / T;
  *e = N * (t + 1) / T;
}

/* 1 when widths that are multiples of 8 take the eight-rows-at-once path */
int nl_has_rows8(void) { return HAVE_ROWS8; }

/* rows [s, e) of the forward, by width; `strided` is a constant at each call, so contiguous
 * rows (the common case) keep plain row arithmetic and pay nothing for the walk */
static inline void fwd_part(const float *x, const float *w, const float *b, float *y,
                            float *mean, float *rstd, int64_t s, int64_t e, int64_t D,
                            int center, float eps, rowwalk *wy, const int strided) {
#if HAVE_ROWS8
  /* the common widths get their own inlined copies, with K known to the compiler */
  if (D == 16) s = fwd_rows8(x, w, b, y, mean, rstd, s, e, 2, center, eps, wy, strided);
  else if (D == 64) s = fwd_rows8(x, w, b, y, mean, rstd, s, e, 8, center, eps, wy, strided);
  else if (D % 8 == 0)
    s = fwd_rows8(x, w, b, y, mean, rstd, s, e, D / 8, center, eps, wy, strided);
#endif
  fwd_rows(x, w, b, y, mean, rstd, s, e, D, center, eps, wy, strided);
}

/* y's rows at (T, H, yb, yt, yh): see rowmap; 1, 1, D, 0, 0 for contiguous rows */
void nl_norm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                 float *rstd, int64_t N, int64_t D, int center, float eps, int nthreads,
                 int64_t T, int64_t H, int64_t yb, int64_t yt, int64_t yh) {
  const rowmap ym = {T, H, yb, yt, yh};
  const int strided = !(T == 1 && H == 1 && yb == D);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(N, &s, &e);
    rowwalk wy = walk_at(ym, s);
    if (strided) fwd_part(x, w, b, y, mean, rstd, s, e, D, center, eps, &wy, 1);
    else fwd_part(x, w, b, y, mean, rstd, s, e, D, center, eps, &wy, 0);
  }
}

static inline void bwd_part(const float *gy, const float *x, const float *w, const float *mean,
                            const float *rstd, float *gx, float *tw, float *tb, int64_t s,
                            int64_t e, int64_t D, int center, rowwalk *wg, const int strided) {
#if HAVE_ROWS8
  if (D == 16) s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, 2, center, wg, strided);
  else if (D == 64)
    s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, 8, center, wg, strided);
  else if (D % 8 == 0 && D <= 256) /* bwd_rows8 keeps D / 8 <= 32 sums in registers */
    s = bwd_rows8(gy, x, w, mean, rstd, gx, tw, tb, s, e, D / 8, center, wg, strided);
#endif
  bwd_rows(gy, x, w, mean, rstd, gx, tw, tb, s, e, D, center, wg, strided);
}

/* gw, gb: [nthreads, D] scratch; on return row 0 holds the totals. gy's rows at
 * (T, H, gsb, gst, gsh): see rowmap */
void nl_norm_bwd(const float *gy, const float *x, const float *w, const float *mean,
                 const float *rstd, float *gx, float *gw, float *gb, int64_t N, int64_t D,
                 int center, int nthreads, int64_t T, int64_t H, int64_t gsb, int64_t gst,
                 int64_t gsh) {
  const rowmap gm = {T, H, gsb, gst, gsh};
  const int strided = !(T == 1 && H == 1 && gsb == D);
  int used = 1;
  memset(gw, 0, sizeof(float) * D * nthreads);
  memset(gb, 0, sizeof(float) * D * nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e, t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
    if (t == 0) used = omp_get_num_threads();
#endif
    my_rows(N, &s, &e);
    rowwalk wg = walk_at(gm, s);
    float *tw = gw + t * D, *tb = gb + t * D;
    if (strided) bwd_part(gy, x, w, mean, rstd, gx, tw, tb, s, e, D, center, &wg, 1);
    else bwd_part(gy, x, w, mean, rstd, gx, tw, tb, s, e, D, center, &wg, 0);
  }
  for (int t = 1; t < used; ++t)
    for (int64_t j = 0; j < D; ++j) {
      gw[j] += gw[t * D + j];
      gb[j] += gb[t * D + j];
    }
}

/* ---------------------------------------------------------------------------------------------
 * RoPE in the rotate-half layout on x [B, T, H, D], tables cos, sin2 [B * T, D] shared by the
 * H heads, h = D / 2, m(j) = (j + h) mod D, sin2 = cat(sin, -sin):
 *   forward        y[j] = x[j] * cos[j] + x[m(j)] * sin2[m(j)]
 *   transposed     y[j] = x[j] * cos[j] + x[m(j)] * sin2[j]     (the backward: R^T g)
 * These are the very products and sums of torch's `x * cos + roll(x * sin2, h)` and of its
 * autograd backward, so without contraction into FMAs (switched off below for gcc; clang
 * contracts only within one expression) the results are bitwise torch's. ATen needs four
 * passes over x and a widened table per head count; this is one.
 * x is read through its strides (b, t, h, d), so a transposed gradient needs no copy; y is
 * written through its strides (b, t, h; d contiguous), so q and k can be written straight
 * into the head-major layout attention's matmuls read.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static inline void rope_rows(const float *x, int64_t xb, int64_t xt, int64_t xh, int64_t xd,
                             const float *cs, const float *sn, float *y, int64_t yb, int64_t yt,
                             int64_t yh, int64_t s, int64_t e, int64_t T, int64_t H, int64_t D,
                             int transposed) {
  /* x and y point at row s (its first head): rows are found relative to it, so a caller can
   * hand a block's scratch copy as x (nl_norm_rope_*) */
  const int64_t h = D / 2, b0 = s / T, t0 = s % T;
  int64_t b = b0, t = t0; /* row n = b * T + t, stepped on without a division per row */
  for (int64_t n = s; n < e; ++n) {
    const float *c = cs + n * D, *sin2 = sn + n * D;
    /* the sin2 entries multiplying x[i + h] (into y[i]) and x[i] (into y[i + h]) */
    const float *s_lo = transposed ? sin2 : sin2 + h, *s_hi = transposed ? sin2 + h : sin2;
    for (int64_t k = 0; k < H; ++k) {
      /* the offset summed first: a scratch block's pointer never steps outside it */
      const float *r = x + ((b - b0) * xb + (t - t0) * xt + k * xh);
      float *o = y + ((b - b0) * yb + (t - t0) * yt + k * yh);
      int64_t i = 0;
#if HAVE_ROWS8
      if (xd == 1) /* eight pairs at a time: the same products and sums, in AVX registers */
        for (; i + 8 <= h; i += 8) {
          __m256 lo = LOAD(r + i), hi = LOAD(r + i + h);
          _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(lo, LOAD(c + i)),
                                                _mm256_mul_ps(hi, LOAD(s_lo + i))));
          _mm256_storeu_ps(o + i + h, _mm256_add_ps(_mm256_mul_ps(hi, LOAD(c + i + h)),
                                                    _mm256_mul_ps(lo, LOAD(s_hi + i))));
        }
#endif
      for (; i < h; ++i) {
        float a = r[i * xd] * c[i];
        float bb = r[(i + h) * xd] * s_lo[i];
        float a2 = r[(i + h) * xd] * c[i + h];
        float b2 = r[i * xd] * s_hi[i];
        o[i] = a + bb;
        o[i + h] = a2 + b2;
      }
    }
    if (++t == T) {
      t = 0;
      ++b;
    }
  }
}

void nl_rope(const float *x, int64_t xb, int64_t xt, int64_t xh, int64_t xd, const float *cs,
             const float *sn, float *y, int64_t yb, int64_t yt, int64_t yh, int64_t B, int64_t T,
             int64_t H, int64_t D, int transposed, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(B * T, &s, &e);
    if (s < e) {
      const float *xs = x + (s / T) * xb + (s % T) * xt;
      float *ys = y + (s / T) * yb + (s % T) * yt;
      /* contiguous rows get copies with the inner stride (and d_head 16) known, to vectorise */
      if (xd == 1 && D == 16)
        rope_rows(xs, xb, xt, xh, 1, cs, sn, ys, yb, yt, yh, s, e, T, H, 16, transposed);
      else if (xd == 1)
        rope_rows(xs, xb, xt, xh, 1, cs, sn, ys, yb, yt, yh, s, e, T, H, D, transposed);
      else rope_rows(xs, xb, xt, xh, xd, cs, sn, ys, yb, yt, yh, s, e, T, H, D, transposed);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ---------------------------------------------------------------------------------------------
 * QK-Norm then RoPE, as QK/QKV-Norm with RoPE computes q and k: y = R(N(x)) on x [B, T, H, D]
 * (contiguous; rows of D floats, H rows to a position), and its backward
 * gx = N'^T(R^T gy). Separately these are two kernel calls, each a pass over the tensor and,
 * under autograd, a Python Function; here one call normalises a block of a position's rows
 * into a scratch block that stays in L1, then rotates it into y (y written through its
 * strides, as nl_rope's). The block routines are the norm's and RoPE's own, so the results
 * are bitwise those of the two calls in turn wherever threads split the rows at the same
 * places (one thread, always): threads here split positions, the norm call splits rows, and
 * where those differ a few rows near the split, and the gain sums, round differently.
 * The backward rotates a block of gy back into the scratch and runs the norm's backward on it.
 * H * D <= FUSE_MAX_ROW floats (native.py checks).
 */
#define FUSE_SCRATCH 8192 /* floats: 32 KB of scratch a thread */
#define FUSE_MAX_ROW 1024 /* H * D, so that a block holds at least eight positions */

int nl_fuse_max_row(void) { return FUSE_MAX_ROW; }

/* positions a block holds: a multiple of 8, so its H * G rows come in whole eights */
static inline int64_t fuse_block(int64_t H, int64_t D) {
  return FUSE_SCRATCH / (H * D) / 8 * 8;
}

void nl_norm_rope_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                      float *rstd, int64_t B, int64_t T, int64_t H, int64_t D, int center,
                      float eps, const float *cs, const float *sn, int64_t yb, int64_t yt,
                      int64_t yh, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    float scratch[FUSE_SCRATCH];
    const int64_t G = fuse_block(H, D);
    int64_t s, e;
    my_rows(B * T, &s, &e);
    rowwalk none = walk_at((rowmap){1, 1, D, 0, 0}, 0);
    for (int64_t g = s; g < e; g += G) {
      const int64_t ge = g + G < e ? g + G : e, r0 = g * H;
      fwd_part(x + r0 * D, w, b, scratch, mean + r0, rstd + r0, 0, (ge - g) * H, D, center,
               eps, &none, 0);
      float *ys = y + (g / T) * yb + (g % T) * yt;
      if (D == 16)
        rope_rows(scratch, T * H * 16, H * 16, 16, 1, cs, sn, ys, yb, yt, yh, g, ge, T, H, 16, 0);
      else rope_rows(scratch, T * H * D, H * D, D, 1, cs, sn, ys, yb, yt, yh, g, ge, T, H, D, 0);
    }
  }
}

/* gy read through its strides (gsb, gst, gsh, gsd); gw, gb as nl_norm_bwd's */
void nl_norm_rope_bwd(const float *gy, int64_t gsb, int64_t gst, int64_t gsh, int64_t gsd,
                      const float *x, const float *w, const float *mean, const float *rstd,
                      float *gx, float *gw, float *gb, int64_t B, int64_t T, int64_t H, int64_t D,
                      int center, const float *cs, const float *sn, int nthreads) {
  int used = 1;
  memset(gw, 0, sizeof(float) * D * nthreads);
  memset(gb, 0, sizeof(float) * D * nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    float scratch[FUSE_SCRATCH];
    const int64_t G = fuse_block(H, D);
    int64_t s, e, t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
    if (t == 0) used = omp_get_num_threads();
#endif
    my_rows(B * T, &s, &e);
    float *tw = gw + t * D, *tb = gb + t * D;
    rowwalk none = walk_at((rowmap){1, 1, D, 0, 0}, 0);
    for (int64_t g = s; g < e; g += G) {
      const int64_t ge = g + G < e ? g + G : e, r0 = g * H;
      const float *gs = gy + (g / T) * gsb + (g % T) * gst;
      if (gsd == 1)
        rope_rows(gs, gsb, gst, gsh, 1, cs, sn, scratch, T * H * D, H * D, D, g, ge, T, H, D, 1);
      else rope_rows(gs, gsb, gst, gsh, gsd, cs, sn, scratch, T * H * D, H * D, D, g, ge, T, H, D,
                     1);
      bwd_part(scratch, x + r0 * D, w, mean + r0, rstd + r0, gx + r0 * D, tw, tb, 0,
               (ge - g) * H, D, center, &none, 0);
    }
  }
  for (int t = 1; t < used; ++t)
    for (int64_t j = 0; j < D; ++j) {
      gw[j] += gw[t * D + j];
      gb[j] += gb[t * D + j];
    }
}

/* ---------------------------------------------------------------------------------------------
 * Attention of one query per row over T keys: a decoding step, where ATen's path is five ops
 * (two batched matmuls of 1 x D by D x T, a bias, a scale and a softmax), each paying per-row
 * overhead on rows of ~20 keys. Here each (b, h) row is one pass over its keys and values:
 *   s_t = (q . k_t) * scale[h], or -inf where mask[b, t] is 0;  p = softmax(s);  z = sum_t p_t v_t
 * q [B, H, D] (strides qb, qh), k and v [B, KVH, T, D] (strides b, h, t; d contiguous), so a
 * cache's capacity buffer is read in place; head h reads key/value head h / rep (grouped
 * queries). mask: bytes at b * mb + t * mt (mb = 0 broadcasts), or NULL for every key.
 * z [B, H, D] contiguous. A row with every key masked gives NaN, as torch's softmax does.
 * Float rounding differs from ATen's (another summation order), not the maths.
 */
#define ATTN_MAX_KEYS 4096 /* a row's scores live on the stack */

/* one row, any D, one key at a time (CPUs without AVX2, and widths not a multiple of 8) */
static inline void attn1_row(const float *qr, const float *kr, int64_t kt, const float *vr,
                             int64_t vt, float scale, const uint8_t *mr, int64_t mt,
                             float *restrict o, float *sc, int64_t T, int64_t D) {
  float m = -INFINITY, sum = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += qr[d] * kr[t * kt + d];
    sc[t] = (mr && !mr[t * mt]) ? -INFINITY : s * scale;
    m = sc[t] > m ? sc[t] : m;
  }
  for (int64_t t = 0; t < T; ++t) { /* every key masked: m = -inf, so NaN, as torch's */
    sc[t] = expf(sc[t] - m);
    sum += sc[t];
  }
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) o[d] += sc[t] * vr[t * vt + d];
  for (int64_t d = 0; d < D; ++d) o[d] /= sum;
}

#if HAVE_ROWS8
/* e^x on eight lanes for x <= 0 (a score minus its row's max): x = n ln2 + r, |r| <= ln2 / 2,
 * e^r by a degree-6 polynomial (Cephes' expf coefficients, ~1 ulp), times 2^n through the
 * exponent bits; below -87 (a masked key's -inf included) exactly 0, NaN stays NaN. A scalar
 * `expf` per key was most of the kernel's time: one latency chain per key. */
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q); /* a NaN score stays NaN, as expf's */
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts */
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_or_ps(_mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep), nan);
}

/* one row, D = 8K: eight keys' dot products at once (hsum8 puts their sums in one register),
 * the exponentials eight at a time, z in K registers. sc has room for T rounded up to 8. */
static inline void attn1_row8(const float *qr, const float *kr, int64_t kt, const float *vr,
                              int64_t vt, float scale, const uint8_t *mr, int64_t mt,
                              float *restrict o, float *sc, int64_t T, int64_t K) {
  const int64_t T8 = (T + 7) / 8 * 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < T8; t += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) {
      const float *kj = kr + (t + j < T ? t + j : T - 1) * kt; /* past T: any key, dropped */
      acc[j] = _mm256_mul_ps(LOAD(qr), LOAD(kj));
      for (int64_t c = 1; c < K; ++c) acc[j] = _mm256_fmadd_ps(LOAD(qr + 8 * c), LOAD(kj + 8 * c), acc[j]);
    }
    _mm256_storeu_ps(sc + t, _mm256_mul_ps(hsum8(acc), vscale));
  }
  float m = -INFINITY;
  for (int64_t t = 0; t < T8; ++t) {
    if (t >= T || (mr && !mr[t * mt])) sc[t] = -INFINITY;
    m = sc[t] > m ? sc[t] : m;
  }
  if (m == -INFINITY) { /* every key masked: NaN, as torch's softmax */
    for (int64_t d = 0; d < 8 * K; ++d) o[d] = NAN;
    return;
  }
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < T8; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(LOAD(sc + t), vm));
    _mm256_storeu_ps(sc + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  const __m256 inv = _mm256_set1_ps(1.f / _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))));
  for (int64_t c = 0; c < K; ++c) { /* four chains of adds, not one: latency, not throughput */
    const float *vc = vr + 8 * c;
    __m256 z0 = _mm256_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) {
      z0 = _mm256_fmadd_ps(BCAST(sc + t), LOAD(vc + t * vt), z0);
      z1 = _mm256_fmadd_ps(BCAST(sc + t + 1), LOAD(vc + (t + 1) * vt), z1);
      z2 = _mm256_fmadd_ps(BCAST(sc + t + 2), LOAD(vc + (t + 2) * vt), z2);
      z3 = _mm256_fmadd_ps(BCAST(sc + t + 3), LOAD(vc + (t + 3) * vt), z3);
    }
    for (; t < T; ++t) z0 = _mm256_fmadd_ps(BCAST(sc + t), LOAD(vc + t * vt), z0);
    const __m256 zs = _mm256_add_ps(_mm256_add_ps(z0, z1), _mm256_add_ps(z2, z3));
    _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(zs, inv));
  }
}
#endif

static inline void attn1_rows(const float *q, int64_t qb, int64_t qh, const float *k,
                              int64_t kb, int64_t kh, int64_t kt, const float *v, int64_t vb,
                              int64_t vh, int64_t vt, const float *scale, const uint8_t *mask,
                              int64_t mb, int64_t mt, float *restrict z, int64_t s, int64_t e,
                              int64_t H, int64_t rep, int64_t T, int64_t D) {
  float sc[ATTN_MAX_KEYS + 8];
  for (int64_t r = s; r < e; ++r) {
    const int64_t b = r / H, h = r % H;
    const float *qr = q + b * qb + h * qh;
    const float *kr = k + b * kb + (h / rep) * kh, *vr = v + b * vb + (h / rep) * vh;
    const uint8_t *mr = mask ? mask + b * mb : NULL;
#if HAVE_ROWS8
    if (D % 8 == 0) {
      attn1_row8(qr, kr, kt, vr, vt, scale[h], mr, mt, z + r * D, sc, T, D / 8);
      continue;
    }
#endif
    attn1_row(qr, kr, kt, vr, vt, scale[h], mr, mt, z + r * D, sc, T, D);
  }
}

int nl_attn_max_keys(void) { return ATTN_MAX_KEYS; }

void nl_attn1(const float *q, int64_t qb, int64_t qh, const float *k, int64_t kb, int64_t kh,
              int64_t kt, const float *v, int64_t vb, int64_t vh, int64_t vt, const float *scale,
              const uint8_t *mask, int64_t mb, int64_t mt, float *z, int64_t B, int64_t H,
              int64_t rep, int64_t T, int64_t D, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(B * H, &s, &e);
    if (D == 16) /* d_head 16 gets its own copy, with D known to the compiler */
      attn1_rows(q, qb, qh, k, kb, kh, kt, v, vb, vh, vt, scale, mask, mb, mt, z, s, e, H, rep,
                 T, 16);
    else
      attn1_rows(q, qb, qh, k, kb, kh, kt, v, vb, vh, vt, scale, mask, mb, mt, z, s, e, H, rep,
                 T, D);
  }
}

/* ---------------------------------------------------------------------------------------------
 * GELU (exact, erf form) for a training step: y = x * cdf(x) and its derivative
 * d = cdf(x) + x * pdf(x), cdf(x) = (1 + erf(x / sqrt2)) / 2, pdf(x) = e^(-x^2/2) / sqrt(2 pi),
 * in one pass, so that the backward is one multiply (g * d) where ATen's recomputes erf and
 * two exponentials from x. erf is Abramowitz and Stegun's 7.1.26, as ATen's vectorised erf
 * (absolute error below 1.5e-7), whose e^(-z^2) at z = |x| / sqrt2 is the very e^(-x^2/2) of
 * the pdf: one exponential serves both. The exponential is Cephes expf's polynomial after a
 * round-to-nearest by the 1.5 * 2^23 trick; no libm call and no branch, so the loop
 * vectorises at any -O3 (floorf would vectorise only without trapping math).
 */
static inline float exp_nonpos(float v) {
  /* e^v for v <= 0, and 0 below -80: the GELU's tails are then exactly 0 and 1 (the terms
   * dropped are below 1e-34), no product goes subnormal, and at huge |x| (x * x = inf) the
   * derivative's x * e^(-x^2/2) is 0, not x times a clamped exponential */
  const float u = v < -80.f ? -80.f : v;
  const float big = u * 1.44269504088896341f + 12582912.f; /* 1.5 * 2^23 + round(u / ln 2) */
  const float n = big - 12582912.f;
  const float r = u - n * 0.693359375f + n * 2.12194440e-4f; /* u - n ln 2, ln 2 in two parts */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  union { float f; uint32_t i; } k = {big}, s;
  s.i = (k.i - 0x4B400000u + 127u) << 23; /* 2^n: n sits in big's low mantissa bits */
  return v < -80.f ? 0.f : p * s.f;
}

void nl_gelu_fwd(const float *x, float *y, float *d, int64_t N, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(N, &s, &e);
    for (int64_t i = s; i < e; ++i) {
      const float xi = x[i];
      const float t = 1.f / (1.f + 0.3275911f * 0.70710678118654752f * fabsf(xi));
      float r = 1.061405429f;
      r = r * t - 1.453152027f;
      r = r * t + 1.421413741f;
      r = r * t - 0.284496736f;
      r = r * t + 0.254829592f;
      const float g = exp_nonpos(-0.5f * xi * xi);
      const float q = 0.5f * r * t * g; /* (1 - erf(|x| / sqrt2)) / 2 */
      const float c = xi >= 0.f ? 1.f - q : q;
      y[i] = xi * c;
      d[i] = c + xi * g * 0.39894228040143268f;
    }
  }
}
