/* normlab's native CPU kernels, behind normlab.model.native (see its docstring for why):
 * LayerNorm / RMSNorm over the last dim of a contiguous float32 [N, D] tensor, forward and
 * backward (y written and gy read through row strides: `rowmap`); RoPE's rotation; the
 * attention of one query a row; the GELU of a training step with its derivative; and the
 * attention of short rows, forward and backward (the last four further down this file).
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
#include <stdlib.h>
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

/* this thread's rows [s, e) of N, split at multiples of q (the last thread's range ends at N) */
static void my_rows_by(int64_t N, int64_t q, int64_t *s, int64_t *e) {
  int64_t t = 0, T = 1;
#ifdef _OPENMP
  t = omp_get_thread_num();
  T = omp_get_num_threads();
#endif
  const int64_t G = (N + q - 1) / q;
  *s = q * (G * t / T);
  *e = t + 1 == T ? N : q * (G * (t + 1) / T);
}

/* this thread's rows [s, e) of N */
static void my_rows(int64_t N, int64_t *s, int64_t *e) { my_rows_by(N, 1, s, e); }

/* 1 when widths that are multiples of 8 take the eight-rows-at-once path */
int nl_has_rows8(void) { return HAVE_ROWS8; }

/* Eight floats as one value (GCC/clang vector extensions: lane-wise arithmetic that builds with
 * or without AVX2, and casts to and from __m256 where AVX2 intrinsics take over). */
typedef float v8 __attribute__((vector_size(32), aligned(4))); /* at any address */
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
#define SPLAT(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})
#define SEL(m, a, b) ((v8)(((v8i)(a) & (m)) | ((v8i)(b) & ~(m)))) /* m ? a : b, lane-wise */

/* e^v on eight lanes for v <= 0 (a score minus its row's max), the exponential of this file
 * (GELU's exp_nonpos, below, is the same for one float): v = n ln2 + r, |r| <= ln2 / 2, n by a
 * round-to-nearest through the 1.5 * 2^23 trick, e^r by Cephes expf's degree-6 polynomial
 * (~1 ulp), times 2^n through the exponent bits. No libm call and no branch: a scalar expf per
 * key or per element was most of a kernel's time. Below -80 it is exactly 0 (-inf included):
 * GELU's tails are then exactly 0 and 1 (the terms dropped are below 1e-34), no product goes
 * subnormal, and at huge |x| (x * x = inf) the derivative's x * e^(-x^2/2) is 0, not x times a
 * clamped exponential. NaN stays NaN. */
/* The arithmetic of both forms, written once for the type T of u (v8 or float), u in [-80, 0]
 * or NaN: declares `big` (1.5 * 2^23 + n, n = round(u / ln 2)) and `p` (e^r, r = u - n ln 2). */
#define EXP_REDUCED(T, u, big, p)                                                                \
  const T big = (u) * 1.44269504088896341f + 12582912.f;                                         \
  T p;                                                                                           \
  {                                                                                              \
    const T n_ = big - 12582912.f;                                                               \
    const T r_ = (u) - n_ * 0.693359375f + n_ * 2.12194440e-4f; /* ln 2 in two parts */        \
    p = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                                \
    p = p * r_ + 8.3334519073e-3f;                                                               \
    p = p * r_ + 4.1665795894e-2f;                                                               \
    p = p * r_ + 1.6666665459e-1f;                                                               \
    p = p * r_ + 5.0000001201e-1f;                                                               \
    p = p * r_ * r_ + r_ + 1.f;                                                                  \
  }

static inline v8 exp8v(v8 v) {
  const v8i lo = v < SPLAT(-80.f); /* false for NaN: it runs through, and stays NaN */
  const v8 u = SEL(lo, SPLAT(-80.f), v);
  EXP_REDUCED(v8, u, big, p);
  /* 2^n: n sits in big's low mantissa bits; unsigned, for NaN's sign bit */
  const v8i e = (v8i)(((v8u)big - 0x4B400000u + 127u) << 23);
  return (v8)((v8i)(p * (v8)e) & ~lo);
}

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
    my_rows_by(N, 8, &s, &e); /* eight-row groups whole: a row's path (and its rounding)
                                 is the same at any thread count */
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
    my_rows_by(N, 8, &s, &e); /* as the forward: gx's rows alike at any thread count */
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
 * strides, as nl_rope's). The block routines are the norm's and RoPE's own, and threads here
 * split positions at multiples of eight (8 H rows) as the norm call splits rows, so every row
 * takes the path it takes there: y and gx are bitwise those of the two calls in turn at any
 * thread count. The gain sums add one partial sum a thread, so they round by thread count.
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
    my_rows_by(B * T, 8, &s, &e);
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
    my_rows_by(B * T, 8, &s, &e);
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
      for (int64_t c = 1; c < K; ++c)
        acc[j] = _mm256_fmadd_ps(LOAD(qr + 8 * c), LOAD(kj + 8 * c), acc[j]);
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
    const __m256 e = (__m256)exp8v((v8)_mm256_sub_ps(LOAD(sc + t), vm));
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
 * the pdf: one exponential serves both. The exponential is exp8v's (above), written for one
 * float: the loop is scalar so that the compiler vectorises it as wide as the machine allows
 * (gcc 12 with AVX-512: sixteen lanes), where the same loop on exp8v's eight lanes ran slower
 * (an A/B in scratch work). Its arithmetic is exp8v's, one macro (EXP_REDUCED) for both.
 */
static inline float exp_nonpos(float v) {
  /* e^v for v <= 0, 0 below -80 (exp8v says why), NaN stays NaN */
  const float u = v < -80.f ? -80.f : v;
  EXP_REDUCED(float, u, big, p);
  union { float f; uint32_t i; } k = {big}, s;
  s.i = (k.i - 0x4B400000u + 127u) << 23; /* 2^n: n sits in big's low mantissa bits */
  return v < -80.f ? 0.f : p * s.f;
}

/* cdf(x), and e^(-x^2/2) in *g (the pdf's exponential, which erf's formula shares) */
static inline float gelu_cdf(float xi, float *g) {
  const float t = 1.f / (1.f + 0.3275911f * 0.70710678118654752f * fabsf(xi));
  float r = 1.061405429f;
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  *g = exp_nonpos(-0.5f * xi * xi);
  const float q = 0.5f * r * t * *g; /* (1 - erf(|x| / sqrt2)) / 2 */
  return xi >= 0.f ? 1.f - q : q;
}

void nl_gelu_fwd(const float *x, float *y, float *d, int64_t N, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s, e;
    my_rows(N, &s, &e);
    for (int64_t i = s; i < e; ++i) {
      const float xi = x[i];
      float g;
      const float c = gelu_cdf(xi, &g);
      y[i] = xi * c;
      d[i] = c + xi * g * 0.39894228040143268f;
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * Attention of T queries over S keys a (b, h) row (a training step's, a
 * prompt's, a sweep's), forward and backward:
 *   s_ts = (q_t . k_s) * scale[h], -inf where mask is 0;  p_t = softmax(s_t);  z_t = sum_s p_ts v_s
 * and back, with g_t = dL/dz_t:
 *   dp_ts = g_t . v_s;  ds_ts = p_ts (dp_ts - sum_s' p_ts' dp_ts');  dv_s = sum_t p_ts g_t;
 *   dq_t = scale sum_s ds_ts k_s;  dk_s = scale sum_t ds_ts q_t;  dscale = sum_ts ds_ts (q_t . k_s)
 * ATen's explicit path is eight ops forward (two batched matmuls, a bias, a scale, a softmax,
 * layout copies) and as many back, each a pass over [B, H, T, S] or [B, H, T, D] tensors in
 * memory, with per-op costs on rows of ~17 keys and 16-float heads. Here eight (b, h) rows go
 * through together, one in each lane of an eight-float vector: every product, exponential and
 * sum is a lane-wise vector operation, with no lane idle on a row shorter than a vector and no
 * sum across lanes. The rows are copied into lane-major scratch ([t][d][lane], a few KB: L1)
 * and z and the gradients copied back. A mask the same for every (b, h) (a causal one;
 * strides 0, or sizes 1, over b and h) is one byte per (t, s) for all eight lanes: masked keys
 * are skipped, and a query's keys past its last visible one (found once a call) never looked
 * at, as flash attention skips a causal mask's upper blocks. A mask that differs by row (a
 * batch's padding) is copied lane-major for each group of rows, eight bytes a key, and keys
 * none of the eight rows may see are skipped in the same way. The k and v of keys past a
 * query's last visible one, and of keys no row of the group may see under a mask per row,
 * are never read (so an inf or NaN there, which torch's 0 * v spreads, stays out). q, k, v,
 * z and g are read and written through their strides (d contiguous); the mask through four
 * strides (0 where it broadcasts), or NULL for every key.
 * The weights p are saved for the backward in the kernel's own layout, [B*H/8 up][T][S][lane].
 * A query whose keys are all masked gives NaN, as torch's softmax does.
 */
#if HAVE_ROWS8
/* the 8 x 8 block r[0..7] (row u: eight floats) transposed into c[0..7] (c[j] lane u = r[u][j]) */
static inline void tr8(const __m256 *r, __m256 *c) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  c[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  c[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

/* x's rows [N, D] (strides xb, xh, xn per row's b, h and position) into X [N][D][lane]: with
 * AVX2, eight rows' eight floats at a time by one 8 x 8 transpose */
static inline void tattn_gather(const float *x, const int64_t *xs, const int64_t *b,
                                const int64_t *h, float *restrict X, int64_t N, int64_t D) {
  const float *xr[8];
  for (int u = 0; u < 8; ++u) xr[u] = x + b[u] * xs[0] + h[u] * xs[1];
  int64_t d0 = 0;
#if HAVE_ROWS8
  for (; d0 + 8 <= D; d0 += 8)
    for (int64_t n = 0; n < N; ++n) {
      __m256 r[8], c[8];
      for (int u = 0; u < 8; ++u) r[u] = _mm256_loadu_ps(xr[u] + n * xs[2] + d0);
      tr8(r, c);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(X + (n * D + d0 + j) * 8, c[j]);
    }
  if (D % 8 == 0)
    return;
#endif
  /* widths not a multiple of 8, or no AVX2: one float at a time */
  for (int u = 0; u < 8; ++u)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = d0; d < D; ++d) X[(n * D + d) * 8 + u] = xr[u][n * xs[2] + d];
}

/* X [N][D][lane] into the rows of x, lanes [0, nu) */
static inline void tattn_scatter(const float *restrict X, float *x, const int64_t *xs,
                                 const int64_t *b, const int64_t *h, int nu, int64_t N,
                                 int64_t D) {
  float *xr[8];
  for (int u = 0; u < 8; ++u) xr[u] = x + b[u] * xs[0] + h[u] * xs[1];
  int64_t d0 = 0;
#if HAVE_ROWS8
  for (; d0 + 8 <= D; d0 += 8)
    for (int64_t n = 0; n < N; ++n) {
      __m256 r[8], c[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(X + (n * D + d0 + j) * 8);
      tr8(r, c);
      for (int u = 0; u < nu; ++u) _mm256_storeu_ps(xr[u] + n * xs[2] + d0, c[u]);
    }
  if (D % 8 == 0)
    return;
#endif
  /* widths not a multiple of 8, or no AVX2: one float at a time */
  for (int u = 0; u < nu; ++u)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = d0; d < D; ++d) xr[u][n * xs[2] + d] = X[(n * D + d) * 8 + u];
}

/* group g's rows: lane u holds row min(8g + u, R - 1) (the last group's spare lanes repeat
 * its last row; their results are dropped); its (b, h), its head's scale, and its q, k and v
 * gathered into Q [T][D][8], K, V [S][D][8]; returns how many lanes hold rows of their own */
static inline int tattn_load(int64_t g, int64_t R, int64_t H, const float *scale,
                             const float *q, const int64_t *qs, const float *k,
                             const int64_t *ks, const float *v, const int64_t *vs, int64_t *b,
                             int64_t *h, v8 *sc, float *Q, float *K, float *V, int64_t T,
                             int64_t S, int64_t D) {
  for (int u = 0; u < 8; ++u) {
    const int64_t r = 8 * g + u < R ? 8 * g + u : R - 1;
    b[u] = r / H;
    h[u] = r % H;
    (*sc)[u] = scale[h[u]];
  }
  tattn_gather(q, qs, b, h, Q, T, D);
  tattn_gather(k, ks, b, h, K, S, D);
  tattn_gather(v, vs, b, h, V, S, D);
  return R - 8 * g < 8 ? (int)(R - 8 * g) : 8;
}

/* Whether the mask is the same for every (b, h) (strides 0 there): then it is read once per
 * (t, s), and keys past a query's last visible one are skipped */
#define UNIFORM(mst) ((mst)[0] == 0 && (mst)[1] == 0)

/* lims[t]: keys [0, lims[t]) hold every key query t may see, under a uniform mask (S
 * otherwise); the same for every group of rows, so read once a call */
static int64_t *tattn_limits(const uint8_t *mask, const int64_t *mst, int64_t T, int64_t S) {
  int64_t *lims = malloc((T > 0 ? T : 1) * sizeof(int64_t));
  if (lims)
    for (int64_t t = 0; t < T; ++t) {
      int64_t l = S;
      if (mask && UNIFORM(mst))
        while (l > 0 && !mask[t * mst[2] + (l - 1) * mst[3]]) --l;
      lims[t] = l;
    }
  return lims;
}

/* A mask that differs by row, for one group: M [T][S][lane], -1 where the lane's row may see
 * key s of query t, 0 where not (eight bytes a key, read as one vector), and lims[t], one past
 * the last key any lane's query t may see (a causal mask's upper triangle and the padding the
 * eight rows share are then skipped, as under a uniform mask); copied once a group, so that
 * the loops over keys read eight bytes in a row, not one byte a lane through four strides */
static inline void tattn_mask_group(const uint8_t *mask, const int64_t *mst, const int64_t *b,
                                    const int64_t *h, int8_t *restrict M, int64_t *lims,
                                    int64_t T, int64_t S) {
  for (int64_t t = 0; t < T; ++t) lims[t] = 0;
  for (int u = 0; u < 8; ++u) {
    const uint8_t *row = mask + b[u] * mst[0] + h[u] * mst[1];
    for (int64_t t = 0; t < T; ++t, row += mst[2]) {
      int8_t *mt = M + t * S * 8 + u;
      for (int64_t s = 0; s < S; ++s) mt[s * 8] = row[s * mst[3]] ? -1 : 0;
      int64_t l = S;
      while (l > lims[t] && !mt[(l - 1) * 8]) --l;
      lims[t] = l;
    }
  }
}

typedef int8_t v8c __attribute__((vector_size(8), aligned(1)));

/* M's eight lanes of key s of query t: -1 where visible (see tattn_mask_group) */
#define MASK_LANES(M, S, t, s) \
  (__builtin_convertvector(*(const v8c *)((M) + ((t) * (S) + (s)) * 8), v8i))
/* whether none of the group's rows may see key s of query t, by its mask M per row
 * (tattn_mask_group): its k and v are then never read */
static inline int tattn_unseen(const int8_t *M, int64_t S, int64_t t, int64_t s) {
  uint64_t bits;
  memcpy(&bits, M + (t * S + s) * 8, 8);
  return !bits;
}

/* whether no row of the group may see key s of query t: by the uniform mask's byte, or by M
 * under a mask per row (no mask: every key is seen) */
static inline int tattn_hidden(int uniform, const uint8_t *mask, const int64_t *mst,
                               const int8_t *M, int64_t S, int64_t t, int64_t s) {
  return uniform ? !mask[t * mst[2] + s * mst[3]] : M && tattn_unseen(M, S, t, s);
}

/* acc[d] += sum over keys s < lim of w[s] X[s][d], X [S][D][8]; with `skip` (a constant at
 * each call, so that the loop without it keeps its code), keys no row of the group may see by
 * M are left out */
static inline void tattn_acc(v8 *restrict acc, const v8 *w, const float *restrict X,
                             const int8_t *M, int64_t S, int64_t t, int64_t lim, int64_t D,
                             const int skip) {
  for (int64_t s = 0; s < lim; ++s) {
    if (skip && tattn_unseen(M, S, t, s)) continue;
    const v8 ws = w[s], *xs = (const v8 *)(X + s * D * 8);
    for (int64_t d = 0; d < D; ++d) acc[d] += ws * xs[d];
  }
}

/* one group of eight rows, forward. Q [T][D][8], K, V [S][D][8] (gathered), P [T][S][8] out,
 * Z [T][D][8] scratch; M the group's mask when it differs by row (tattn_mask_group), else NULL,
 * and lims[t] from tattn_limits or tattn_mask_group */
static inline void tattn_fwd_group(const float *restrict Q, const float *restrict K,
                                   const float *restrict V, v8 scale, const uint8_t *mask,
                                   const int64_t *mst, const int8_t *M, const int64_t *lims,
                                   const int64_t *b, const int64_t *h, float *restrict P,
                                   float *restrict Z, float *z, const int64_t *zs, int nu,
                                   int64_t T, int64_t S, int64_t D) {
  const int uniform = mask && UNIFORM(mst);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lim = lims[t];
    v8 *pt = (v8 *)(P + t * S * 8);
    const v8 *qt = (const v8 *)(Q + t * D * 8);
    v8 m = SPLAT(-INFINITY);
    for (int64_t s = 0; s < lim; ++s) {
      if (tattn_hidden(uniform, mask, mst, M, S, t, s)) {
        pt[s] = SPLAT(-INFINITY);
        continue;
      }
      const v8 *ks = (const v8 *)(K + s * D * 8);
      v8 a0 = {0}, a1 = {0}; /* two chains of adds */
      int64_t d = 0;
      for (; d + 2 <= D; d += 2) {
        a0 += qt[d] * ks[d];
        a1 += qt[d + 1] * ks[d + 1];
      }
      if (d < D) a0 += qt[d] * ks[d];
      v8 x = (a0 + a1) * scale;
      if (M) x = SEL(MASK_LANES(M, S, t, s), x, SPLAT(-INFINITY));
      pt[s] = x;
      m = SEL(x > m, x, m);
    }
    /* every key masked: -inf - -inf is NaN, and so the row, as torch's softmax */
    v8 sum = {0};
    for (int64_t s = 0; s < lim; ++s) {
      pt[s] = exp8v(pt[s] - m);
      sum += pt[s];
    }
    const v8 inv = 1.f / sum;
    for (int64_t s = 0; s < lim; ++s) pt[s] *= inv;
    for (int64_t s = lim; s < S; ++s) pt[s] = lim ? SPLAT(0.f) : SPLAT(NAN);
    v8 *zt = (v8 *)(Z + t * D * 8);
    for (int64_t d = 0; d < D; ++d) zt[d] = lim ? SPLAT(0.f) : SPLAT(NAN);
    if (M) /* keys no row sees: p 0, v never read */
      tattn_acc(zt, pt, V, M, S, t, lim, D, 1);
    else
      tattn_acc(zt, pt, V, M, S, t, lim, D, 0);
  }
  tattn_scatter(Z, z, zs, b, h, nu, T, D);
}

static void *tattn_scratch(int64_t floats) {
  return aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
}

/* a thread's M and lims for tattn_mask_group where the mask differs by row (both NULL
 * otherwise); returns 1 if they could not be had */
static int tattn_mask_scratch(const uint8_t *mask, const int64_t *mst, int64_t T, int64_t S,
                              int8_t **M, int64_t **lims) {
  if (!mask || UNIFORM(mst))
    return 0;
  *M = tattn_scratch(2 * T * S); /* T * S * 8 bytes */
  *lims = malloc((T > 0 ? T : 1) * sizeof(int64_t));
  return !*M || !*lims;
}

/* strides: q, k, v, z [b, h, position] (d contiguous), mask [b, h, t, s]; p [ceil(B*H/8)][T][S][8]
 * written for the backward, or NULL; returns 0, or 1 if scratch could not be had */
int nl_tattn_fwd(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                 const float *v, const int64_t *vs, const float *scale, const uint8_t *mask,
                 const int64_t *mst, float *z, const int64_t *zs, float *p, int64_t B, int64_t H,
                 int64_t T, int64_t S, int64_t D, int nthreads) {
  const int64_t R = B * H, G = (R + 7) / 8;
  int64_t *lims = tattn_limits(mask, mst, T, S);
  if (!lims)
    return 1;
  int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1) reduction(| : failed)
  {
    int64_t g0, g1;
    my_rows(G, &g0, &g1);
    float *Q = tattn_scratch(T * D * 8), *K = tattn_scratch(S * D * 8),
          *V = tattn_scratch(S * D * 8), *Z = tattn_scratch(T * D * 8),
          *Pw = p ? NULL : tattn_scratch(T * S * 8);
    int8_t *M = NULL;
    int64_t *gl = NULL;
    if (!Q || !K || !V || !Z || (!p && !Pw) || tattn_mask_scratch(mask, mst, T, S, &M, &gl)) {
      failed = 1;
    } else {
      for (int64_t g = g0; g < g1; ++g) {
        int64_t b[8], h[8];
        v8 sc;
        const int nu =
            tattn_load(g, R, H, scale, q, qs, k, ks, v, vs, b, h, &sc, Q, K, V, T, S, D);
        float *P = p ? p + g * T * S * 8 : Pw;
        if (M) tattn_mask_group(mask, mst, b, h, M, gl, T, S);
        const int64_t *lg = M ? gl : lims;
        if (D == 16) /* d_head 16 gets its own copy, with D known to the compiler */
          tattn_fwd_group(Q, K, V, sc, mask, mst, M, lg, b, h, P, Z, z, zs, nu, T, S, 16);
        else
          tattn_fwd_group(Q, K, V, sc, mask, mst, M, lg, b, h, P, Z, z, zs, nu, T, S, D);
      }
    }
    free(Q), free(K), free(V), free(Z), free(Pw), free(M), free(gl);
  }
  free(lims);
  return failed;
}

/* one group of eight rows, backward: Q, G [T][D][8], K, V [S][D][8], P [T][S][8] (the forward's);
 * dQ [T][D][8], dK, dV [S][D][8] out (dK without its factor scale), DSf [T][S][8] (ds) scratch;
 * M and lims as the forward's; returns the lanes' dscale. dq query by query; dk and dv key by
 * key afterwards, each summed over the queries in registers (query by query they were read and
 * written back at every query: 20% slower) */
static inline v8 tattn_bwd_group(const float *restrict Q, const float *restrict K,
                                 const float *restrict V, const float *restrict G,
                                 const float *restrict P, v8 scale, const uint8_t *mask,
                                 const int64_t *mst, const int8_t *M, float *restrict dQ,
                                 float *restrict dK, float *restrict dV, float *restrict DSf,
                                 const int64_t *lims, int64_t T, int64_t S, int64_t D) {
  const int uniform = mask && UNIFORM(mst);
  v8 dscale = {0};
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lim = lims[t];
    const v8 *pt = (const v8 *)(P + t * S * 8), *qt = (const v8 *)(Q + t * D * 8),
             *gt = (const v8 *)(G + t * D * 8);
    v8 *ds = (v8 *)(DSf + t * S * 8);
    v8 dot = {0};
    for (int64_t s = 0; s < lim; ++s) { /* dp_ts = g_t . v_s */
      if (tattn_hidden(uniform, mask, mst, M, S, t, s)) {
        ds[s] = SPLAT(0.f);
        continue;
      }
      const v8 *vs = (const v8 *)(V + s * D * 8);
      v8 a0 = {0}, a1 = {0};
      int64_t d = 0;
      for (; d + 2 <= D; d += 2) {
        a0 += gt[d] * vs[d];
        a1 += gt[d + 1] * vs[d + 1];
      }
      if (d < D) a0 += gt[d] * vs[d];
      ds[s] = a0 + a1;
      dot += pt[s] * ds[s];
    }
    for (int64_t s = lim; s < S; ++s) ds[s] = SPLAT(0.f);
    v8 *dq = (v8 *)(dQ + t * D * 8);
    for (int64_t d = 0; d < D; ++d) dq[d] = SPLAT(0.f);
    for (int64_t s = 0; s < lim; ++s) ds[s] = pt[s] * (ds[s] - dot);
    if (M) { /* a lane that sees no key (its p NaN) passes no gradient to its scores, as torch's
                masked_fill backward: its NaN reached dq, dk and every head's dscale (under a
                uniform mask such a query has lim 0, and no score at all). Its dot is NaN: the
                keys are looked at only then, one compare a query otherwise */
      const v8i odd = dot != dot;
      int any = 0;
      for (int u = 0; u < 8; ++u) any |= odd[u];
      if (any) {
        v8i seen = {0};
        for (int64_t s = 0; s < lim; ++s) seen |= MASK_LANES(M, S, t, s);
        for (int64_t s = 0; s < lim; ++s) ds[s] = SEL(seen, ds[s], SPLAT(0.f));
      }
    }
    if (M) /* keys no row sees: ds 0, k never read */
      tattn_acc(dq, ds, K, M, S, t, lim, D, 1);
    else
      tattn_acc(dq, ds, K, M, S, t, lim, D, 0);
    for (int64_t d = 0; d < D; ++d) {
      dscale += qt[d] * dq[d];
      dq[d] *= scale;
    }
  }
  for (int64_t s = 0; s < S; ++s) { /* dk_s = sum_t ds_ts q_t, dv_s = sum_t p_ts g_t */
    v8 *dks = (v8 *)(dK + s * D * 8), *dvs = (v8 *)(dV + s * D * 8);
    for (int64_t d = 0; d < D; ++d) dks[d] = dvs[d] = SPLAT(0.f);
    for (int64_t t = 0; t < T; ++t) {
      if (s >= lims[t]) continue;
      const v8 dss = ((const v8 *)(DSf + t * S * 8))[s], ps = ((const v8 *)(P + t * S * 8))[s];
      const v8 *qt = (const v8 *)(Q + t * D * 8), *gt = (const v8 *)(G + t * D * 8);
      for (int64_t d = 0; d < D; ++d) {
        dks[d] += dss * qt[d];
        dvs[d] += ps * gt[d];
      }
    }
  }
  return dscale;
}

/* dq [B, H, T, D], dk, dv [B, H, S, D] contiguous; dscale [B, H], each row's part; p as the
 * forward wrote it; returns 0, or 1 if scratch could not be had */
int nl_tattn_bwd(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                 const float *v, const int64_t *vs, const float *p, const float *g,
                 const int64_t *gs, const float *scale, const uint8_t *mask, const int64_t *mst,
                 float *dq, float *dk, float *dv, float *dscale, int64_t B, int64_t H, int64_t T,
                 int64_t S, int64_t D, int nthreads) {
  const int64_t R = B * H, NG = (R + 7) / 8;
  const int64_t qo[3] = {H * T * D, T * D, D}, ko[3] = {H * S * D, S * D, D};
  int64_t *L = tattn_limits(mask, mst, T, S);
  if (!L)
    return 1;
  int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1) reduction(| : failed)
  {
    int64_t g0, g1;
    my_rows(NG, &g0, &g1);
    float *Q = tattn_scratch(T * D * 8), *G = tattn_scratch(T * D * 8),
          *K = tattn_scratch(S * D * 8), *V = tattn_scratch(S * D * 8),
          *dQ = tattn_scratch(T * D * 8), *dK = tattn_scratch(S * D * 8),
          *dV = tattn_scratch(S * D * 8), *DS = tattn_scratch(T * S * 8);
    int8_t *M = NULL;
    int64_t *gl = NULL;
    if (!Q || !G || !K || !V || !dQ || !dK || !dV || !DS ||
        tattn_mask_scratch(mask, mst, T, S, &M, &gl)) {
      failed = 1;
    } else {
      for (int64_t gi = g0; gi < g1; ++gi) {
        int64_t b[8], h[8];
        v8 sc;
        const int nu =
            tattn_load(gi, R, H, scale, q, qs, k, ks, v, vs, b, h, &sc, Q, K, V, T, S, D);
        tattn_gather(g, gs, b, h, G, T, D);
        const float *P = p + gi * T * S * 8;
        if (M) tattn_mask_group(mask, mst, b, h, M, gl, T, S);
        const int64_t *lg = M ? gl : L;
        v8 ds;
        if (D == 16)
          ds = tattn_bwd_group(Q, K, V, G, P, sc, mask, mst, M, dQ, dK, dV, DS, lg, T, S, 16);
        else
          ds = tattn_bwd_group(Q, K, V, G, P, sc, mask, mst, M, dQ, dK, dV, DS, lg, T, S, D);
        tattn_scatter(dQ, dq, qo, b, h, nu, T, D);
        for (int64_t i = 0; i < S * D; ++i) ((v8 *)dK)[i] *= sc; /* dk = scale sum_t ds_ts q_t */
        tattn_scatter(dK, dk, ko, b, h, nu, S, D);
        tattn_scatter(dV, dv, ko, b, h, nu, S, D);
        for (int u = 0; u < nu; ++u) dscale[8 * gi + u] = ds[u];
      }
    }
    free(Q), free(G), free(K), free(V), free(dQ), free(dK), free(dV), free(DS), free(M), free(gl);
  }
  free(L);
  return failed;
}
