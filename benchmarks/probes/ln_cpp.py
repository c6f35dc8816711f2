"""One-off probe behind a number in docs/performance.md (tenth session); not part of make bench.

Would a hand-written C++ kernel for QKV-Norm's per-head LayerNorm (rows of d_head = 16) beat
`F.layer_norm`? Two builds of one plain per-row kernel (forward + closed-form backward, at::
parallel_for over rows), JIT-compiled with torch.utils.cpp_extension (needs g++; ~30 s per
build the first time, cached after): generic width at -O3, and width fixed at 16 with
-O3 -march=native. Each is checked against F.layer_norm (outputs and grads), then timed on
[2176, 4, 16] (a real quick-grid batch's q), forward alone and forward + backward:

    .venv/bin/python benchmarks/probes/ln_cpp.py THREADS
"""
import statistics as st
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

KERNEL = r"""
#include <torch/extension.h>
#include <cmath>
std::vector<torch::Tensor> fwd(torch::Tensor x, torch::Tensor w, torch::Tensor b, double eps) {
  auto xc = x.contiguous();
  int64_t D = xc.size(-1), N = xc.numel() / D;
  auto y = torch::empty_like(xc);
  auto mean = torch::empty({N}, xc.options());
  auto rstd = torch::empty({N}, xc.options());
  const float* px = xc.data_ptr<float>(); float* py = y.data_ptr<float>();
  const float* pw = w.data_ptr<float>(); const float* pb = b.data_ptr<float>();
  float* pm = mean.data_ptr<float>(); float* pr = rstd.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) {
      const float* r = px + i * D; float* o = py + i * D;
      float m = 0.f; for (int64_t j = 0; j < D; ++j) m += r[j];
      m /= D;
      float v = 0.f; for (int64_t j = 0; j < D; ++j) { float c = r[j] - m; v += c * c; }
      float rs = 1.f / std::sqrt(v / D + (float)eps);
      for (int64_t j = 0; j < D; ++j) o[j] = (r[j] - m) * rs * pw[j] + pb[j];
      pm[i] = m; pr[i] = rs;
    }
  });
  return {y, mean, rstd};
}
std::vector<torch::Tensor> bwd(torch::Tensor gy, torch::Tensor x, torch::Tensor w,
                               torch::Tensor mean, torch::Tensor rstd) {
  auto g = gy.contiguous(); auto xc = x.contiguous();
  int64_t D = xc.size(-1), N = xc.numel() / D;
  auto gx = torch::empty_like(xc);
  int nt = at::get_num_threads();
  auto gw = torch::zeros({nt, D}, xc.options()); auto gb = torch::zeros({nt, D}, xc.options());
  const float* pg = g.data_ptr<float>(); const float* px = xc.data_ptr<float>();
  const float* pw = w.data_ptr<float>(); const float* pm = mean.data_ptr<float>();
  const float* pr = rstd.data_ptr<float>();
  float* pgx = gx.data_ptr<float>(); float* pgw = gw.data_ptr<float>();
  float* pgb = gb.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t s, int64_t e) {
    int t = at::get_thread_num();
    float* tw = pgw + t * D; float* tb = pgb + t * D;
    for (int64_t i = s; i < e; ++i) {
      const float* r = px + i * D; const float* gr = pg + i * D; float* o = pgx + i * D;
      float m = pm[i], rs = pr[i];
      float a = 0.f, c = 0.f;
      for (int64_t j = 0; j < D; ++j) {
        float xh = (r[j] - m) * rs; float gh = gr[j] * pw[j];
        a += gh; c += gh * xh; tw[j] += gr[j] * xh; tb[j] += gr[j];
      }
      a /= D; c /= D;
      for (int64_t j = 0; j < D; ++j) {
        float xh = (r[j] - m) * rs; o[j] = rs * (gr[j] * pw[j] - a - xh * c);
      }
    }
  });
  return {gx, gw.sum(0), gb.sum(0)};
}
"""

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
N, H, D = 2176, 4, 16
BUILDS = {
    "generic width, -O3": (KERNEL, ["-O3"]),
    "width 16, -O3 -march=native": (
        KERNEL.replace("int64_t D = xc.size(-1), N = xc.numel() / D;",
                       "constexpr int64_t D = 16; int64_t N = xc.numel() / D;"),
        ["-O3", "-march=native"]),
}


def timed(fn, n: int = 100) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * st.median(ts)


x = torch.randn(N, H, D, requires_grad=True)
w = torch.randn(D, requires_grad=True)
b = torch.randn(D, requires_grad=True)
gy = torch.randn(N, H, D)


def ref() -> torch.Tensor:
    return F.layer_norm(x, (D,), w, b)


def fwd_bwd(f):
    return lambda: f().backward(gy)


for i, (label, (code, flags)) in enumerate(BUILDS.items()):
    t0 = time.perf_counter()
    ext = load_inline(f"normlab_ln_probe{i}", cpp_sources=code, functions=["fwd", "bwd"],
                      extra_cflags=flags)
    built = time.perf_counter() - t0

    class CppLN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, ext=ext):
            y, mean, rstd = ext.fwd(x, w, b, 1e-5)
            ctx.save_for_backward(x, w, mean, rstd)
            return y

        @staticmethod
        def backward(ctx, g, ext=ext):
            return (*ext.bwd(g, *ctx.saved_tensors), None)

    def cpp() -> torch.Tensor:
        return CppLN.apply(x, w, b)

    torch.testing.assert_close(cpp(), ref(), atol=1e-5, rtol=1e-5)
    for a, c in zip(torch.autograd.grad(ref(), (x, w, b), gy),
                    torch.autograd.grad(cpp(), (x, w, b), gy), strict=True):
        torch.testing.assert_close(c, a, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        f_ref, f_cpp = timed(ref), timed(cpp)
    fb_ref, fb_cpp = timed(fwd_bwd(ref)), timed(fwd_bwd(cpp))
    print(f"{threads} thread(s), {label} (built/loaded in {built:.1f} s): forward "
          f"F.layer_norm {f_ref:.0f} us, C++ {f_cpp:.0f} us; forward + backward "
          f"{fb_ref:.0f} us, C++ {fb_cpp:.0f} us")
