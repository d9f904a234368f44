"""coda.nn.LinearCrossEntropyLoss on CPU: Hugging Face conventions (labels, -100, shift,
shift_labels, num_items_in_batch) and the deferred final RMSNorm (gradients reach the
stream x and the norm weight) against textbook float64 PyTorch."""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F

from coda.fusions.cross_entropy import linear_cross_entropy
from coda.nn.loss import LinearCrossEntropyLoss

F64 = torch.float64


def _data(seed=0, B=3, T=10, H=16, V=29):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64) / 4
    gamma = 1 + 0.1 * torch.randn(H, generator=g, dtype=F64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :3] = -100
    return x, W, gamma, labels


def _leaf(t):
    return t.detach().float().requires_grad_()


def test_module_equals_functional_with_options():
    x, W, _, labels = _data()
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=10.0, ignore_index=-100)
    module = LinearCrossEntropyLoss(shift=True, chunk_size=8, **opts)
    a = module(x.float(), W.float(), labels, num_items_in_batch=17)
    b = linear_cross_entropy(
        x.float(), W.float(), labels, shift=True, num_items_in_batch=17, chunk_size=8, **opts
    )
    assert torch.equal(a, b)
    assert "shift=True" in repr(module)


def test_shift_labels_are_used_as_given():
    x, W, _, labels = _data(1)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    module = LinearCrossEntropyLoss(shift=True, reduction="none")
    a = module(x.float(), W.float(), labels)
    b = module(x.float(), W.float(), shift_labels=shifted)
    assert torch.equal(a, b) and a.shape == labels.shape
    with pytest.raises(ValueError, match="exactly one"):
        module(x.float(), W.float(), labels, shift_labels=shifted)
    with pytest.raises(ValueError, match="exactly one"):
        module(x.float(), W.float())


def test_row_weight_follows_labels_or_shift_labels():
    """Per-token weights: shifted with ``labels`` (aligned with them, as the labels are
    before the shift), taken as they are beside ``shift_labels``; the same loss and
    gradients either way, equal to the functional's."""
    x, W, _, labels = _data(2)
    adv = torch.randn(labels.shape, generator=torch.Generator().manual_seed(3))
    module = LinearCrossEntropyLoss(shift=True, reduction="sum")
    xa, xb = _leaf(x), _leaf(x)
    a = module(xa, W.float(), labels, row_weight=adv)
    b = module(
        xb, W.float(), shift_labels=F.pad(labels[:, 1:], (0, 1), value=-100),
        row_weight=F.pad(adv[:, 1:], (0, 1)),
    )  # fmt: skip
    c = linear_cross_entropy(x.float(), W.float(), labels, shift=True, reduction="sum",
                             row_weight=adv)  # fmt: skip
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    (ga,) = torch.autograd.grad(a, xa)
    (gb,) = torch.autograd.grad(b, xb)
    torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("mode", ["detached", True])
def test_return_entropy_with_the_deferred_norm(mode):
    """``return_entropy``: (loss, per-token entropy shaped like the labels) equal to the
    functional's, under the deferred norm and a shift; "detached" without a gradient on
    the gradient-in-forward path (the loss's gradients those of the loss alone), True
    differentiable."""
    x, W, gamma, labels = _data(4)
    module = LinearCrossEntropyLoss(shift=True, return_entropy=mode)
    assert "return_entropy" in repr(module)
    xa = _leaf(x)
    loss, ent = module(xa, W.float(), labels, norm_weight=gamma.float())
    assert ent.shape == labels.shape and ent.requires_grad == (mode is True)
    plain = LinearCrossEntropyLoss(shift=True)(xa, W.float(), labels, norm_weight=gamma.float())
    torch.testing.assert_close(loss, plain)
    (g_loss,) = torch.autograd.grad(loss, xa, retain_graph=True)
    torch.testing.assert_close(g_loss, torch.autograd.grad(plain, xa)[0])
    xd = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    logp = torch.log_softmax(xd @ W.T, -1)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_deferred_final_norm_gradients_reach_the_stream():
    """norm_weight: loss of rmsnorm(x) * gamma @ W.T, computed as rstd * ((x gamma) @ W.T);
    dx, dgamma and dW equal the textbook's (unfused norm, then logits, then F.cross_entropy)."""
    x, W, gamma, labels = _data(2)
    eps = 1e-6
    xs, Ws, gs = _leaf(x), _leaf(W), _leaf(gamma)
    ours = LinearCrossEntropyLoss(shift=True)(xs, Ws, labels, norm_weight=gs, norm_eps=eps)
    ours.backward()
    xd, Wd, gd = (t.detach().requires_grad_() for t in (x, W, gamma))
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * gd
    logits = (normed @ Wd.T)[:, :-1].reshape(-1, W.shape[0])
    truth = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    truth.backward()
    torch.testing.assert_close(ours.double(), truth, rtol=1e-5, atol=0)
    for mine, want in ((xs.grad, xd.grad), (gs.grad, gd.grad), (Ws.grad, Wd.grad)):
        scale = float(want.abs().max())
        assert float((mine.double() - want).abs().max()) <= 2e-5 * scale


def test_docs_detached_entropy_example_runs():
    """docs/cross-entropy.md's detached-entropy block runs as written: the entropy of the
    shifted positions' logits without a gradient, the masked loss's gradient reaching h
    and W."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "cross-entropy.md").read_text()
    section = page[page.index("### The detached entropy") :]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/cross-entropy.md", "exec"), ns)  # noqa: S102
    h, W, entropy = ns["h"], ns["W"], ns["entropy"]
    assert not entropy.requires_grad and h.grad is not None and W.grad is not None
    logp = torch.log_softmax(h.detach().double() @ W.detach().double().T, -1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(entropy.double(), want, rtol=1e-5, atol=1e-5)


def test_docs_rl_example_runs_and_both_forms_agree():
    """docs/cross-entropy.md's RL block (after "## Per-row losses") runs as written; on
    policy (ratio 1, inside the clip) the PPO form's gradients equal the weighted form's:
    the block's two backward passes add the same gradient twice."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "cross-entropy.md").read_text()
    section = page[page.index("## Per-row losses (RL)") :]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/cross-entropy.md", "exec"), ns)  # noqa: S102
    h, W, labels, adv = ns["h"], ns["W"], ns["labels"], ns["advantages"]
    count = (labels[:, 1:] != -100).sum()
    hd, Wd = h.detach().requires_grad_(), W.detach().requires_grad_()
    once = linear_cross_entropy(hd, Wd, labels, shift=True, reduction="sum", row_weight=adv)
    dh, dW = torch.autograd.grad(once / count, (hd, Wd))
    torch.testing.assert_close(h.grad, 2 * dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(W.grad, 2 * dW, rtol=1e-4, atol=1e-6)


def test_docs_example_runs():
    """docs/cross-entropy.md's "Calling it" block runs as written and trains h and W."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "cross-entropy.md"
    block = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/cross-entropy.md", "exec"), ns)  # noqa: S102
    assert ns["h"].grad.abs().sum() > 0 and ns["W"].grad.abs().sum() > 0
    assert ns["loss"].dim() == 0 and torch.isfinite(ns["loss"])


def test_grad_in_forward_passes_through(monkeypatch):
    """The module's grad_in_forward and chunk_rows reach the op: the same loss and
    gradients on both paths, and the path asked for is the one that runs."""
    from coda.fusions import ce_fused

    calls = []
    real = ce_fused.run_map
    monkeypatch.setattr(ce_fused, "run_map", lambda *a, **k: calls.append(1) or real(*a, **k))
    # the map pass marks the path (one per row chunk); the default shifted softmax
    # (``ce_fused.GRAD_PASS``) runs none
    monkeypatch.setattr(ce_fused, "GRAD_PASS", "map")
    x, W, _, labels = _data(3)
    results = []
    for flag, runs in ((None, 4), (True, 4), (False, 0)):
        module = LinearCrossEntropyLoss(shift=True, grad_in_forward=flag, chunk_rows=8)
        xs, Ws = _leaf(x), _leaf(W)
        loss = module(xs, Ws, labels, num_items_in_batch=19)
        loss.backward()
        assert len(calls) == runs, flag  # one map pass per row chunk of 8 (30 rows)
        calls.clear()
        results.append((loss.detach(), xs.grad, Ws.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert "grad_in_forward=False" in repr(module)


def test_head_module_in_place_of_its_weight():
    """An nn.Linear head (its bias included) gives the loss and gradients of passing its
    weight and bias; anything else than a tensor or an nn.Linear is refused."""
    x, W, _, labels = _data(4)
    head = torch.nn.Linear(W.shape[1], W.shape[0], bias=True)
    with torch.no_grad():
        head.weight.copy_(W.float())
        head.bias.normal_(generator=torch.Generator().manual_seed(5))
    module = LinearCrossEntropyLoss(shift=True, grad_in_forward=False)
    xa, xb = _leaf(x), _leaf(x)
    a = module(xa, head, labels)
    a.backward()
    Wb, bb = _leaf(head.weight), _leaf(head.bias)
    b = module(xb, Wb, labels, bias=bb)
    b.backward()
    assert torch.equal(a, b)
    for got, want in ((xa.grad, xb.grad), (head.weight.grad, Wb.grad), (head.bias.grad, bb.grad)):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="nn.Linear"):
        module(x.float(), torch.nn.Embedding(4, 16), labels)


def test_sharded_weight_tensors_are_refused_before_any_work():
    """A ZeRO-3 partitioned parameter outside the owning module's forward (``ds_id`` set,
    ``ds_status`` NOT_AVAILABLE: an empty placeholder) is refused with a TypeError naming
    the fix, as a DTensor is (tests/test_integrations_fsdp.py); gathered (AVAILABLE, inside
    the module's forward) it is a whole tensor and runs."""
    x, W, _, labels = _data(5)
    shard = torch.nn.Parameter(W.float())
    shard.ds_id = 7  # DeepSpeed marks every ZeRO-3 parameter so
    shard.ds_status = enum.Enum("ZeroParamStatus", "AVAILABLE NOT_AVAILABLE").NOT_AVAILABLE
    with pytest.raises(TypeError, match="ZeRO-3 partitioned parameter.*LM head module"):
        linear_cross_entropy(x.float(), shard, labels, shift=True)
    with pytest.raises(TypeError, match="W is a DeepSpeed"):
        LinearCrossEntropyLoss()(x.float(), shard, labels)
    shard.ds_status = type(shard.ds_status).AVAILABLE
    got = linear_cross_entropy(x.float(), shard, labels, shift=True)
    # the same kind of whole tensor (a leaf that requires grad: the loss takes the same
    # path; one that does not skips the gradient work and may round the loss differently)
    whole = W.float().requires_grad_()
    assert torch.equal(got, linear_cross_entropy(x.float(), whole, labels, shift=True))


def test_module_checks_its_reduction_and_shows_its_options():
    with pytest.raises(ValueError, match="reduction must be"):
        LinearCrossEntropyLoss(reduction="avg")
    text = repr(LinearCrossEntropyLoss(check=True, chunk_rows=256))
    assert text.endswith("shift=False, check=True, chunk_rows=256)")


def test_module_names_a_norm_weight_of_the_wrong_size():
    loss = LinearCrossEntropyLoss()
    h, W, labels = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(8,\)"):
        loss(h, W, labels, norm_weight=torch.ones(9))
