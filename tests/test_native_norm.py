"""The native CPU norm kernel against torch's own LayerNorm / RMSNorm (the independent truth).

Every width path of native_norm.c is exercised: 16 and 64 (the inlined eight-row copies), 24
(the generic eight-row loop), 13 (the per-row loop), 264 (eight-row forward, per-row backward:
too many gain sums for registers), with row counts that leave a tail of rows after the last
full block of eight, on one and two threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from normlab import ModelConfig, build_model
from normlab.model import native_norm
from normlab.model.attention import HeadNorm
from normlab.model.norms import Norm

pytestmark = pytest.mark.skipif(native_norm.load() is None, reason="no C compiler here")


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def torch_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, center: bool):
    """torch's own ops; in float64 the truth both float32 implementations are measured by."""
    if center:
        return F.layer_norm(x, w.shape, w, b, 1e-5)
    y = F.rms_norm(x, w.shape, w, 1e-5)
    return y if b is None else y + b  # the kernel's RMSNorm takes a bias too


def as_double(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def run_python(code: str, **env: str) -> None:
    """Run `code` in a fresh interpreter with these environment variables; it must succeed."""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def grads(fn, x, w, b, gy) -> list[torch.Tensor]:
    ins = [t for t in (x, w, b) if t is not None]
    return list(torch.autograd.grad(fn(x, w, b), ins, gy))


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("center", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("d", [16, 64, 24, 13, 264])
def test_matches_torch_forward_and_backward(
    d: int, bias: bool, center: bool, n_threads: int, threads: None
) -> None:
    torch.set_num_threads(n_threads)
    torch.manual_seed(d)
    n = 2 * native_norm.ROWS_PER_THREAD + 5  # two threads' worth, and a ragged tail
    x = (torch.randn(n, d) * 3 + 1).requires_grad_()
    w = torch.randn(d).requires_grad_()
    b = torch.randn(d).requires_grad_() if bias else None
    gy = torch.randn(n, d)
    xd, wd, bd = as_double(x, w, b)
    ours = native_norm.norm(x, w, b, 1e-5, center)
    truth = torch_norm(xd, wd, bd, center)
    torch_f32 = torch_norm(x, w, b, center)  # how far float32 rounding alone moves it
    assert (ours - truth).abs().max() < 4 * (torch_f32 - truth).abs().max() + 1e-6
    g_ours = grads(lambda *a: native_norm.norm(*a, 1e-5, center), x, w, b, gy)
    g_true = grads(lambda *a: torch_norm(*a, center), xd, wd, bd, gy.double())
    for go, gt in zip(g_ours, g_true, strict=True):
        assert go.dtype == torch.float32
        torch.testing.assert_close(go.double(), gt, rtol=1e-4, atol=1e-4 * gt.abs().max())


def test_statistics_and_gain_sums_by_hand() -> None:
    """One row done by hand: mean 2.5, rstd 1/sqrt(1.25 + eps); gain grad = sum g * xhat."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 1030, requires_grad=True)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    b = torch.zeros(4, requires_grad=True)
    y = native_norm.norm(x, w, b, 1e-5, True)
    xhat = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / (1.25 + 1e-5) ** 0.5
    torch.testing.assert_close(y[0], xhat * w.detach())
    y.sum().backward()
    torch.testing.assert_close(w.grad, 1030 * xhat, rtol=1e-4, atol=1e-4)  # float32 sums
    torch.testing.assert_close(b.grad, torch.full((4,), 1030.0))


def test_strided_input_and_gradient() -> None:
    """A transposed x and a transposed incoming gradient (as attention's backward gives)."""
    torch.manual_seed(0)
    base = torch.randn(64, 17, 4, 16)
    x = base.transpose(1, 2).requires_grad_()  # not contiguous
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    gy = torch.randn(64, 17, 4, 16).transpose(1, 2)  # strided: the kernel's gx reuses a copy
    gy_before = gy.clone()
    y = native_norm.norm(x, w, b, 1e-5, True)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
    g = grads(lambda *a: native_norm.norm(*a, 1e-5, True), x, w, b, gy)
    g_ref = grads(lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-5), x, w, b, gy)
    for go, gr in zip(g, g_ref, strict=True):
        torch.testing.assert_close(go, gr, rtol=1e-4, atol=1e-4)
    assert not gy.is_contiguous()
    assert torch.equal(gy, gy_before), "the incoming gradient itself is not overwritten"
    gy = gy.contiguous()  # a contiguous one is read in place, and must be left as it was too
    gy_before = gy.clone()
    grads(lambda *a: native_norm.norm(*a, 1e-5, True), x, w, b, gy)
    assert torch.equal(gy, gy_before)


@pytest.mark.parametrize("center", [True, False], ids=["layer", "rms"])
def test_double_backward_goes_through_torch_ops(center: bool) -> None:
    """create_graph=True gives a differentiable gradient (a gradient penalty works)."""
    torch.manual_seed(0)
    x = torch.randn(1100, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    gy = torch.randn(1100, 16)

    def penalty(fn) -> list[torch.Tensor]:
        first = torch.autograd.grad((fn(x, w, b) * gy).sum(), (x, w, b), create_graph=True)
        second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), (x, w, b),
                                     allow_unused=True, materialize_grads=True)
        return [*first, *second]

    ours = penalty(lambda *a: native_norm.norm(*a, 1e-5, center))
    ref = penalty(lambda *a: torch_norm(*a, center))
    for go, gr in zip(ours, ref, strict=True):
        torch.testing.assert_close(go, gr, rtol=1e-3, atol=1e-4 * gr.abs().max().item())


def test_applies_only_where_it_pays() -> None:
    big, w = torch.randn(4096, 16), torch.ones(16)
    assert native_norm.applies(big, w)
    assert not native_norm.applies(torch.randn(17, 16), w)  # a batch-1 forward
    n_grad = native_norm.MIN_ROWS[True] - 1
    assert native_norm.applies(torch.randn(n_grad, 16), w)  # no autograd: the lower bar
    assert not native_norm.applies(torch.randn(n_grad, 16, requires_grad=True), w)
    wide = torch.randn(4096, 64)
    assert native_norm.applies(wide, torch.ones(64))
    assert not native_norm.applies(wide.requires_grad_(), torch.ones(64))  # MAX_GRAD_WIDTH
    assert not native_norm.applies(big.double(), w.double())
    assert not native_norm.applies(big.bfloat16(), w.bfloat16())
    assert not native_norm.applies(torch.randn(4096, 0), torch.ones(0))  # empty rows
    assert not native_norm.applies(torch.tensor(1.0), torch.ones(1))
    assert native_norm.describe().startswith("on (")
    native_norm.set_enabled(False)
    try:
        assert not native_norm.applies(big, w)
        assert native_norm.describe() == "off (torch's kernels)"
    finally:
        native_norm.set_enabled(True)


@pytest.mark.parametrize("placement", ["pre", "qkv"])
@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_model_same_with_and_without_kernel(
    placement: str, norm_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's training loss and gradients, and its eval forward, kernel on vs off.

    Training sends the 16-float head rows to the kernel and keeps torch's for the 64-float
    block norms (MAX_GRAD_WIDTH); without autograd every norm takes the kernel.
    """
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_heads=4, n_layers=2, norm_placement=placement,
                      norm_type=norm_type, max_len=24, norm_gain_offset=norm_type == "rms")
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (80, 17))  # 1360 rows: above both bars
    calls: list[int] = []
    forward = native_norm._forward
    monkeypatch.setattr(native_norm, "_forward", lambda x, *a: calls.append(x.shape[-1])
                        or forward(x, *a))

    def train() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def evaluate() -> torch.Tensor:
        with torch.no_grad():
            return model(tokens)

    loss_on, g_on = train()
    heads = [m for m in model.modules() if isinstance(m, HeadNorm)]
    assert calls == [16] * len(heads)
    calls.clear()
    out_on = evaluate()
    assert sorted(calls) == sorted(m.w.shape[0] for m in model.modules() if isinstance(m, Norm))
    native_norm.set_enabled(False)
    try:
        loss_off, g_off = train()
        out_off = evaluate()
    finally:
        native_norm.set_enabled(True)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_on, g_off, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(out_on, out_off, rtol=1e-5, atol=1e-5)


def test_no_compiler_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_norm, "_tried", False)
    monkeypatch.setattr(native_norm, "_lib", None)
    with pytest.warns(RuntimeWarning, match="could not compile native_norm.c"):
        assert native_norm.load() is None
    assert native_norm.describe().startswith("unavailable")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every call
        assert native_norm.load() is None
        x = torch.randn(4096, 16)
        assert not native_norm.applies(x, torch.ones(16))
        norm = Norm(16)
        torch.testing.assert_close(norm(x), F.layer_norm(x, (16,), norm.w, norm.b))
    with pytest.raises(RuntimeError, match="kernel is not built"):
        native_norm.norm(x, torch.ones(16), None, 1e-5, True)


def test_unwritable_cache_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NORMLAB_CACHE", str(blocker))
    monkeypatch.setattr(native_norm, "_tried", False)
    monkeypatch.setattr(native_norm, "_lib", None)
    with pytest.warns(RuntimeWarning, match="NORMLAB_CACHE to a writable folder"):
        assert native_norm.load() is None


def test_build_is_cached_and_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(native_norm, "_tried", False)
    monkeypatch.setattr(native_norm, "_lib", None)
    assert native_norm.load() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", "one library, no temporary left"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_norm, "_tried", False)
    assert native_norm.load() is not None
    assert built[0].stat().st_mtime_ns == stamp, "found in the cache, not rebuilt"
    # another source (or flags, compiler, CPU) is another file
    other = native_norm._compile(native_norm.compiler(), ("-O1",), native_norm.SOURCE.read_bytes())
    assert other is not None and other != built[0]


@pytest.mark.parametrize(("value", "on"), [("0", False), ("false", False), ("1", True),
                                           ("", True)])
def test_env_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("NORMLAB_NATIVE_NORM", value)
    assert native_norm._enabled_by_env() is on


def test_env_switch_turns_the_kernel_off_in_a_new_process() -> None:
    """NORMLAB_NATIVE_NORM=0 set before normlab is imported: no norm reaches the kernel."""
    code = (
        "import torch\n"
        "from normlab.model import native_norm\n"
        "from normlab.model.norms import Norm\n"
        "native_norm.norm = None  # any call into the kernel's path would fail\n"
        "assert native_norm.describe() == \"off (torch's kernels)\"\n"
        "Norm(16)(torch.randn(4096, 16))\n"
    )
    run_python(code, NORMLAB_NATIVE_NORM="0")


def test_torch_compile_traces_torchs_norm() -> None:
    """Under torch.compile the kernel (a ctypes call dynamo cannot trace) steps aside."""
    torch.manual_seed(0)
    norm = Norm(16)
    x = torch.randn(4096, 16, requires_grad=True)
    assert native_norm.applies(x, norm.w)
    compiled = torch.compile(norm, fullgraph=True)  # a graph break would raise here
    torch.testing.assert_close(compiled(x), F.layer_norm(x, (16,), norm.w, norm.b))


def test_small_inputs_keep_torchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 forward's norms never reach the kernel (torch's call is faster there)."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("small input sent to the native kernel")

    monkeypatch.setattr(native_norm, "norm", refuse)
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=64, n_heads=4, n_layers=2, norm_placement="qkv"))
    tokens = torch.randint(0, 16, (1, 17))
    model(tokens).sum().backward()
    with torch.no_grad():
        model(tokens)
    with pytest.raises(AssertionError, match="small input"):
        model(torch.randint(0, 16, (80, 17)))  # 1360 rows: this one does


@pytest.mark.parametrize("n_threads", [1, 2])
def test_bitwise_deterministic(n_threads: int, threads: None) -> None:
    """Same inputs, same threads, same bits (training resumes exactly, tests/test_train.py)."""
    torch.set_num_threads(n_threads)
    torch.manual_seed(0)
    x = torch.randn(4099, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    gy = torch.randn(4099, 16)
    runs = [grads(lambda *a: native_norm.norm(*a, 1e-5, True), x, w, b, gy) for _ in range(3)]
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again, strict=True))


def test_portable_build_without_avx2(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Built with plain -O3 (no -march=native, so no AVX2 on x86-64), as on a CPU without it:
    every width takes the per-row loop, with the same numbers."""
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(native_norm, "FLAG_SETS", (("-O3",),))
    monkeypatch.setattr(native_norm, "_tried", False)
    monkeypatch.setattr(native_norm, "_lib", None)
    monkeypatch.setattr(native_norm, "built_with", None)
    built = native_norm.describe()
    assert built.startswith("on (-O3, "), built
    torch.manual_seed(0)
    x = torch.randn(1031, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    gy = torch.randn(1031, 16)
    ours = grads(lambda *a: native_norm.norm(*a, 1e-5, True), x, w, b, gy)
    ref = grads(lambda *a: torch_norm(*a, True), x, w, b, gy)
    for go, gr in zip(ours, ref, strict=True):
        torch.testing.assert_close(go, gr, rtol=1e-4, atol=1e-4)
    if "per-row" not in built:  # e.g. a compiler whose default target already has AVX2
        pytest.skip(f"plain -O3 built the eight-row path here: {built}")


def test_bad_shapes_get_torchs_error_not_garbage() -> None:
    """A wrong-width input or a wrong-shape bias raises torch's usual error, kernel on or off."""
    norm = Norm(16)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"expected input with shape"):
        norm(torch.randn(4096, 32))
    x = torch.randn(4096, 16)
    with pytest.raises(RuntimeError):
        native_norm.norm(x, torch.ones(16), torch.zeros(8), 1e-5, True)
    with pytest.raises(RuntimeError):
        native_norm.norm(x, torch.ones(8), None, 1e-5, True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_tracers_and_transforms_get_torchs_norm() -> None:
    """jit.trace, fx and vmap never see the ctypes call (it would not be recorded)."""
    torch.manual_seed(0)
    norm = Norm(16)
    x, x2 = torch.randn(4096, 16), torch.randn(4096, 16) * 3
    with torch.no_grad():
        traced = torch.jit.trace(norm, x)
        torch.testing.assert_close(traced(x2), F.layer_norm(x2, (16,), norm.w, norm.b))
    fx = torch.fx.symbolic_trace(norm)
    torch.testing.assert_close(fx(x2), F.layer_norm(x2, (16,), norm.w, norm.b))
    batched = torch.func.vmap(norm)(x2.reshape(4, 1024, 16))
    torch.testing.assert_close(batched.reshape(4096, 16), F.layer_norm(x2, (16,), norm.w, norm.b))


def test_compiler_with_arguments_and_a_damaged_cache(monkeypatch: pytest.MonkeyPatch, tmp_path
                                                     ) -> None:
    """`CC="env cc"` (a launcher, as `ccache gcc`) builds; a damaged cached file is rebuilt."""
    monkeypatch.setenv("CC", "env cc")
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    src = native_norm.SOURCE.read_bytes()
    built = native_norm._compile(native_norm.compiler(), native_norm.FLAG_SETS[0], src)
    assert built is not None and built.read_bytes()[:4] == b"\x7fELF"
    built.write_bytes(b"not a shared library")  # damaged before any process loads it
    monkeypatch.setattr(native_norm, "_tried", False)
    monkeypatch.setattr(native_norm, "_lib", None)
    monkeypatch.setattr(native_norm, "built_with", None)
    assert native_norm.load() is not None
    assert native_norm.built_with == native_norm.FLAG_SETS[0]
    assert built.read_bytes()[:4] == b"\x7fELF", "rebuilt in place"


def test_fewer_openmp_threads_than_asked() -> None:
    """OpenMP may give fewer threads than asked (OMP_THREAD_LIMIT): the sums still add up."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from normlab.model import native_norm\n"
        "torch.set_num_threads(2); torch.manual_seed(0)\n"
        "assert native_norm._threads(4099) == 2\n"
        "x = torch.randn(4099, 16, requires_grad=True)\n"
        "w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)\n"
        "gy = torch.randn(4099, 16)\n"
        "a = torch.autograd.grad(native_norm.norm(x, w, b, 1e-5, True), (x, w, b), gy)\n"
        "r = torch.autograd.grad(F.layer_norm(x, (16,), w, b, 1e-5), (x, w, b), gy)\n"
        "for u, v in zip(a, r): torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)\n"
    )
    run_python(code, OMP_THREAD_LIMIT="1")
