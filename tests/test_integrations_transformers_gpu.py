"""coda.integrations.transformers on a Hopper GPU (marker ``gpu``): real ``transformers``
LlamaForCausalLM models from small random configs (no downloads), patched by
``apply_coda`` and run in bf16 through coda's fused kernels, against the unpatched model.

The CPU twin is tests/test_integrations_transformers.py (fp32 reference path vs float64).
Here, DESIGN.md 6.3's rule: for the loss, the logits and every parameter's gradient, the
normwise relative error of coda in bf16 against a float64 run of the same weights is at
most 2 x that of eager Hugging Face in bf16 (SDPA) + ``ATOL``. Weights are drawn in fp32,
rounded to bf16 once, and the float64 model is a copy of the bf16 one, so all three
compute with identical weights. Sizes: GQA, MQA, MHA with tied embeddings, head_dim 64
and 128, hidden sizes that are not multiples of 128 (320, 576: coda needs only what TMA
needs, every GEMM's N and K a multiple of 8, which Llama shapes satisfy), ragged token
counts and vocabularies. Plus a short side-by-side training run (the GPU demo's code).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from _hf_helpers import randomize  # noqa: E402
from coda.integrations.transformers import apply_coda, rope_config  # noqa: E402
from coda.testing.tolerance import compare  # noqa: E402

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
ATOL = 2e-3


CONFIGS = {
    # GQA 2:1, head_dim 64
    "gqa_h256": dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **rope_config("default", 10000.0),
    ),
    # MQA, H = 320 (not a multiple of 128), odd vocabulary
    "mqa_h320": dict(
        vocab_size=1531,
        hidden_size=320,
        intermediate_size=864,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        **rope_config("default", 500000.0),
    ),
    # MHA, H = 576 (not a multiple of 128), tied embeddings, one layer
    "mha_h576_tied": dict(
        vocab_size=2048,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=9,
        tie_word_embeddings=True,
        **rope_config("default", 10000.0),
    ),
    # GQA 4:1, head_dim 128, Llama-3 RoPE scaling, vocabulary of Llama 2's size
    "gqa_h1024_llama3": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        **rope_config(
            "llama3",
            500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ),
}


def trio(name: str, seed: int = 0):
    """(coda bf16 (patched), eager bf16, float64) models with identical weights, on cuda,
    in training mode, and the patch."""
    torch.manual_seed(seed)
    config = LlamaConfig(**CONFIGS[name], attn_implementation="sdpa", use_cache=False)
    base = LlamaForCausalLM(config)
    randomize(base, seed)
    eager = base.to("cuda", BF16)
    truth = copy.deepcopy(eager).to(F64)
    mine = copy.deepcopy(eager)
    patch = apply_coda(mine, strict=True)
    for m in (mine, eager, truth):
        m.train()
    return mine, eager, truth, patch


def batch(vocab: int, B: int = 2, S: int = 203, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :17] = -100  # a prompt
    labels[1, -5:] = -100  # padding at the end
    return ids.cuda(), labels.cuda()


class Errors:
    """Collects every comparison; ``check()`` fails listing all of them (the margins of a
    run are visible at once)."""

    def __init__(self) -> None:
        self.rows = []

    def add(self, name: str, mine: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor):
        self.rows.append(compare(mine, truth, name=name, baseline=eager, atol=ATOL))

    def check(self) -> None:
        bad = [r for r in self.rows if not r.passed]
        table = "\n".join(str(r) for r in self.rows)
        assert not bad, f"{len(bad)} of {len(self.rows)} over the limit:\n{table}"


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_and_every_gradient_vs_float64(name):
    mine, eager, truth, patch = trio(name)
    ids, labels = batch(CONFIGS[name]["vocab_size"])
    losses = {}
    for key, model in (("coda", mine), ("eager", eager), ("truth", truth)):
        out = model(ids, labels=labels)
        out.loss.backward()
        losses[key] = out.loss.detach()
        if key == "coda":
            assert out.logits is None  # the fused loss never materializes them
    assert patch.calls == {"fused_stack": 1, "fused_loss": 1} and not patch.fallbacks
    errs = Errors()
    errs.add("loss", losses["coda"], losses["eager"], losses["truth"])
    ours, theirs, ref = (dict(m.named_parameters()) for m in (mine, eager, truth))
    assert ours.keys() == theirs.keys() == ref.keys()
    for pname, p in ref.items():
        assert ours[pname].grad is not None, pname
        errs.add(f"d{pname}", ours[pname].grad, theirs[pname].grad, p.grad)
    errs.check()


@pytest.mark.parametrize(
    "name, dtype, cast_pass",
    [("gqa_h256", BF16, False), ("mha_h576_tied", BF16, False),
     ("gqa_h1024_llama3", BF16, False), ("gqa_h256", torch.float16, False),
     ("gqa_h1024_llama3", BF16, True), ("gqa_h256", torch.float16, True)],
)  # fmt: skip
def test_fuse_autocast_over_fp32_weights_vs_float64(name, dtype, cast_pass, monkeypatch):
    """AMP: fp32 master weights (the bf16 model's, so all three compute with identical
    values) under ``torch.autocast`` to bf16 (or fp16), patched with
    ``fuse_autocast=True`` and ``strict``: the fused stack runs in autocast's dtype (no
    fallback) and the loss stays fused. The loss and every gradient (in fp32) within 2 x
    the error of eager Hugging Face in that dtype (the numerics ``fuse_autocast``
    promises: a bf16 / fp16 model's) + ATOL, against float64. ``cast_pass``: the gate/up
    weights (small here) cast and interleaved by ``cast_layouts``' map passes, as a
    large model's are."""
    passes = []
    if cast_pass:
        from coda.fusions import cast_layouts

        monkeypatch.setattr(cast_layouts, "MIN_NUMEL", 1)
        real = cast_layouts._CastGateUp.apply
        monkeypatch.setattr(
            cast_layouts._CastGateUp, "apply", lambda *a: passes.append(1) or real(*a)
        )
    mine_bf16, eager, truth, _ = trio(name)
    del mine_bf16
    eager = eager.to(dtype)
    amp = copy.deepcopy(eager).to(F32)
    patch = apply_coda(amp, strict=True, fuse_autocast=True)
    amp.train()
    ids, labels = batch(CONFIGS[name]["vocab_size"])
    losses = {}
    for key, model in (("coda", amp), ("eager", eager), ("truth", truth)):
        with torch.autocast("cuda", dtype=dtype, enabled=key == "coda"):
            out = model(ids, labels=labels)
        out.loss.backward()  # outside autocast, as PyTorch advises
        losses[key] = out.loss.detach().double()
    assert patch.calls == {"fused_stack": 1, "fused_loss": 1} and not patch.fallbacks
    # each layer's gate/up weight: made in forward (and again in backward, its recipe)
    assert len(passes) >= (CONFIGS[name]["num_hidden_layers"] if cast_pass else 0)
    errs = Errors()
    errs.add("loss", losses["coda"], losses["eager"], losses["truth"])
    ours, theirs, ref = (dict(m.named_parameters()) for m in (amp, eager, truth))
    for pname, p in ref.items():
        assert ours[pname].grad is not None and ours[pname].grad.dtype == F32, pname
        errs.add(f"d{pname}", ours[pname].grad, theirs[pname].grad, p.grad)
    errs.check()


@pytest.mark.parametrize("name", ["gqa_h256", "mqa_h320", "gqa_h1024_llama3"])
def test_logits_vs_float64(name):
    """Without labels: the fused stack, then Hugging Face's final norm and LM head."""
    mine, eager, truth, patch = trio(name, seed=2)
    ids, _ = batch(CONFIGS[name]["vocab_size"], S=130)
    with torch.no_grad():
        logits = {k: m(ids).logits for k, m in (("coda", mine), ("eager", eager), ("t", truth))}
    assert patch.calls["fused_stack"] == 1 and not patch.fallbacks
    errs = Errors()
    errs.add("logits", logits["coda"], logits["eager"], logits["t"])
    errs.check()


def test_short_side_by_side_training_agrees():
    """The GPU demo's run (coda.llama_training), shortened: 40 bf16 steps of the small
    preset at 2 x 256 tokens; curves within the stated bound, every step fused, peak
    memory measured."""
    from coda import llama_training as lt

    setup = lt.TrainSetup(
        size=lt.PRESETS["small"], seq=256, batch=2, steps=40, device="cuda", dtype=BF16
    )
    result = lt.train_side_by_side(setup, show_progress=False)
    # 40 steps of 512 tokens agree but are too few to learn this data (measured on the
    # H200 and on the CPU: the loss does not fall below step 0's within 80 steps at this
    # batch); learning is what benchmarks/train_loss.py's 200 steps show.
    agreement = result.agreement
    assert agreement["ok"], (agreement["max_abs_ma_diff"], result.notes)
    assert not result.notes, result.notes
    assert all(math.isfinite(x) for v in result.losses.values() for x in v)
    assert all(v is not None and v > 0 for v in result.peak_gib.values())
    assert result.coda_calls == {"fused_stack": 40, "fused_loss": 40}


def test_torch_compile_of_the_patched_model():
    """``torch.compile`` (inductor, dynamic shapes left to dynamo, as users call it) of a
    patched bf16 model over three sequence lengths: every call fused, the loss and every
    gradient within the float64 rule (against eager bf16 as the baseline), and no
    recompile after the second length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    name = "gqa_h256"
    mine, eager, truth, patch = trio(name, seed=3)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(mine, backend=counter)
    frames = []
    errs = Errors()
    for S in (203, 150, 97):
        ids, labels = batch(CONFIGS[name]["vocab_size"], S=S, seed=S)
        losses = {}
        for key, model in (("coda", compiled), ("eager", eager), ("truth", truth)):
            model.zero_grad(set_to_none=True)
            out = model(ids, labels=labels)
            out.loss.backward()
            losses[key] = out.loss.detach()
        frames.append(counter.frame_count)
        errs.add(f"loss S={S}", losses["coda"], losses["eager"], losses["truth"])
        ours, theirs, ref = (dict(m.named_parameters()) for m in (mine, eager, truth))
        for pname, p in ref.items():
            errs.add(f"d{pname} S={S}", ours[pname].grad, theirs[pname].grad, p.grad)
    errs.check()
    assert frames[1] == frames[2], frames
    assert patch.calls == {"fused_stack": 3, "fused_loss": 3} and not patch.fallbacks
