"""linear_cross_entropy fused on the GPU (marker ``gpu``; needs Hopper).

Loss and gradients (dh, dW, dbias, drstd) of every option against float64 (the textbook
math on the bf16 inputs): err(coda) <= 2 * err(eager bf16 PyTorch) + atol, eager being
the unfused bf16 pipeline (bf16 logits, then the loss). Both paths: the recompute one
(``grad_in_forward=False``; vocabulary chunked and not) and the gradient-in-forward one
(``grad_in_forward=True``; one row chunk or several, the acc stored in bf16 or fp32), each
checked to be the path that ran. Vocabulary sizes of real models (ragged: 50257 is odd).
Peak memory: the workspace (peak minus the gradient buffers) of each path stays under
its bound from ``coda.fusions.ce_chunks``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.errors import InputError  # noqa: E402
from coda.fusions import ce_chunks, ce_fused  # noqa: E402
from coda.fusions.ce_epilogues import row_scaled_epilogue, weighted_colsum_epilogue  # noqa: E402
from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402
from coda.testing.tolerance import assert_close_to_reference  # noqa: E402

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
GiB = 2**30


def textbook_logits(h, W, bias=None, rstd=None, softcap=None, temperature=1.0):
    """The materialized logits in the inputs' dtype."""
    logits = h @ W.T
    if rstd is not None:
        logits = logits * rstd[:, None].to(logits.dtype)
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def textbook(h, W, target, bias=None, rstd=None, softcap=None, label_smoothing=0.0,
             z_loss=0.0, reduction="mean", num_items_in_batch=None, temperature=1.0,
             row_weight=None, loss_dtype=None):  # fmt: skip
    """The loss over materialized logits; ``loss_dtype``: the logits cast to it first
    (fp32: eager fp16 as autocast runs it, whose fp16 label-smoothing sum over a 50k
    vocabulary overflows)."""
    logits = textbook_logits(h, W, bias, rstd, softcap, temperature)
    if loss_dtype is not None:
        logits = logits.to(loss_dtype)
    rows = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)
    valid = target != -100
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(logits.float(), -1).to(rows.dtype) ** 2 * valid
    if row_weight is not None:
        rows = rows * row_weight.to(rows.dtype)
    if reduction == "none":
        return rows
    if num_items_in_batch is not None:
        return rows.sum() / num_items_in_batch
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum().clamp(min=1)


def inputs(M, H, V, seed, bias=False, rstd=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(M, H, device="cuda", generator=g).to(BF16)
    W = (torch.randn(V, H, device="cuda", generator=g) * 2 / H**0.5).to(BF16)
    b = (0.5 * torch.randn(V, device="cuda", generator=g)).to(BF16) if bias else None
    r = (0.5 + torch.rand(M, device="cuda", generator=g)) if rstd else None
    target = torch.randint(0, V, (M,), device="cuda", generator=g)
    target[torch.rand(M, device="cuda", generator=g) < 0.2] = -100
    return h, W, b, r, target


def grads_of(fn, tensors, target, dtype, upstream, **opts):
    # rstd stays fp32 (the op's contract) except in the float64 truth
    dtypes = (dtype, dtype, dtype, F64 if dtype == F64 else torch.float32)
    leaves = [
        None if t is None else t.detach().to(d).requires_grad_()
        for t, d in zip(tensors, dtypes, strict=True)
    ]
    h, W, b, r = leaves
    loss = fn(h, W, target, bias=b, rstd=r, **opts)
    wrt = [t for t in leaves if t is not None]
    up = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
    return (loss, *torch.autograd.grad(loss, wrt, up))


def _coda(h, W, target, **opts):
    return linear_cross_entropy(h, W, target, **opts)


OPTIONS = {
    "plain": {},
    "smoothing_zloss": dict(label_smoothing=0.1, z_loss=1e-4),
    "softcap": dict(softcap=30.0),
    "bias_rstd": dict(bias=True, rstd=True),
    # the shifted softmax with the rstd gradient taken from dh (no bias: ce_fused.shifted_ok)
    "rstd_zloss": dict(rstd=True, z_loss=1e-4),
    "all_none": dict(
        bias=True, rstd=True, softcap=15.0, label_smoothing=0.05, z_loss=1e-4, reduction="none"
    ),
    "all_sum": dict(
        bias=True, rstd=True, softcap=15.0, label_smoothing=0.05, z_loss=1e-4, reduction="sum"
    ),
    "num_items": dict(num_items_in_batch=100, z_loss=1e-4),
    # folds into the row scale, the bias and the cap: no kernel of its own
    "temperature": dict(temperature=0.7),
    "temperature_all": dict(bias=True, rstd=True, softcap=15.0, temperature=1.3, reduction="none"),
    # per-row losses without a bias gradient: the gradient-in-forward path in one row chunk
    # (the shifted softmax, with label smoothing's rank-1 terms; the map pass with softcap)
    "rstd_zloss_none": dict(rstd=True, z_loss=1e-4, reduction="none"),
    "smoothing_none": dict(label_smoothing=0.1, temperature=0.8, reduction="none"),
    "softcap_smoothing_none": dict(rstd=True, softcap=15.0, label_smoothing=0.05, reduction="none"),
    # per-token weights (row_weight=True: signed weights drawn per shape), folded into the
    # gradient-in-forward path's per-row coefficients for scalar losses
    "weighted_mean": dict(row_weight=True, z_loss=1e-4),
    "weighted_all_sum": dict(
        rstd=True, softcap=15.0, label_smoothing=0.05, row_weight=True, reduction="sum"
    ),
    "weighted_none": dict(rstd=True, row_weight=True, reduction="none"),
}
SHAPES = [(512, 256, 1000), (300, 264, 50257), (1000, 512, 32000), (257, 128, 151936)]
# path -> the keyword arguments that force it (chunking: None = automatic)
PATHS = {
    "recompute": dict(grad_in_forward=False),
    "recompute_chunked": dict(grad_in_forward=False, chunk_size=4096),
    "fused": dict(grad_in_forward=True),
    "fused_rows128": dict(grad_in_forward=True, chunk_rows=128),  # 2 to 8 row chunks
    # the gradient's map pass where the default takes the shifted softmax (GRAD_PASS)
    "fused_map": dict(grad_in_forward=True, chunk_rows=128, grad_pass="map"),
    "fused_acc32": dict(grad_in_forward=True, chunk_rows=128, acc_dtype=torch.float32),
}


class MapPasses:
    """Counts the gradient-in-forward path's map passes over the logits (one per row
    chunk; not the shifted path's row-scaled h, ``row_scaled_epilogue``, nor per-row
    losses' dbias pass, ``weighted_colsum_epilogue``)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = ce_fused.run_map
        row_scaled = {row_scaled_epilogue(d) for d in (BF16, torch.float16)}
        row_scaled |= {weighted_colsum_epilogue(d) for d in (BF16, torch.float16)}

        def counted(*args, **kwargs):
            self.n += args[0] not in row_scaled
            return real(*args, **kwargs)

        monkeypatch.setattr(ce_fused, "run_map", counted)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_matches_float64_no_worse_than_eager_bf16(name, shape, path, monkeypatch):
    opts = dict(OPTIONS[name])
    kwargs = dict(PATHS[path])
    fused = kwargs["grad_in_forward"]
    if fused and opts.get("reduction") == "none" and "chunk_rows" in kwargs:
        pytest.skip("per-row losses run the gradient-in-forward path in one row chunk")
    monkeypatch.setattr(ce_fused, "ACC_STORE_DTYPE", kwargs.pop("acc_dtype", None))
    monkeypatch.setattr(ce_fused, "GRAD_PASS", kwargs.pop("grad_pass", "auto"))
    passes = MapPasses(monkeypatch)
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    shifted = fused and ce_fused.shifted_ok(
        BF16, bias, opts.get("softcap"), opts.get("label_smoothing", 0.0), True, True, rstd
    )
    M, H, V = shape
    tensors = inputs(M, H, V, seed=M + V, bias=bias, rstd=rstd)
    target = tensors[-1]
    tensors = tensors[:-1]
    if opts.get("row_weight"):  # 0 on ignored rows
        g = torch.Generator(device="cuda").manual_seed(M)
        if opts.get("reduction") == "none":  # signed, like advantages
            weight = torch.randn(M, device="cuda", generator=g)
        else:  # positive: a signed weighted sum cancels (~0.03 of terms ~12), and the
            # bf16 logits' rounding of each row's loss (eager's too) stays in absolute terms
            weight = 0.5 + torch.rand(M, device="cuda", generator=g)
        opts["row_weight"] = weight * (target != -100)
    upstream = None
    if opts.get("reduction") == "none":
        upstream = torch.randn(M, device="cuda")
    ours = grads_of(_coda, tensors, target, BF16, upstream, **kwargs, **opts)
    chunks = -(-M // kwargs.get("chunk_rows", M)) if fused and not shifted else 0
    assert passes.n == chunks, (passes.n, chunks)  # the path asked for is the one that ran
    truth = grads_of(textbook, tensors, target, F64, upstream, **opts)
    eager = grads_of(textbook, tensors, target, BF16, upstream, **opts)
    _assert_like_float64(ours, truth, eager, bias, rstd)


@pytest.mark.parametrize("path", ["fused", "recompute"])
@pytest.mark.parametrize("name", ["all_none", "rstd_zloss_none", "weighted_none"])
def test_per_row_losses_under_an_expanded_upstream_gradient(name, path):
    """``loss.sum().backward()`` of per-row losses: the upstream gradient is one value
    expanded over the rows (stride 0), which the backward GEMMs' row factors take only as
    contiguous vectors (the gradient-in-forward path raised "'row_scale' must be a
    contiguous vector" until its per-row g was made contiguous)."""
    opts = dict(OPTIONS[name])
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = 300, 264, 50257
    *tensors, target = inputs(M, H, V, seed=3, bias=bias, rstd=rstd)
    if opts.get("row_weight"):
        weight = torch.randn(M, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
        opts["row_weight"] = weight * (target != -100)
    upstream = torch.full((), 0.75, device="cuda").expand(M)
    ours = grads_of(_coda, tensors, target, BF16, upstream, **PATHS[path], **opts)
    truth = grads_of(textbook, tensors, target, F64, upstream, **opts)
    eager = grads_of(textbook, tensors, target, BF16, upstream, **opts)
    _assert_like_float64(ours, truth, eager, bias, rstd)


@pytest.mark.parametrize(
    "name",
    ["plain", "smoothing_zloss", "softcap", "bias_rstd", "all_none", "rstd_zloss",
     "num_items", "rstd_zloss_none", "softcap_smoothing_none", "weighted_mean"],
)  # fmt: skip
def test_fp16_matches_float64_no_worse_than_eager_fp16(name, monkeypatch):
    """fp16 h and W on a ragged vocabulary (the gradient-in-forward path without the
    1 / denom, ``ce_fused.UNSCALED_DTYPES``, one map pass; with a bias gradient the
    recompute path, ``cross_entropy.FP16_WHY``: none), against float64 by the 2 x
    eager-fp16 rule (eager as autocast runs it: fp16 logits, the loss in fp32)."""
    opts = dict(OPTIONS[name])
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = 1000, 256, 50257
    *tensors, target = inputs(M, H, V, seed=5, bias=bias, rstd=rstd)
    if opts.get("row_weight"):  # positive, 0 on ignored rows (as the bf16 test's mean)
        g = torch.Generator(device="cuda").manual_seed(M)
        opts["row_weight"] = (0.5 + torch.rand(M, device="cuda", generator=g)) * (target != -100)
    upstream = torch.randn(M, device="cuda") if opts.get("reduction") == "none" else None
    passes = MapPasses(monkeypatch)
    ours = grads_of(_coda, tensors, target, F16, upstream, **opts)
    assert passes.n == (0 if bias else 1), passes.n  # the path meant is the one that ran
    truth = grads_of(textbook, tensors, target, F64, upstream, **opts)
    eager = grads_of(textbook, tensors, target, F16, upstream, loss_dtype=F32, **opts)
    _assert_like_float64(ours, truth, eager, bias, rstd)


@pytest.mark.parametrize(
    "opts", [{}, {"grad_in_forward": False}], ids=["grad_in_forward", "recompute"]
)
def test_fp16_under_a_loss_scale_no_worse_than_eager_amp(opts):
    """fp16 training scales the loss (``GradScaler``): at 3700 tokens and V = 128256 the
    unscaled dlogits, softmax / tokens ~ 2e-9, are under fp16's smallest subnormal.
    With the loss times 2^16 and the gradients divided back, coda's stay within 2 x the
    error of eager fp16 as autocast runs it (fp16 logits, the loss in fp32): on the
    default path (two row chunks of 2048 here, the gradients formed without the 1 / denom
    and scaled in the backward) and on the recompute path."""
    M, H, V, scale = 4096, 256, 128256, 2.0**16
    *tensors, target = inputs(M, H, V, seed=6)
    h, W = tensors[0].to(F16), tensors[1].to(F16)
    runs = {}
    for key, fn, dtype in (
        ("coda", lambda a, b, t: linear_cross_entropy(a, b, t, **opts), F16),
        ("eager", lambda a, b, t: F.cross_entropy((a @ b.T).float(), t), F16),
        ("truth", lambda a, b, t: F.cross_entropy(a @ b.T, t), F64),
    ):
        a, b = (x.detach().to(dtype).requires_grad_() for x in (h, W))
        loss = fn(a, b, target)
        grads = torch.autograd.grad(loss.float() * scale, (a, b))
        runs[key] = (loss.detach(), *(x.double() / scale for x in grads))
        del a, b, loss, grads
    _assert_like_float64(runs["coda"], runs["truth"], runs["eager"], False, False)


def _loss_and_grads(h, W, target, bias=None, rstd=None, **opts):
    """(loss, grads of h, W[, bias][, rstd]) of ``linear_cross_entropy`` on these very
    tensors (leaves as given: their strides and dtypes kept)."""
    leaves = [t for t in (h, W, bias, rstd) if t is not None]
    loss = linear_cross_entropy(h, W, target, bias=bias, rstd=rstd, **opts)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def _leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_()


@pytest.mark.parametrize("case", ["W_transposed_view", "expanded_bias_rstd", "autocast"])
def test_operands_as_users_hold_them(case):
    """A transposed view of W (an N-major (V, H) tensor), an expanded bias and rstd, and
    fp32 h and W (AMP's master weights) under CUDA autocast each give the loss and
    gradients of the plain call on contiguous, explicitly cast operands. (Before, the first
    two raised InputErrors naming internal tensors, and fp32 operands an engine TypeError.)"""
    M, H, V = 512, 256, 32000
    h, W, _, _, target = inputs(M, H, V, seed=9)
    if case == "W_transposed_view":
        Wt = W.t().contiguous().t()
        assert Wt.stride() == (1, V)
        got = _loss_and_grads(_leaf(h), _leaf(Wt), target)
        want = _loss_and_grads(_leaf(h), _leaf(W), target)
    elif case == "expanded_bias_rstd":
        b, r = torch.full((), 0.25, device="cuda", dtype=BF16), torch.full((), 1.5, device="cuda")
        got = _loss_and_grads(_leaf(h), _leaf(W), target, _leaf(b.expand(V)), _leaf(r.expand(M)))
        want = _loss_and_grads(
            _leaf(h), _leaf(W), target, _leaf(b.expand(V).contiguous()),
            _leaf(r.expand(M).contiguous()),
        )  # fmt: skip
    else:
        h32, W32 = _leaf(h, torch.float32), _leaf(W, torch.float32)
        with torch.autocast("cuda", dtype=BF16):
            got = _loss_and_grads(h32, W32, target, z_loss=1e-4)
        assert all(g.dtype == torch.float32 for g in got)
        want = _loss_and_grads(_leaf(h), _leaf(W), target, z_loss=1e-4)
    for a, b in zip(got, want, strict=True):  # the split-K dh sums its splits in any order
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-3, atol=1e-5, msg=case)


def test_fp32_operands_and_empty_batches_on_the_gpu():
    """fp32 h and W outside autocast: a TypeError naming the op before any launch; an
    empty batch: zero loss and zero gradients of the inputs' shapes, both paths."""
    h, W, _, _, target = inputs(64, 128, 1000, seed=10)
    with pytest.raises(TypeError, match="linear_cross_entropy: on a Hopper GPU"):
        linear_cross_entropy(h.float(), W.float(), target)
    for path in PATHS.values():
        opts = {k: v for k, v in path.items() if k == "grad_in_forward"}
        loss, dh, dW = _loss_and_grads(_leaf(h[:0]), _leaf(W), target[:0], **opts)
        assert loss.item() == 0 and dh.shape == (0, 128) and dW.shape == W.shape
        assert not dW.any()


def _assert_like_float64(ours, truth, eager, bias: bool, rstd: bool) -> None:
    """(loss, dh, dW[, dbias][, drstd]) finite and against float64 by the 2 x eager-bf16
    rule (atol 1e-3)."""
    names = ["loss", "dh", "dW"] + (["dbias"] if bias else []) + (["drstd"] if rstd else [])
    for n, a, t, e in zip(names, ours, truth, eager, strict=True):
        assert torch.isfinite(a).all(), n
        assert_close_to_reference(a, t, name=n, baseline=e, atol=1e-3, floor=1e-3)


def _ragged_vocab_problem():
    """V = 50257 (GPT-2: 50256 fused columns + a 1-column tail in torch), 1000 x 256 h,
    every option: (tensors, target, opts, float64 truth, eager bf16) of loss and grads."""
    M, H, V = 1000, 256, 50257
    opts = dict(softcap=15.0, label_smoothing=0.05, z_loss=1e-4)
    tensors = inputs(M, H, V, seed=7, bias=True, rstd=True)
    target, tensors = tensors[-1], tensors[:-1]
    truth = grads_of(textbook, tensors, target, F64, None, **opts)
    eager = grads_of(textbook, tensors, target, BF16, None, **opts)
    return tensors, target, opts, truth, eager


def _assert_like(got, other, truth, eager, label: str) -> None:
    """Loss and gradients ``got`` against float64 by the 2 x eager rule, and as close to
    float64 as ``other`` (another coda run of the same problem, named ``label``)."""
    names = ["loss", "dh", "dW", "dbias", "drstd"]
    for n, a, b, t, e in zip(names, got, other, truth, eager, strict=True):
        assert torch.isfinite(a).all(), n
        assert_close_to_reference(a, t, name=n, baseline=e, atol=1e-3, floor=1e-3)
        assert_close_to_reference(a, t, name=f"{n} vs {label}", baseline=b, atol=1e-4,
                                  floor=1e-3)  # fmt: skip


def test_grad_in_forward_several_row_chunks_ragged_vocab(monkeypatch):
    """V = 50257 (GPT-2: 50256 fused columns + a 1-column tail in torch), 1000 rows in
    chunks of 256 (the last 232): loss and every gradient against float64 by the 2 x
    eager rule, as close to float64 as the one-chunk run is (4 map passes, all in the
    forward; the backward runs the last chunk's dh and dW GEMMs)."""
    tensors, target, opts, truth, eager = _ragged_vocab_problem()
    M = tensors[0].shape[0]
    passes = MapPasses(monkeypatch)
    many = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=256,
                    **opts)  # fmt: skip
    assert passes.n == 4
    one = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=M, **opts)
    _assert_like(many, one, truth, eager, "one chunk")


def test_stats_map_pass_option(monkeypatch):
    """``ce_fused.STATS_PASS = "map"`` (the logits GEMM plain, its statistics from a map
    pass over the stored acc) on the ragged problem above, in row chunks: loss and every
    gradient against float64 by the 2 x eager rule and as close to float64 as the default
    (statistics in the logits GEMM's epilogue), two map passes per chunk."""
    tensors, target, opts, truth, eager = _ragged_vocab_problem()
    default = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=256,
                       **opts)  # fmt: skip
    monkeypatch.setattr(ce_fused, "STATS_PASS", "map")
    passes = MapPasses(monkeypatch)
    got = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=256,
                   **opts)  # fmt: skip
    assert passes.n == 8
    _assert_like(got, default, truth, eager, "default")


@pytest.mark.parametrize("stats_pass", ["epilogue", "map"])
def test_shifted_softmax_ragged_vocab(monkeypatch, stats_pass):
    """The shifted softmax (``ce_fused.GRAD_PASS``, the default without bias, softcap,
    smoothing or an rstd gradient) on V = 50257 (a 1-column tail whose targets the torch
    side handles) with z-loss, 1000 rows in chunks of 256, its statistics and R in the
    logits GEMM's epilogue or (``STATS_PASS = "map"``) in one map pass over the plain
    GEMM's stored acc: loss and gradients against float64 by the 2 x eager rule, and as
    close to float64 as the gradient's map pass (``GRAD_PASS = "map"``)."""
    M, H, V = 1000, 256, 50257
    opts = dict(z_loss=1e-4)
    tensors = inputs(M, H, V, seed=11)
    target, tensors = tensors[-1], tensors[:-1]
    target[::7] = V - 1  # the tail column
    truth = grads_of(textbook, tensors, target, F64, None, **opts)
    eager = grads_of(textbook, tensors, target, BF16, None, **opts)
    monkeypatch.setattr(ce_fused, "GRAD_PASS", "map")
    mapped = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=256,
                      **opts)  # fmt: skip
    monkeypatch.setattr(ce_fused, "GRAD_PASS", "shifted")
    monkeypatch.setattr(ce_fused, "STATS_PASS", stats_pass)
    passes = MapPasses(monkeypatch)
    got = grads_of(_coda, tensors, target, BF16, None, grad_in_forward=True, chunk_rows=256,
                   **opts)  # fmt: skip
    assert passes.n == (4 if stats_pass == "map" else 0)
    for n, a, b, t, e in zip(["loss", "dh", "dW"], got, mapped, truth, eager, strict=True):
        assert torch.isfinite(a).all(), n
        assert_close_to_reference(a, t, name=n, baseline=e, atol=1e-3, floor=1e-3)
        assert_close_to_reference(a, t, name=f"{n} vs map", baseline=b, atol=1e-4, floor=1e-3)


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_frozen_head_all_ignored_and_checked_targets(grad_in_forward):
    h, W, _, _, target = inputs(256, 128, 1000, seed=1)
    hl = h.clone().requires_grad_()
    loss = linear_cross_entropy(hl, W, target, grad_in_forward=grad_in_forward)
    loss.backward()
    assert hl.grad is not None and W.grad is None
    ignored = torch.full_like(target, -100)
    hl.grad = None
    loss = linear_cross_entropy(hl, W.requires_grad_(), ignored, grad_in_forward=grad_in_forward)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hl.grad.any() and not W.grad.any()
    bad = target.clone()
    bad[7] = 1000
    with pytest.raises(InputError, match=r"target\[7\] = 1000"):
        linear_cross_entropy(h, W, bad, check=True)


def _workspace(**kwargs) -> tuple[float, int, int, int]:
    """(workspace bytes, M, V, H) of forward + backward at M = 8192, H = 2048, V = 128256
    (Llama 3): the peak above the inputs minus the gradients dh and dW that any
    implementation returns."""
    M, H, V = 8192, 2048, 128256
    h, W, _, _, target = inputs(M, H, V, seed=0)
    h.requires_grad_()
    W.requires_grad_()
    linear_cross_entropy(h, W, target, **kwargs).backward()  # compile and warm up
    h.grad = W.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(h, W, target, **kwargs)
    dh, dW = torch.autograd.grad(loss, (h, W))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = dh.numel() * dh.element_size() + dW.numel() * dW.element_size()
    return peak - grads, M, V, H


def test_workspace_recompute_path_stays_far_below_the_logits():
    """The recompute path (``grad_in_forward=False``, the low-memory choice): workspace at
    most WORKSPACE_BYTES (the dlogits chunk) + 4 M H (the fp32 dh accumulator) + 1/16 of
    the budget (per-chunk partials) + 64 MiB (row vectors, allocator rounding),
    independent of V; the bf16 logits alone would be M V 2 = 1.96 GiB."""
    workspace, M, V, H = _workspace(grad_in_forward=False)
    bound = ce_chunks.WORKSPACE_BYTES * (1 + 1 / 16) + 4 * M * H + 64 * 2**20
    assert workspace <= bound, (workspace / GiB, bound / GiB)
    assert workspace <= M * V * 2 / 4


def test_workspace_grad_in_forward_path():
    """The gradient-in-forward path (the default in training): workspace at most
    ``ce_chunks.grad_in_forward_workspace`` + 64 MiB: ONE row buffer of rows x V bf16
    (rows = ``grad_rows``: 2048 here, 0.49 GiB; the dlogits overwrite the stored acc in
    place; the backward's GEMMs read the last chunk's dlogits from it), the fp32 V x H dW
    accumulator and dh of the rows before the last chunk (more than one row chunk: 0.98
    + 0.02 GiB), per-chunk partials and row vectors (a bound of about 1.6 GiB in all,
    below torch.compile's 1.96 GiB of logits)."""
    workspace, M, V, H = _workspace()
    rows = ce_chunks.grad_rows(M, V, 2, dw_hidden=H)
    assert rows == 2048 and len(ce_chunks.row_chunks(M, rows)) == 4
    bound = ce_chunks.grad_in_forward_workspace(M, V, H, 2, rows) + 64 * 2**20
    assert workspace <= bound, (workspace / GiB, bound / GiB)


@pytest.mark.parametrize("partial", [False, True], ids=["dh", "dW_sum"])
def test_backward_gemm_with_plain_gemm_tiles_matches_reference(partial):
    """The backward's scaled GEMM (``scaled_total_epilogue``) with ``config="gemm"`` on a
    long-running problem (6.6 TFLOP, where ``coda.gemm`` and so the fused call take a
    256-row cooperative tile): g * (A @ B.T [+ fp32 partial]) in bf16,
    against float64 within twice eager bf16's error, in the dW layout (A M-major, B
    N-major) and the dh layout (B N-major)."""
    from coda.fusions.ce_epilogues import GRAD_SCALE, PARTIAL_SUM, TOTAL
    from coda.fusions.ce_epilogues import scaled_total_epilogue as scaled
    from coda.mainloop.config import choose_config
    from coda.runtime import epilogue_kernels as ek

    g = torch.Generator(device="cuda").manual_seed(11)
    if partial:  # dW: (V', rows) @ (rows, H), both transposed views
        m, n, k = 98304, 4096, 8192
        A = torch.randn(k, m, device="cuda", generator=g).to(BF16).t()
        B = torch.randn(k, n, device="cuda", generator=g).to(BF16).t()
    else:  # dh: (rows, V') @ (V', H), B transposed
        m, n, k = 8192, 4096, 98304
        A = torch.randn(m, k, device="cuda", generator=g).to(BF16)
        B = torch.randn(k, n, device="cuda", generator=g).to(BF16).t()
    assert choose_config(
        m, n, k, torch.cuda.get_device_properties(0).multi_processor_count
    ).cooperative
    tensors = {GRAD_SCALE: torch.full((n,), 0.37, device="cuda")}
    truth = A.double() @ B.double().T
    eager = (A @ B.T).float()  # cuBLAS on the same tensor cores, rounded to bf16
    if partial:
        tensors[PARTIAL_SUM] = torch.randn(m, n, device="cuda", generator=g) * 50
        truth = truth + tensors[PARTIAL_SUM].double()
        eager = eager + tensors[PARTIAL_SUM]
    epi = scaled(BF16, partial)
    got = epi(A, B, config="gemm", **tensors)[TOTAL]
    plan = next(
        p for key, p in ek._plans.items() if key[0] is epi and key[4:] == ("gemm", m, n, k)
    )
    assert plan.config.cooperative and plan.config.tile_n >= 128, plan.config
    # Over K = 98304 the tensor cores' fp32 accumulation (cuBLAS's too) drifts from exact
    # by ~1e-3 of the partial sums, more than a bf16 rounding of small results: the rule
    # is the one of every fused test, against float64 beside eager bf16.
    assert_close_to_reference(
        got, 0.37 * truth, baseline=(0.37 * eager).to(BF16), atol=2.0**-8, floor=1.0
    )


@pytest.mark.parametrize("m", [256, 300])
def test_backward_gemm_split_k_where_its_tiles_leave_the_gpu_idle(m, monkeypatch):
    """dh of a short last row chunk (m rows, K = V'): ``_scaled_gemm`` on the plain
    GEMM's tiles runs it split-K into fp32 (``_split_config``; checked to be the config
    it launched) and finishes in torch: g * (row_scale * R @ W + rank-1 + fp32 partial),
    rounded once, against float64 within twice eager bf16's error."""
    from coda.fusions import _dispatch

    n, k = 2048, 32768
    g = torch.Generator(device="cuda").manual_seed(13)
    A = torch.randn(m, k, device="cuda", generator=g).to(BF16)
    B = (torch.randn(k, n, device="cuda", generator=g) / 16).to(BF16).t()  # W[:V'].t()
    gvec = torch.full((n,), 0.37, device="cuda")
    row_scale = torch.rand(m, device="cuda", generator=g) + 0.5
    rank = (torch.randn(m, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g))
    partial = torch.randn(m, n, device="cuda", generator=g)
    split = ce_fused._split_config(m, n, k, A.device)
    assert split is not None and split.split_k > 1
    seen = []
    matmul = _dispatch.matmul

    def spy(*args, **kwargs):
        seen.append(kwargs.get("config"))
        return matmul(*args, **kwargs)

    monkeypatch.setattr(ce_fused, "matmul", spy)
    out = torch.full((m, n), float("nan"), dtype=BF16, device="cuda")
    ce_fused._scaled_gemm(out, A, B, gvec, partial=partial, row_scale=row_scale, rank=rank)
    assert seen == [split]
    outer = rank[0].double()[:, None] * rank[1].double()
    truth = row_scale.double()[:, None] * (A.double() @ B.double().T) + outer + partial.double()
    eager = row_scale[:, None] * (A @ B.T).float() + outer.float() + partial
    assert_close_to_reference(
        out, 0.37 * truth, baseline=(0.37 * eager).to(BF16), atol=2.0**-8, floor=1.0
    )


@pytest.mark.parametrize("rows", [256, 300])
def test_small_batches_are_bitwise_reproducible_when_deterministic(rows, deterministic_algorithms):
    """A small batch's last-chunk dh splits K by default (``_split_config``, finishing
    order); under torch.use_deterministic_algorithms(True) it runs unsplit: two forward +
    backward passes give bitwise equal loss, dh and dW, within rounding of the split run."""
    H, V = 2048, 32768
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = (torch.randn(rows, H, device="cuda", generator=g) / 2).to(BF16)
    W = (torch.randn(V, H, device="cuda", generator=g) / 32).to(BF16)
    target = torch.randint(0, V, (rows,), device="cuda", generator=g)
    assert ce_fused._split_config(rows, H, V, h.device) is not None  # the default splits

    def step():
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss = linear_cross_entropy(hh, WW, target)
        loss.backward()
        return loss.detach(), hh.grad, WW.grad

    split = step()
    deterministic_algorithms()
    first, again = step(), step()
    for a, b, c in zip(first, again, split, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=1e-5)


def _with_entropy(fn):
    """``fn``'s loss plus the per-row softmax entropy: coda's ``return_entropy``, or, for
    the textbook, the entropy of the materialized logits in the inputs' dtype."""

    def run(h, W, target, bias=None, rstd=None, softcap=None, temperature=1.0, **opts):
        kw = dict(bias=bias, rstd=rstd, softcap=softcap, temperature=temperature)
        if fn is _coda:
            loss, ent = linear_cross_entropy(h, W, target, return_entropy=True, **kw, **opts)
        else:
            loss = textbook(h, W, target, **kw, **opts)
            logp = torch.log_softmax(textbook_logits(h, W, **kw), -1)
            ent = -(logp.exp() * logp).sum(-1)
        return loss, ent

    return run


ENTROPY_OPTIONS = {
    "plain": {},
    "softcap_tempered": dict(softcap=30.0, temperature=0.7),
    "bias_rstd_smoothing": dict(bias=True, rstd=True, label_smoothing=0.1),
}


@pytest.mark.parametrize("chunk_size", [None, 4096])
@pytest.mark.parametrize("shape", [(512, 256, 1000), (300, 264, 50257), (257, 128, 151936)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
@pytest.mark.parametrize("name", list(ENTROPY_OPTIONS))
def test_return_entropy_matches_float64_no_worse_than_eager_bf16(name, shape, chunk_size):
    """``return_entropy`` through the fused kernels (``SoftmaxEntropy`` in the logits
    GEMM's epilogue, its finalize, the entropy's term in the gradient epilogue): loss,
    per-row entropy and every gradient under upstream gradients on both, against float64
    by the 2 x eager-bf16 rule; vocabularies ragged and not, chunked and not."""
    opts = dict(ENTROPY_OPTIONS[name])
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = shape
    *tensors, target = inputs(M, H, V, seed=M + V + 1, bias=bias, rstd=rstd)
    up = torch.randn(M, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}

    def run(fn, dtype, **kw):
        dtypes = (dtype, dtype, dtype, F64 if dtype == F64 else torch.float32)
        leaves = [
            None if t is None else t.detach().to(d).requires_grad_()
            for t, d in zip(tensors, dtypes, strict=True)
        ]
        loss, ent = _with_entropy(fn)(*leaves[:2], target, bias=leaves[2], rstd=leaves[3],
                                      **opts, **kw)  # fmt: skip
        total = loss.to(F64) + (ent.to(F64) * up.to(F64)).sum()
        wrt = [t for t in leaves if t is not None]
        return (loss, ent, *torch.autograd.grad(total, wrt))

    ours = run(_coda, BF16, **extra)
    truth = run(textbook, F64)
    eager = run(textbook, BF16)
    names = ["loss", "entropy", "dh", "dW"] + (["dbias", "drstd"] if bias else [])
    for n, a, t, e in zip(names, ours, truth, eager, strict=True):
        assert torch.isfinite(a).all(), n
        assert_close_to_reference(a, t, name=n, baseline=e, atol=1e-3, floor=1e-3)


# the gradient-in-forward path's configurations with ``return_entropy="detached"``:
# (options, keyword arguments, ce_fused.GRAD_PASS, ce_fused.STATS_PASS)
DETACHED_ENTROPY = {
    # the shifted softmax, SoftmaxEntropy in its store epilogue, 128-row chunks
    "shifted_rows128": (dict(z_loss=1e-4), dict(chunk_rows=128), "auto", "epilogue"),
    # per-row losses in one chunk with the deferred norm's rstd (drstd from dh)
    "shifted_none_rstd": (dict(rstd=True, reduction="none"), {}, "auto", "epilogue"),
    # the statistics (and R) by a map pass over the plain GEMM's stored acc
    "shifted_stats_map": (dict(temperature=0.8), {}, "auto", "map"),
    # bias, softcap and smoothing: the stats-store epilogue and the gradient's map pass
    "map_all": (
        dict(bias=True, rstd=True, softcap=15.0, label_smoothing=0.05),
        dict(chunk_rows=128),
        "auto",
        "epilogue",
    ),
    "map_stats_map": (dict(rstd=True, softcap=15.0), {}, "map", "map"),
}


@pytest.mark.parametrize("shape", [(512, 256, 1000), (300, 264, 50257), (257, 128, 151936)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
@pytest.mark.parametrize("name", list(DETACHED_ENTROPY))
def test_detached_entropy_beside_the_fused_loss(name, shape, monkeypatch):
    """``return_entropy="detached"`` on the gradient-in-forward path (the recompute
    path's statistics op must not run): the per-row entropy against float64 of the
    materialized logits and the loss and every gradient unchanged, both by the 2 x
    eager-bf16 rule; ``SoftmaxEntropy`` in each of the path's statistics kernels (the
    shifted store and map epilogues, the stats-store and stats-map ones), with the V mod
    8 tail (50257) merged in torch."""
    from coda.fusions import cross_entropy as ce

    opts, kwargs, grad_pass, stats_pass = DETACHED_ENTROPY[name]
    opts = dict(opts)
    monkeypatch.setattr(ce_fused, "GRAD_PASS", grad_pass)
    monkeypatch.setattr(ce_fused, "STATS_PASS", stats_pass)

    def no_stats(*args, **kw):
        raise AssertionError("the recompute path's statistics op ran")

    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = shape
    *tensors, target = inputs(M, H, V, seed=M + V + 2, bias=bias, rstd=rstd)
    upstream = torch.randn(M, device="cuda") if opts.get("reduction") == "none" else None
    entropies = []

    def coda_loss(h, W, target, **kw):
        with monkeypatch.context() as m:
            m.setattr(ce, "lce_stats", no_stats)
            loss, ent = linear_cross_entropy(h, W, target, return_entropy="detached", **kw)
        assert not ent.requires_grad and ent.shape == (M,)
        entropies.append(ent)
        return loss

    def textbook_entropy(dtype):
        """The entropy of the logits materialized in ``dtype`` (float64, or eager's bf16
        logits with an fp32 softmax)."""
        h, W, b, r = (None if t is None else t.to(dtype) for t in tensors)
        logits = textbook_logits(h, W, b, r, opts.get("softcap"), opts.get("temperature", 1.0))
        logp = torch.log_softmax(logits.to(F64 if dtype == F64 else torch.float32), -1)
        return -(logp.exp() * logp).sum(-1)

    ours = grads_of(coda_loss, tensors, target, BF16, upstream, grad_in_forward=True,
                    **kwargs, **opts)  # fmt: skip
    truth = grads_of(textbook, tensors, target, F64, upstream, **opts)
    eager = grads_of(textbook, tensors, target, BF16, upstream, **opts)
    _assert_like_float64(ours, truth, eager, bias, rstd)
    (ent,) = entropies
    assert torch.isfinite(ent).all()
    assert_close_to_reference(
        ent, textbook_entropy(F64), name="entropy", baseline=textbook_entropy(BF16),
        atol=1e-3, floor=1e-3,
    )  # fmt: skip


# the gradient-in-forward path with ``return_lse`` / ``return_z_loss``: (options, kwargs)
RETURNED_LSE = {
    "shifted_rows128": (dict(z_loss=1e-4), dict(chunk_rows=128)),
    "shifted_none_rstd": (dict(rstd=True, z_loss=1e-4, reduction="none"), {}),
    "map_all": (dict(bias=True, rstd=True, softcap=15.0, label_smoothing=0.05, z_loss=1e-4), {}),
}


@pytest.mark.parametrize("shape", [(512, 256, 1000), (300, 264, 50257)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
@pytest.mark.parametrize("name", list(RETURNED_LSE))
def test_returned_lse_and_z_loss_on_the_fused_path(name, shape, monkeypatch):
    """``return_lse`` and ``return_z_loss`` keep the gradient-in-forward path (the
    recompute path's statistics op must not run in the forward): the per-row lse, the
    z-loss term and the gradients of a function of all three outputs (their gradients by
    ``coda::lce_lse``'s backward) against float64 by the 2 x eager-bf16 rule."""
    from coda.fusions import cross_entropy as ce

    opts, kwargs = RETURNED_LSE[name]
    opts = dict(opts)
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = shape
    *tensors, target = inputs(M, H, V, seed=M + V + 3, bias=bias, rstd=rstd)
    gen = torch.Generator(device="cuda").manual_seed(9)
    u_lse = torch.randn(M, device="cuda", generator=gen)
    u_z = torch.randn((M,) if opts.get("reduction") == "none" else (), device="cuda",
                      generator=gen)  # fmt: skip
    upstream = torch.randn(M, device="cuda") if opts.get("reduction") == "none" else None
    parts = []

    def no_stats(*args, **kw):
        raise AssertionError("the recompute path's statistics op ran")

    def coda_fn(h, W, target, **kw):
        with monkeypatch.context() as m:
            m.setattr(ce, "lce_stats", no_stats)
            loss, lse, zl = linear_cross_entropy(
                h, W, target, return_lse=True, return_z_loss=True, **kw
            )
        parts.append((lse, zl))
        return loss + ((lse * u_lse).sum() + (zl * u_z).sum()) * torch.ones_like(loss)

    def truth_fn(h, W, target, bias=None, rstd=None, **kw):
        loss = textbook(h, W, target, bias=bias, rstd=rstd, **kw)
        logits = textbook_logits(h, W, bias, rstd, kw.get("softcap"), kw.get("temperature", 1.0))
        lse = torch.logsumexp(logits.to(F64 if h.dtype == F64 else torch.float32), -1)
        valid = target != -100
        zrows = torch.where(valid, kw.get("z_loss", 0.0) * lse * lse, 0.0)
        if kw.get("reduction") == "none":
            zl = zrows
        elif kw.get("reduction") == "sum":
            zl = zrows.sum()
        else:
            zl = zrows.sum() / valid.sum().clamp(min=1)
        parts.append((lse, zl))
        total = loss + ((lse * u_lse.to(lse.dtype)).sum() + (zl * u_z.to(lse.dtype)).sum())
        return total * torch.ones_like(loss)

    ours = grads_of(coda_fn, tensors, target, BF16, upstream, grad_in_forward=True,
                    **kwargs, **opts)  # fmt: skip
    truth = grads_of(truth_fn, tensors, target, F64, upstream, **opts)
    eager = grads_of(truth_fn, tensors, target, BF16, upstream, **opts)
    _assert_like_float64(ours, truth, eager, bias, rstd)
    for n, i in (("lse", 0), ("z_loss", 1)):
        got, want, base = (p[i] for p in parts)
        assert_close_to_reference(got, want, name=n, baseline=base, atol=1e-3, floor=1e-3)
