"""Whole training steps on coda's fusions captured in CUDA graphs (marker ``gpu``).

Where a step's GPU work is short (small batches, short sequences) the host's Python
between the launches sets its pace; a CUDA graph replays the step's kernels with no
host work. These tests capture forward + backward of the LM-head loss (each path),
of a patched Hugging Face Llama model, and run the loss under ``torch.compile(mode=
"reduce-overhead")`` (CUDA graph trees): every replay on new inputs copied into the
captured ones must give what an uncaptured call gives on them. No host sync, no
allocation outside the graph's pool and no value-dependent host decision may hide in
a step for this to hold: a capture fails on a sync, and a replay that reused a stale
host decision would differ from the uncaptured call.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import _dispatch, ce_fused  # noqa: E402
from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402
from coda.runtime import epilogue_kernels  # noqa: E402
from coda.runtime.kept import kept  # noqa: E402

BF16 = torch.bfloat16


def capture(step):
    """``step`` warmed up on a side stream (kernel compiles, caches, the allocator), then
    captured once: (graph, the captured call's outputs, which every replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def draw(shape_h, H, V, seed):
    """(h, W, target) on the GPU: bf16 h of ``shape_h + (H,)``, an LM head W of order-one
    logits, targets with a fifth of the rows ignored (-100)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(*shape_h, H, device="cuda", generator=g).to(BF16)
    W = (torch.randn(V, H, device="cuda", generator=g) * 2 / H**0.5).to(BF16)
    target = torch.randint(0, V, shape_h, device="cuda", generator=g)
    target[torch.rand(shape_h, device="cuda", generator=g) < 0.2] = -100
    return h, W, target


def assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=f"{what}: output {i}")


# case -> (h's leading shape, H, V, options)
LOSS_CASES = {
    # the default: the gradient-in-forward path, one row chunk
    "default": ((512,), 256, 32000, {}),
    # several row chunks, options that add per-row math
    "rows128_smoothing_zloss": (
        (300,),
        264,
        50257,
        dict(chunk_rows=128, label_smoothing=0.1, z_loss=1e-4, grad_in_forward=True),
    ),
    # the recompute path, vocabulary chunked, softcap
    "recompute_softcap": (
        (257,),
        128,
        151936,
        dict(grad_in_forward=False, chunk_size=4096, softcap=15.0),
    ),
    # causal-LM labels on (B, T, H), per-token losses, a bias
    "shift_none_bias": ((2, 150), 256, 1000, dict(shift=True, reduction="none", bias=True)),
    # few output tiles and a long K: the dh GEMM split over K (ce_fused._split_config)
    "split_k_dh": ((256,), 1024, 32000, {}),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_forward_backward_replays_in_a_cuda_graph(case, monkeypatch):
    shape_h, H, V, opts = LOSS_CASES[case]
    opts = dict(opts)
    use_bias = opts.pop("bias", False)
    h0, W0, t0 = draw(shape_h, H, V, seed=0)
    h, W = h0.clone().requires_grad_(), W0.clone().requires_grad_()
    target = t0.clone()
    bias = (0.1 * torch.randn(V, device="cuda")).to(BF16).requires_grad_() if use_bias else None
    wrt = (h, W) if bias is None else (h, W, bias)
    splits = []
    real_split = ce_fused._split_config
    monkeypatch.setattr(
        ce_fused, "_split_config", lambda *a, **k: splits.append(real_split(*a, **k)) or splits[-1]
    )

    def step():
        loss = linear_cross_entropy(h, W, target, bias=bias, **opts)
        return (loss.detach(), *torch.autograd.grad(loss.sum(), wrt))

    graph, outs = capture(step)
    if case == "split_k_dh":
        assert any(c is not None for c in splits), "the dh GEMM did not split K"
    for seed in (1, 2):
        h1, W1, t1 = draw(shape_h, H, V, seed)
        with torch.no_grad():
            h.copy_(h1)
            W.copy_(W1)
            target.copy_(t1)
            if bias is not None:
                bias.copy_((0.1 * torch.randn(V, device="cuda")).to(BF16))
            for o in outs:
                o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(outs, step(), f"{case} replay {seed}")


def test_patched_llama_training_step_replays_in_a_cuda_graph():
    """A Hugging Face LlamaForCausalLM patched by ``apply_coda``: loss and every parameter
    gradient of a captured step, replayed on new token ids and labels (a prompt and
    padding ignored), equal the uncaptured fused step's; the captured step ran fused."""
    transformers = pytest.importorskip("transformers")
    from _hf_helpers import SMALL_LLAMA, randomize
    from coda.integrations.transformers import apply_coda, rope_config

    config = transformers.LlamaConfig(
        **SMALL_LLAMA,
        attn_implementation="sdpa",
        use_cache=False,
        **rope_config("default", 10000.0),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize(model, 0)
    model = model.to("cuda", BF16).train()
    patch = apply_coda(model, strict=True)
    params = [p for p in model.parameters() if p.requires_grad]

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (2, 200), generator=g)
        labels = ids.clone()
        labels[0, : 10 + seed] = -100
        labels[1, -5 - seed :] = -100
        return ids.cuda(), labels.cuda()

    ids, labels = batch(0)

    def step():
        loss = model(ids, labels=labels).loss
        return (loss.detach(), *torch.autograd.grad(loss, params))

    graph, outs = capture(step)
    assert patch.calls["fused_stack"] == 3 and patch.calls["fused_loss"] == 3, patch.calls
    assert not patch.fallbacks
    for seed in (1, 2):
        ids1, labels1 = batch(seed)
        ids.copy_(ids1)
        labels.copy_(labels1)
        with torch.no_grad():
            for p in params:  # new weights too: the replay must not reuse assembled layouts
                p.mul_(1.0 + 0.01 * seed)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(outs, step(), f"replay {seed}")


def forget_kept_tensors():
    """Empty coda's caches of kept tensors (map passes' zero operands, per-stream scratch,
    the finalize's stand-in counters), so that the next call allocates them again."""
    _dispatch._ZEROS.clear()
    epilogue_kernels._scratches.clear()
    epilogue_kernels._STAND_INS.clear()


def test_loss_under_torch_compile_reduce_overhead():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) runs the loss's
    forward and backward as graphs: no cudagraph skip, and each call on new inputs gives
    the eager call's loss and gradients. The caches start empty, so the tree's warm-up
    (which routes the thread's allocations into its pool without capturing) is where
    coda allocates what it keeps: none of it may land in the tree's pool (the tree
    checks that every live tensor of its pool is one of its outputs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forget_kept_tensors()

    def loss_fn(h, W, target):
        return linear_cross_entropy(h, W, target, z_loss=1e-4)

    compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        h0, W0, t = draw((384,), 256, 32000, seed)
        results = []
        for fn in (compiled, loss_fn):
            h, W = h0.clone().requires_grad_(), W0.clone().requires_grad_()
            torch.compiler.cudagraph_mark_step_begin()
            loss = fn(h, W, t)
            grads = torch.autograd.grad(loss, (h, W))
            results.append([x.detach().clone() for x in (loss, *grads)])
        assert_same(results[0], results[1], f"call {seed}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _pool_of(tensor: torch.Tensor):
    """The memory pool id of the allocator segment holding ``tensor``."""
    ptr = tensor.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    raise AssertionError("tensor not found in the allocator's segments")


def test_kept_tensors_stay_out_of_a_private_pool():
    """What coda keeps between calls is allocated outside a pool that the calling
    thread's allocations are routed to (as a CUDA graph tree's warm-up routes them), has
    its values on the current stream, and a plain allocation there lands in that pool
    (the check's control)."""
    pool = torch.cuda.MemPool()
    forget_kept_tensors()
    h, W, target = draw((384,), 256, 32000, seed=3)
    with torch.cuda.use_mem_pool(pool):
        control = torch.empty(1 << 20, device="cuda")
        zeros = _dispatch._zero_rows(4096, h)
        counters = epilogue_kernels._scratch(h.device).counters(8)
        mine = kept(lambda: torch.full((1 << 20,), 7.0, device="cuda"), h.device)
        loss = linear_cross_entropy(h, W, target)  # may grow the stream's scratch
    assert _pool_of(control) == tuple(pool.id)
    for t in (zeros, counters, mine, *epilogue_kernels._scratch(h.device).__dict__.values()):
        if isinstance(t, torch.Tensor) and t.numel():
            assert _pool_of(t) != tuple(pool.id)
    assert not zeros.any() and not counters.any() and bool((mine == 7.0).all())
    with torch.no_grad():
        want = linear_cross_entropy(h, W, target)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    del control, loss  # the pool's tensors go before the pool


def test_docs_capture_example_replays():
    """docs/cross-entropy.md's capture block (after "How to capture") runs as written, and
    its graph replays new inputs copied into h, W and target as an uncaptured call."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "cross-entropy.md").read_text()
    section = page[page.index("**How to capture.**") :]
    block = re.findall(r"```python gpu\n(.*?)```", section, flags=re.S)[0]
    h, W, target = draw((512,), 256, 32000, seed=0)
    h, W = h.requires_grad_(), W.requires_grad_()
    ns = dict(torch=torch, linear_cross_entropy=linear_cross_entropy, h=h, W=W, target=target)
    exec(compile(block, "docs/cross-entropy.md", "exec"), ns)  # noqa: S102
    for seed in (1, 2):
        h1, W1, t1 = draw((512,), 256, 32000, seed)
        with torch.no_grad():
            h.copy_(h1)
            W.copy_(W1)
            target.copy_(t1)
        ns["graph"].replay()
        torch.cuda.synchronize()
        loss = linear_cross_entropy(h, W, target)
        want = (loss.detach(), *torch.autograd.grad(loss, (h, W)))
        assert_same((ns["loss"].detach(), ns["dh"], ns["dW"]), want, f"docs replay {seed}")
