"""coda.nn on CPU: Llama decoder layers converted with ``from_hf`` from stand-in modules
written here the way Hugging Face's Llama computes (``transformers`` is not needed:
conversion reads attributes by name), then forward and every parameter gradient of the
fused stack against the stand-in model in float64 (the fused ops compute in fp32 on CPU).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from coda.fusions import layouts
from coda.nn import FusedLlamaAttention, FusedLlamaDecoderLayer, FusedLlamaMLP, FusedLlamaStack
from coda.testing import examples
from coda.testing.tolerance import assert_close_to_reference

F64 = torch.float64
TOL = 2.0**-15


class RMSNorm(nn.Module):  # LlamaRMSNorm
    def __init__(self, H, eps):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(1 + 0.2 * torch.randn(H)), eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


class Rotary(nn.Module):  # LlamaRotaryEmbedding (default rope)
    def __init__(self, dim, theta):
        super().__init__()
        self.register_buffer("inv_freq", layouts.rope_inv_freq(dim, theta))
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        freqs = (self.inv_freq.float()[None, :, None] @ position_ids[:, None, :].float()).transpose(
            1, 2
        )
        emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):  # LlamaAttention, eager, causal, GQA
    def __init__(self, H, heads, kv_heads, D):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = D, heads, kv_heads
        self.q_proj = nn.Linear(H, heads * D, bias=False)
        self.k_proj = nn.Linear(H, kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, kv_heads * D, bias=False)
        self.o_proj = nn.Linear(heads * D, H, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(2, 3) * self.head_dim**-0.5
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, -1)
        return self.o_proj(o)


class MLP(nn.Module):  # LlamaMLP
    def __init__(self, H, Fd):
        super().__init__()
        self.gate_proj = nn.Linear(H, Fd, bias=False)
        self.up_proj = nn.Linear(H, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):  # LlamaDecoderLayer
    def __init__(self, H, Fd, heads, kv_heads, D, eps):
        super().__init__()
        self.self_attn = Attention(H, heads, kv_heads, D)
        self.mlp = MLP(H, Fd)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):  # LlamaModel without embeddings
    def __init__(self, n_layers, H, Fd, heads, kv_heads, D, eps, theta):
        super().__init__()
        self.layers = nn.ModuleList(Layer(H, Fd, heads, kv_heads, D, eps) for _ in range(n_layers))
        self.norm, self.rotary_emb = RMSNorm(H, eps), Rotary(D, theta)

    def forward(self, x, position_ids):
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


@st.composite
def configs(draw):
    kv = draw(st.integers(1, 2))
    return dict(
        n_layers=draw(st.integers(1, 2)),
        H=draw(st.sampled_from([8, 12, 24])),
        Fd=draw(st.integers(4, 30)),
        heads=kv * draw(st.integers(1, 3)),
        kv_heads=kv,
        D=draw(st.sampled_from([2, 4, 8])),
        eps=1e-5,
        theta=draw(st.sampled_from([10000.0, 500000.0])),
        B=draw(st.integers(1, 2)),
        S=draw(st.integers(1, 9)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(25))
@given(configs())
def test_stack_from_hf_matches_the_model(c):
    torch.manual_seed(c["seed"])
    keys = ("n_layers", "H", "Fd", "heads", "kv_heads", "D", "eps", "theta")
    model = Model(*(c[k] for k in keys)).to(F64)
    fused = FusedLlamaStack.from_hf(model).float()
    B, S, H = c["B"], c["S"], c["H"]
    x = torch.randn(B, S, H, dtype=F64)
    position_ids = torch.randint(0, 2048, (B, S))
    r = torch.randn(B * S, H, dtype=F64)

    x_ref = x.clone().requires_grad_()
    (model(x_ref, position_ids).reshape(-1, H) * r).sum().backward()

    x_c = x.float().requires_grad_()
    stream = fused(x_c, position_ids)
    # the final hidden states: rstd * h, the way a fused LM head consumes them
    out = stream.rstd[:, None] * stream.h
    assert_close_to_reference(out, model(x, position_ids).reshape(-1, H), tol=TOL)
    assert_close_to_reference(FusedLlamaStack.normed(stream), out.detach(), tol=TOL)
    # gradients: through a normed linear consumer, which is what takes x and gamma
    from coda.fusions import rms_norm_linear

    eye = torch.eye(H)
    y = rms_norm_linear(stream.x, stream.h, stream.rstd, fused.norm_weight, eye)
    (y * r.float()).sum().backward()
    assert_close_to_reference(x_c.grad, x_ref.grad, name="dx", tol=TOL)
    assert_close_to_reference(fused.norm_weight.grad, model.norm.weight.grad, tol=TOL)
    for ly_f, ly in zip(fused.layers, model.layers, strict=True):
        a, m = ly.self_attn, ly.mlp
        D = c["D"]
        dq, dk, dv = layouts.split_qkv_weight(
            ly_f.attn.qkv_weight.grad, c["heads"], c["kv_heads"], D
        )
        dgate, dup = layouts.deinterleave_gate_up(ly_f.mlp.gate_up_weight.grad).chunk(2)
        pairs = {
            "input_norm": (ly_f.attn.norm_weight.grad, ly.input_layernorm.weight.grad),
            "q": (dq, a.q_proj.weight.grad),
            "k": (dk, a.k_proj.weight.grad),
            "v": (dv, a.v_proj.weight.grad),
            "o": (ly_f.attn.o_weight.grad, a.o_proj.weight.grad),
            "post_norm": (ly_f.mlp.norm_weight.grad, ly.post_attention_layernorm.weight.grad),
            "gate": (dgate, m.gate_proj.weight.grad),
            "up": (dup, m.up_proj.weight.grad),
            "down": (ly_f.mlp.down_weight.grad, m.down_proj.weight.grad),
        }
        for name, (mine, ref) in pairs.items():
            # floor: a one-token sequence has dq = dk = 0 exactly (softmax of one score)
            assert_close_to_reference(mine, ref, name=f"d{name}", tol=TOL, floor=0.1)


def test_mlp_weight_views_give_the_hf_layout():
    mlp, norm = MLP(8, 6), RMSNorm(8, 1e-6)
    fused = FusedLlamaMLP.from_hf(mlp, norm)
    assert torch.equal(fused.gate_proj_weight, mlp.gate_proj.weight)
    assert torch.equal(fused.up_proj_weight, mlp.up_proj.weight)
    assert fused.eps == 1e-6 and torch.equal(fused.norm_weight, norm.weight)


def test_conversion_refuses_what_it_cannot_fuse():
    mlp, norm = MLP(8, 6), RMSNorm(8, 1e-6)
    mlp.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="SiLU"):
        FusedLlamaMLP.from_hf(mlp, norm)
    attn = Attention(8, 2, 1, 4)
    attn.q_proj = nn.Linear(8, 8, bias=True)
    with pytest.raises(ValueError, match="bias"):
        FusedLlamaAttention.from_hf(attn, norm, rope_theta=1e4)
    with pytest.raises(ValueError, match="rope_theta"):
        FusedLlamaAttention.from_hf(Attention(8, 2, 1, 4), norm)
    rot = Rotary(4, 1e4)
    rot.attention_scaling = 0.5
    with pytest.raises(ValueError, match="attention_scaling"):
        FusedLlamaAttention.from_hf(Attention(8, 2, 1, 4), norm, rotary_emb=rot)
    with pytest.raises(ValueError, match="gate_proj"):
        FusedLlamaMLP.from_hf(nn.Linear(2, 2), norm)


def test_module_cast_keeps_fp32_frequencies():
    attn = FusedLlamaAttention(8, 2, 1, 4, rope_theta=500000.0).to(torch.bfloat16)
    expected = layouts.rope_frequencies(layouts.rope_inv_freq(4, 500000.0), 2, 1, 4)
    assert attn.freq.dtype == torch.float32 and torch.equal(attn.freq, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_modules_under_autocast_over_fp32_parameters(dtype):
    """AMP (fp32 parameters under ``torch.autocast``): the stack, a decoder layer and an
    MLP alone cast their parameters and floating inputs to autocast's dtype as autocast
    casts ``nn.Linear``'s (``coda.nn._autocast``): the output equals the same module cast
    to that dtype and called outside autocast, bitwise, and every gradient arrives in
    fp32, the cast module's gradient cast up. rstd stays fp32."""
    import copy

    from coda.fusions import normed_stream

    torch.manual_seed(3)
    model = Model(2, 16, 24, 4, 2, 4, 1e-5, 10000.0)
    fused = FusedLlamaStack.from_hf(model)  # fp32 parameters
    cast = copy.deepcopy(fused).to(dtype)
    x = torch.randn(2, 5, 16)
    positions = torch.arange(5)[None].expand(2, 5)
    r = torch.randn(10, 16)

    def loss(stream):
        return ((stream.rstd[:, None] * stream.h.float() + stream.x.float()) * r).sum()

    def check(mine, theirs, run):
        with torch.autocast("cpu", dtype=dtype):
            got = run(mine, x)
        want = run(theirs, x.to(dtype))
        assert got.x.dtype == dtype and got.rstd.dtype == torch.float32
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        loss(got).backward()
        loss(want).backward()
        ours, ref = dict(mine.named_parameters()), dict(theirs.named_parameters())
        assert ours.keys() == ref.keys()
        for name, p in ours.items():
            assert p.dtype == torch.float32, name
            if ref[name].grad is None:  # e.g. the final norm's weight: h is only its cache
                assert p.grad is None, name
                continue
            assert p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad, ref[name].grad.float()), name

    check(fused, cast, lambda m, h: m(h, positions))
    # a layer and an MLP alone, on one fp32 input stream (its caches made in fp32, then
    # cast with it as autocast casts inputs; the cast module gets it cast by hand)
    from coda.fusions import NormedStream

    layer, layer_cast = fused.layers[0], cast.layers[0]
    nxt = fused.layers[1].norm_weight.detach()
    s32 = normed_stream(x.reshape(-1, 16), layer.norm_weight.detach(), layer.eps)

    def stream_for(h):
        if h.dtype == torch.float32:
            return s32
        return NormedStream(s32.x.to(h.dtype), s32.h.to(h.dtype), s32.rstd)

    fused.zero_grad(), cast.zero_grad()
    check(layer, layer_cast, lambda m, h: m(stream_for(h), positions, nxt.to(h.dtype), 1e-5))
    mlp, mlp_cast = layer.mlp, layer_cast.mlp
    fused.zero_grad(), cast.zero_grad()
    check(mlp, mlp_cast, lambda m, h: m(stream_for(h), nxt.to(h.dtype), 1e-5))


def test_cast_weights_under_autocast_are_saved_as_recipes(monkeypatch):
    """Under autocast over fp32 parameters the fused ops save the cast weights for their
    backward as recipes (``coda.nn._rebuild``, as the Hugging Face seam does): no cast
    copy is held from forward to backward; the backward casts each again from its
    parameter, and the gradients are those of the module cast by hand."""
    import copy

    from coda.nn import _rebuild

    torch.manual_seed(4)
    model = Model(2, 16, 24, 4, 2, 4, 1e-5, 10000.0)
    fused = FusedLlamaStack.from_hf(model)
    cast = copy.deepcopy(fused).to(torch.bfloat16)
    x = torch.randn(2, 5, 16)
    positions = torch.arange(5)[None].expand(2, 5)
    shapes = {tuple(p.shape) for p in fused.parameters()}
    matrices = {s for s in shapes if len(s) == 2}  # no activation here has their shapes
    held = []

    def pack(t):
        held.append((t.dtype, tuple(t.shape)))
        return t

    rebuilt = []
    real = _rebuild.Recipe.rebuild

    def counting(self):
        out = real(self)
        rebuilt.append(tuple(out.shape))
        return out

    monkeypatch.setattr(_rebuild.Recipe, "rebuild", counting)
    # an outer hook (as save_on_cpu would be) sees every saved tensor but the recipes
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fused(x, positions)
    assert not [s for dt, s in held if dt == torch.bfloat16 and s in matrices]
    want = cast(x.to(torch.bfloat16), positions)
    (got.x.float().sum() + got.h.float().sum()).backward()
    (want.x.float().sum() + want.h.float().sum()).backward()
    assert rebuilt and set(rebuilt) <= shapes
    ref = dict(cast.named_parameters())
    for name, p in fused.named_parameters():
        if ref[name].grad is not None:
            assert torch.equal(p.grad, ref[name].grad.float()), name


def test_run_layers_is_forward_with_the_callers_parameters():
    """``FusedLlamaStack.run_layers``: the same result as ``forward`` when the caller
    hands the stack's own weights; layer i runs through ``call(i, ...)`` in order, with the
    next layer's norm weight (the final norm's last) asked for just before it runs."""
    torch.manual_seed(3)
    model = Model(3, 32, 48, 4, 2, 8, 1e-5, 10000.0)
    fused = FusedLlamaStack.from_hf(model).float()
    x = torch.randn(2, 5, 32)
    position_ids = torch.arange(5)[None].expand(2, 5)
    events = []

    def norm_weight(i):
        events.append(("norm", i))
        return fused.norm_weight if i == len(fused.layers) else fused.layers[i].norm_weight

    def call(i, layer, *args):
        events.append(("layer", i))
        assert layer is fused.layers[i]
        return layer(*args)

    got = fused.run_layers(x, position_ids, norm_weight, call)
    want = fused(x, position_ids)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert events == [("norm", 0)] + [e for i in range(3) for e in (("norm", i + 1), ("layer", i))]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_kv_heads=0), "num_kv_heads must be a positive int"),
        (dict(head_dim=16.0), "head_dim must be a positive int"),
        (dict(num_heads=6), "not a multiple of"),
        (dict(rotary_dim=3), "rotary_dim must be even"),
        (dict(rotary_dim=20), "rotary_dim must be even"),
    ],
)
def test_attention_refuses_impossible_sizes(kwargs, match):
    sizes = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        FusedLlamaAttention(**sizes)


def test_modules_name_a_stream_that_is_not_one():
    """The block modules take a NormedStream; a tensor or a list there is a TypeError
    naming the module (before: an AttributeError on ``.x``)."""
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="FusedLlamaMLP: stream must be a coda.fusions"):
        FusedLlamaMLP(64, 172)(x, torch.ones(64), 1e-6)
    attn = FusedLlamaAttention(64, 4, 2, 16)
    with pytest.raises(TypeError, match="FusedLlamaAttention: stream must be a coda.fusions"):
        attn(x.tolist(), torch.arange(4)[None], torch.ones(64), 1e-6)
    layer = FusedLlamaDecoderLayer(attn, FusedLlamaMLP(64, 172))
    with pytest.raises(TypeError, match="FusedLlamaDecoderLayer: stream must be a coda.fusions"):
        layer(x, torch.arange(4)[None], torch.ones(64), 1e-6)


def test_module_reprs_show_their_sizes():
    assert repr(FusedLlamaMLP(64, 172)) == (
        "FusedLlamaMLP(hidden_size=64, intermediate_size=172, eps=1e-06)"
    )
    attn = FusedLlamaAttention(64, 4, 2, 16, rotary_dim=8, eps=1e-5)
    assert repr(attn) == (
        "FusedLlamaAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, "
        "rotary_dim=8, eps=1e-05)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_without_tokens_gives_empty_outputs_and_zero_gradients(dtype):
    """(B, 0, H) through the whole stack: every block op answers without a launch, the
    stream comes back empty, and every weight's gradient is a zero tensor of its shape
    (a sum over no tokens)."""
    torch.manual_seed(0)
    H, heads, kv_heads, D, F = 32, 4, 2, 8, 48
    layers = [
        FusedLlamaDecoderLayer(
            FusedLlamaAttention(H, heads, kv_heads, D, dtype=dtype),
            FusedLlamaMLP(H, F, dtype=dtype),
        )
        for _ in range(2)
    ]
    stack = FusedLlamaStack(layers, torch.ones(H, dtype=dtype), 1e-6)
    x = torch.randn(2, 0, H, dtype=dtype, requires_grad=True)
    stream = stack(x, torch.zeros(2, 0, dtype=torch.long))
    assert stream.x.shape == (0, H) and stream.h.shape == (0, H) and stream.rstd.shape == (0,)
    (stream.x.float().sum() + FusedLlamaStack.normed(stream).float().sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in stack.named_parameters():
        if p.grad is not None:  # the last norm weight gets none: the caches are detached
            assert p.grad.shape == p.shape and not p.grad.any(), name
    assert all(layer.mlp.down_weight.grad is not None for layer in stack.layers)
