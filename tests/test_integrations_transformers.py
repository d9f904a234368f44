"""coda.integrations.transformers on CPU: a real ``transformers`` LlamaForCausalLM (and
MistralForCausalLM) from tiny random configs (no downloads), patched by ``apply_coda``,
against the unpatched model.

The patched model runs coda's fused ops on the CPU reference path (``Epilogue.reference``
in fp32: float64 is refused there), so it runs in fp32 against the same weights in a
float64 Hugging Face model; the bound is a normwise relative error of 2^-15 (the fused
ops' fp32 tolerance in tests/test_nn_llama.py). Checked: loss, logits and every
parameter's gradient, HF label semantics (shift, -100, ``num_items_in_batch``,
``shift_labels``), real logits in eval and ``generate()``, fallbacks to the original
forward (cache, padding, sliding window) with their reasons, ``revert``, shared weights
and ``state_dict``, and the errors for unsupported configs and for models with nothing
to patch. Skipped when ``transformers`` is not installed (it is not a coda dependency).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from _hf_helpers import randomize  # noqa: E402
from coda.integrations.transformers import (  # noqa: E402
    NothingMatchedError,
    UnsupportedModelError,
    apply_coda,
    revert_coda,
    rope_config,
)
from coda.testing.tolerance import assert_close_to_reference  # noqa: E402

TOL = 2.0**-15
F64 = torch.float64


BASE = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2)
CONFIGS = {
    # GQA, 2 layers, linear RoPE scaling
    "gqa": dict(
        BASE,
        num_attention_heads=4,
        num_key_value_heads=2,
        **rope_config("linear", 10000.0, factor=2.0),
    ),
    # MHA, tied embeddings, H = 24 (not a multiple of 16)
    "mha_tied": dict(
        BASE,
        vocab_size=37,
        hidden_size=24,
        intermediate_size=20,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    # MQA with head_dim != hidden / heads
    "mqa_head_dim": dict(
        BASE,
        vocab_size=64,
        hidden_size=20,
        intermediate_size=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=6,
    ),
    # Llama-3 RoPE scaling, theta 500000
    "llama3_rope": dict(
        BASE,
        num_attention_heads=2,
        num_key_value_heads=1,
        **rope_config(
            "llama3",
            500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
}


def pair(cls=LlamaForCausalLM, config_cls=LlamaConfig, seed: int = 0, patch=True, **config):
    """(float64 Hugging Face model, its fp32 copy patched by coda, the patch)."""
    torch.manual_seed(seed)
    ref = cls(config_cls(**config, attn_implementation="eager"))
    randomize(ref, seed)
    ref = ref.to(F64)
    mine = copy.deepcopy(ref).float()
    return ref, mine, apply_coda(mine) if patch else None


def batch(vocab: int, B: int = 2, S: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding at the end
    return ids, labels


def assert_grads_match(mine: nn.Module, ref: nn.Module) -> None:
    ours = dict(mine.named_parameters())
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        assert p.grad is not None and ours[name].grad is not None, name
        assert_close_to_reference(ours[name].grad, p.grad, name=f"d{name}", tol=TOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_training_loss_and_every_gradient_match_hf(name):
    ref, mine, patch = pair(**CONFIGS[name])
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    out_ref = ref(ids, labels=labels)
    out = mine(ids, labels=labels)
    assert patch.calls == {"fused_stack": 1, "fused_loss": 1}, patch.fallbacks
    assert out.logits is None  # the fused loss never materializes them
    assert_close_to_reference(out.loss, out_ref.loss, name="loss", tol=TOL)
    out_ref.loss.backward()
    out.loss.backward()
    assert_grads_match(mine, ref)


@pytest.mark.parametrize("name", ["gqa", "mha_tied"])
def test_logits_without_labels_match_hf_and_are_differentiable(name):
    ref, mine, patch = pair(**CONFIGS[name])
    ids, _ = batch(ref.config.vocab_size, S=7)
    # explicit position ids that are not 0..S-1 (with a mask: not read as packed sequences)
    positions = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref.train(), mine.train()
    logits_ref = ref(ids, position_ids=positions, attention_mask=mask).logits
    logits = mine(ids, position_ids=positions, attention_mask=mask).logits
    assert patch.calls == {"fused_stack": 1}
    assert_close_to_reference(logits, logits_ref, name="logits", tol=TOL)
    r = torch.randn(logits_ref.shape, dtype=F64)
    (logits_ref * r).sum().backward()
    (logits * r.float()).sum().backward()
    assert_grads_match(mine, ref)
    # eval without a cache: the fused stack, real logits
    mine.eval(), ref.eval()
    with torch.no_grad():
        logits = mine(ids, use_cache=False).logits
        assert_close_to_reference(logits, ref(ids).logits, name="eval logits", tol=TOL)
    assert patch.calls["fused_stack"] == 2


def test_hf_label_semantics_num_items_and_shift_labels():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    n = 3 * int((labels[:, 1:] != -100).sum())  # as if 3 accumulation micro-batches
    want = ref(ids, labels=labels, num_items_in_batch=n).loss
    got = mine(ids, labels=labels, num_items_in_batch=n).loss
    assert_close_to_reference(got, want, name="loss / num_items_in_batch", tol=TOL)
    mean = ref(ids, labels=labels).loss
    assert not torch.allclose(want, mean)  # the divisor matters for this batch
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    got = mine(ids, shift_labels=shifted, labels=labels).loss
    assert_close_to_reference(got, mean, name="loss(shift_labels)", tol=TOL)
    got_tuple = mine(ids, labels=labels, return_dict=False)
    assert isinstance(got_tuple, tuple) and len(got_tuple) == 1
    assert_close_to_reference(got_tuple[0], mean, name="loss (tuple)", tol=TOL)
    assert patch.calls["fused_loss"] == 3 and not patch.fallbacks


def test_eval_with_labels_and_generate_keep_real_logits():
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS["gqa"], attn_implementation="eager")
    plain = LlamaForCausalLM(config)
    randomize(plain, 3)
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine)
    ids, labels = batch(config.vocab_size)
    plain.eval(), mine.eval()
    with torch.no_grad():
        want, got = plain(ids, labels=labels), mine(ids, labels=labels)
    assert got.logits is not None
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(mine.generate(ids[:1, :4], **kw), plain.generate(ids[:1, :4], **kw))
    assert patch.calls["fused_stack"] == 0 and patch.calls["original"] > 0
    assert set(patch.fallbacks) <= {"use_cache", "past_key_values"}


def test_fallbacks_are_counted_correct_and_strict_raises():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    ref.train(), mine.train()
    want = ref(ids, labels=labels, attention_mask=mask).loss
    out = mine(ids, labels=labels, attention_mask=mask)
    # the stack's original forward (padding), the loss over its output still fused
    assert_close_to_reference(out.loss, want, name="loss (padding, original stack)", tol=TOL)
    assert out.logits is None
    assert patch.fallbacks == {"attention_mask": 1}
    assert patch.calls == {"original": 1, "fused_loss": 1}
    want.backward()
    out.loss.backward()
    assert_grads_match(mine, ref)
    # an all-ones mask is no padding: fused
    mine(ids, labels=labels, attention_mask=torch.ones_like(ids))
    assert patch.calls == {"original": 1, "fused_loss": 2, "fused_stack": 1}
    out = mine(ids, output_hidden_states=True)  # per-layer states: the original forward
    assert len(out.hidden_states) == ref.config.num_hidden_layers + 1
    assert patch.fallbacks["output_hidden_states"] == 1
    # with labels too: the stack's original forward returns them, the loss stays fused
    out = mine(ids, labels=labels, output_hidden_states=True)
    want = ref(ids, labels=labels, output_hidden_states=True)
    assert out.logits is None and len(out.hidden_states) == len(want.hidden_states)
    assert_close_to_reference(out.loss, want.loss, name="loss (hidden states)", tol=TOL)
    assert_close_to_reference(
        out.hidden_states[-1], want.hidden_states[-1], name="last hidden state", tol=TOL
    )
    assert patch.fallbacks["output_hidden_states"] == 2
    patch.strict = True
    with pytest.raises(RuntimeError, match="attention_mask"):
        mine(ids, labels=labels, attention_mask=mask)


def test_autocast_over_fp32_weights_falls_back_and_keeps_the_fused_loss():
    """AMP (fp32 master weights under ``torch.autocast``): the fused stack does not cast
    weights per step, so the decoder stack runs Hugging Face's forward (reason counted)
    and the loss stays fused, its operands cast as autocast casts F.linear's. Loss and
    every gradient: within 2 x the error of the unpatched model under the same autocast,
    against float64."""
    ref, plain, _ = pair(**CONFIGS["gqa"], patch=False)
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine)
    ids, labels = batch(ref.config.vocab_size)
    losses = {}
    for key, model in (("truth", ref), ("eager", plain), ("coda", mine)):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=key != "truth"):
            out = model(ids, labels=labels)
        out.loss.backward()
        losses[key] = out.loss.detach()
    assert patch.fallbacks == {"autocast to bfloat16 over float32 weights": 1}
    assert patch.calls == {"original": 1, "fused_loss": 1}
    assert_close_to_reference(
        losses["coda"], losses["truth"], name="loss", baseline=losses["eager"], atol=1e-3
    )
    theirs, truth = dict(plain.named_parameters()), dict(ref.named_parameters())
    for name, p in mine.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert_close_to_reference(
            p.grad, truth[name].grad, name=f"d{name}", baseline=theirs[name].grad, atol=1e-3
        )


@pytest.mark.parametrize("name", ["gqa", "mha_tied"])
def test_fuse_autocast_runs_the_stack_in_autocasts_dtype_over_fp32_weights(name):
    """``apply_coda(..., fuse_autocast=True)`` under AMP (fp32 master weights in
    ``torch.autocast``): the fused stack runs in bf16 (its weights cast per forward, its
    residual stream in bf16) and the loss stays fused. Loss and every gradient (arriving
    in fp32): within 2 x the error of the same model in bf16 (Hugging Face, no autocast),
    the numerics it promises, against float64. Without autocast it is the fp32 stack."""
    ref, plain, _ = pair(**CONFIGS[name], patch=False)
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine, fuse_autocast=True)
    bf16_model = copy.deepcopy(plain).to(torch.bfloat16)
    ids, labels = batch(ref.config.vocab_size)
    losses = {}
    for key, model in (("truth", ref), ("bf16", bf16_model), ("coda", mine)):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=key == "coda"):
            out = model(ids, labels=labels)
        assert out.logits is None if key == "coda" else out.logits is not None
        out.loss.backward()
        losses[key] = out.loss.detach().double()
    assert not patch.fallbacks and patch.calls == {"fused_stack": 1, "fused_loss": 1}
    assert_close_to_reference(
        losses["coda"], losses["truth"], name="loss", baseline=losses["bf16"], atol=1e-3
    )
    theirs, truth = dict(bf16_model.named_parameters()), dict(ref.named_parameters())
    for pname, p in mine.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None, pname
        assert p.grad.dtype == torch.float32, pname
        assert_close_to_reference(
            p.grad, truth[pname].grad, name=f"d{pname}", baseline=theirs[pname].grad, atol=1e-3
        )
    # outside autocast the same patch runs the fp32 stack (its own template)
    mine.zero_grad(), ref.zero_grad()
    out, want = mine(ids, labels=labels), ref(ids, labels=labels)
    assert_close_to_reference(out.loss, want.loss, name="loss (fp32)", tol=TOL)
    assert patch.calls == {"fused_stack": 2, "fused_loss": 2}


def test_fuse_autocast_is_off_by_default_and_strict_names_it():
    """Without ``fuse_autocast`` AMP falls back (reason counted); ``strict`` refuses the
    fallback naming the option; switched on (``patch.fuse_autocast = True``) the next
    call runs the fused stack."""
    ref, plain, _ = pair(**CONFIGS["gqa"], patch=False)
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine)
    ids, labels = batch(ref.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine(ids, labels=labels).loss.backward()
    assert patch.fallbacks == {"autocast to bfloat16 over float32 weights": 1}
    patch.strict = True  # the refusal names the option that fuses it
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(
            RuntimeError, match=r"autocast to bfloat16 over float32 weights.*fuse_autocast=True"
        ),
    ):
        mine(ids, labels=labels)
    patch.fuse_autocast = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine(ids, labels=labels).loss.backward()
    assert patch.fallbacks == {"autocast to bfloat16 over float32 weights": 2}
    assert patch.calls["fused_stack"] == 1


def test_gradient_checkpointing_keeps_the_fused_loss():
    """With gradient checkpointing the decoder stack runs Hugging Face's checkpointed
    forward (its reason counted); the loss over its output stays fused (no logits), with
    HF's loss and every gradient."""
    ref, mine, patch = pair(**CONFIGS["gqa"])
    kw = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.gradient_checkpointing_enable(**kw), mine.gradient_checkpointing_enable(**kw)
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    want = ref(ids, labels=labels).loss
    out = mine(ids, labels=labels)
    assert out.logits is None
    assert_close_to_reference(out.loss, want, name="loss (checkpointed stack)", tol=TOL)
    assert patch.calls == {"original": 1, "fused_loss": 1}
    assert patch.fallbacks == {"gradient_checkpointing": 1}
    want.backward()
    out.loss.backward()
    assert_grads_match(mine, ref)


def test_packed_position_ids_fall_back_to_hf_attention():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size, S=7)
    ref.train(), mine.train()
    offset = torch.arange(7)[None] + 3  # consecutive: one sequence per row, fused
    assert_close_to_reference(
        mine(ids, labels=labels, position_ids=offset).loss,
        ref(ids, labels=labels, position_ids=offset).loss,
        name="loss (offset positions)",
        tol=TOL,
    )
    assert patch.calls["fused_loss"] == 1
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]]).expand(2, 7)  # two sequences per row
    assert_close_to_reference(
        mine(ids, labels=labels, position_ids=packed).loss,
        ref(ids, labels=labels, position_ids=packed).loss,
        name="loss (packed sequences, original stack)",
        tol=TOL,
    )
    assert patch.fallbacks == {"position_ids (packed sequences)": 1}
    assert patch.calls == {"original": 1, "fused_stack": 1, "fused_loss": 2}


def test_mistral_sliding_window():
    cfg = {k: v for k, v in CONFIGS["gqa"].items() if not k.startswith("rope")}
    cfg["sliding_window"] = 6
    ref, mine, patch = pair(MistralForCausalLM, MistralConfig, **cfg)
    assert patch.family == "mistral"
    ref.train(), mine.train()
    for S in (6, 9):  # within the window: fused; beyond: the original forward
        ids, labels = batch(cfg["vocab_size"], S=S)
        want, got = ref(ids, labels=labels).loss, mine(ids, labels=labels).loss
        assert_close_to_reference(got, want, name=f"mistral loss S={S}", tol=TOL)
    # beyond the window the loss is still fused, over the original stack's output
    assert patch.calls == {"fused_stack": 1, "fused_loss": 2, "original": 1}
    assert patch.fallbacks == {"sliding_window": 1}


def test_torch_compile_of_the_patched_model_keeps_its_results():
    """``torch.compile`` of a patched model (aot_eager: dynamo and AOT autograd, no codegen)
    runs the fused seams (their counters advance) and gives the uncompiled patched model's
    loss and every gradient. It compiles with graph breaks (around autograd functions)."""
    _, mine, patch = pair(**CONFIGS["gqa"])
    other = copy.deepcopy(mine)
    other_patch = other.__dict__["_coda_patch"]
    ids, labels = batch(mine.config.vocab_size)
    mine.train(), other.train()
    want = mine(ids, labels=labels).loss
    want.backward()
    torch._dynamo.reset()
    got = torch.compile(other, backend="aot_eager")(ids, labels=labels).loss
    got.backward()
    assert other_patch.calls == {"fused_stack": 1, "fused_loss": 1}, other_patch.fallbacks
    assert_close_to_reference(got, want, name="compiled loss", tol=TOL)
    theirs = dict(mine.named_parameters())
    for name, p in other.named_parameters():
        assert_close_to_reference(p.grad, theirs[name].grad, name=f"compiled d{name}", tol=TOL)


def test_torch_compile_of_a_fuse_autocast_model_under_autocast():
    """``torch.compile`` (aot_eager) of a model patched with ``fuse_autocast=True``, called
    under CPU autocast over its fp32 weights: the fused seams run (counters), and the loss
    and every gradient equal the uncompiled patched model's under the same autocast."""
    _, plain, _ = pair(**CONFIGS["gqa"], patch=False)
    mine = copy.deepcopy(plain)
    apply_coda(mine, fuse_autocast=True)
    other = copy.deepcopy(mine)
    other_patch = other.__dict__["_coda_patch"]
    ids, labels = batch(mine.config.vocab_size)
    mine.train(), other.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = mine(ids, labels=labels).loss
    want.backward()
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(other, backend="aot_eager")(ids, labels=labels).loss
    got.backward()
    assert other_patch.calls == {"fused_stack": 1, "fused_loss": 1}, other_patch.fallbacks
    assert_close_to_reference(got.float(), want.float(), name="compiled loss", tol=TOL)
    theirs = dict(mine.named_parameters())
    for name, p in other.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert_close_to_reference(p.grad, theirs[name].grad, name=f"compiled d{name}", tol=TOL)


def test_torch_compile_of_the_patched_model_does_not_recompile_per_length():
    """``torch.compile`` as users call it (dynamic shapes left to dynamo) over four
    sequence lengths: dynamo compiles the first length, recompiles once with a dynamic
    length at the second, and never again (the fused seams' counters and caches must not
    enter its guards); every call fused, each loss equal to the uncompiled model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, mine, patch = pair(**CONFIGS["gqa"])
    other = copy.deepcopy(mine)
    other_patch = other.__dict__["_coda_patch"]
    mine.train(), other.train()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(other, backend=counter)
    frames = []
    for S in (9, 12, 17, 21):
        ids, labels = batch(mine.config.vocab_size, S=S, seed=S)
        want = mine(ids, labels=labels).loss
        got = compiled(ids, labels=labels).loss
        got.backward()
        assert_close_to_reference(got, want, name=f"compiled loss S={S}", tol=TOL)
        frames.append(counter.frame_count)
    assert frames[1] == frames[2] == frames[3], frames
    assert other_patch.calls == {"fused_stack": 4, "fused_loss": 4}, other_patch.fallbacks


def test_revert_restores_the_original_model():
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS["gqa"], attn_implementation="eager")
    plain = LlamaForCausalLM(config)
    randomize(plain, 4)
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine)
    assert "forward" in mine.__dict__ and "forward" in mine.model.__dict__
    with pytest.raises(ValueError, match="already patched"):
        apply_coda(mine)
    patch.revert()
    assert "forward" not in mine.__dict__ and "forward" not in mine.model.__dict__
    assert "_coda_patch" not in mine.__dict__ and "_coda_patch" not in mine.model.__dict__
    ids, labels = batch(config.vocab_size)
    plain.train(), mine.train()
    want, got = plain(ids, labels=labels), mine(ids, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert patch.calls == {}  # nothing ran through the patch after revert
    with pytest.raises(RuntimeError, match="already reverted"):
        patch.revert()
    with pytest.raises(ValueError, match="not patched"):
        revert_coda(mine)
    # apply again, then revert with the function
    apply_coda(mine)
    assert mine(ids, labels=labels).logits is None
    revert_coda(mine)
    assert torch.equal(mine(ids, labels=labels).loss, want.loss)


def test_patched_forwards_report_the_original_signatures():
    """``inspect.signature(model.forward)`` is the original's at both seams, in a deepcopy
    too: Hugging Face's ``Trainer`` keeps only the dataset columns that it names
    (``remove_unused_columns``, on by default), which a ``(*args, **kwargs)`` forward
    would strip of ``input_ids``."""
    import inspect

    ref, mine, patch = pair(**CONFIGS["gqa"])
    clone = copy.deepcopy(mine)
    for model in (mine, clone):
        assert inspect.signature(model.forward) == inspect.signature(ref.forward)
        assert inspect.signature(model.model.forward) == inspect.signature(ref.model.forward)
        kept = set(inspect.signature(model.forward).parameters)  # Trainer's column filter
        assert {"input_ids", "attention_mask", "labels"} <= kept
    ids, labels = batch(mine.config.vocab_size)
    mine.train(), clone.train()
    torch.testing.assert_close(clone(ids, labels=labels).loss, mine(ids, labels=labels).loss)
    patch.revert()
    clone.__dict__["_coda_patch"].revert()


def test_hugging_face_trainer_trains_the_patched_model_like_the_original(tmp_path):
    """Hugging Face's ``Trainer`` with its defaults (``remove_unused_columns`` on, which
    reads ``model.forward``'s signature; ``num_items_in_batch`` passed to the model under
    gradient accumulation): two optimizer steps of two micro-batches each, from the same
    weights and data, leave the patched model's weights equal to the unpatched one's, and
    every micro-batch ran fused."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    _, plain, _ = pair(**CONFIGS["gqa"], patch=False)
    before = {k: v.detach().clone() for k, v in plain.named_parameters()}
    mine = copy.deepcopy(plain)
    patch = apply_coda(mine)
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        ids = torch.randint(0, plain.config.vocab_size, (9,), generator=g)
        labels = ids.clone()
        labels[: 1 + i % 4] = -100  # prompts of different lengths: per-micro-batch counts differ
        rows.append({"input_ids": ids, "attention_mask": torch.ones(9, dtype=torch.long),
                     "labels": labels})  # fmt: skip
    for name, model in (("plain", plain), ("coda", mine)):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=2, learning_rate=0.1, optim="sgd",
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
            data_seed=0,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=rows).train()
    assert patch.calls == {"fused_stack": 4, "fused_loss": 4}, (patch.calls, patch.fallbacks)
    theirs = dict(plain.named_parameters())
    for pname, p in mine.named_parameters():
        assert not torch.equal(p, before[pname]), pname  # trained
        assert_close_to_reference(p, theirs[pname], name=pname, tol=TOL)


def test_revert_refuses_when_forward_was_replaced_after_apply():
    _, mine, patch = pair(**CONFIGS["mha_tied"])
    mine.forward = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="replaced after apply_coda"):
        patch.revert()


def test_weights_are_shared_and_state_dict_round_trips():
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS["gqa"], attn_implementation="eager")
    model = LlamaForCausalLM(config)
    randomize(model, 5)
    params = dict(model.named_parameters())
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    patch = apply_coda(model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in params.values())
    # load another model's weights: the patched forward computes with them
    other = LlamaForCausalLM(config)
    randomize(other, 6)
    model.load_state_dict(other.state_dict())
    ids, labels = batch(config.vocab_size)
    other.train(), model.train()
    assert_close_to_reference(
        model(ids, labels=labels).loss, other(ids, labels=labels).loss, name="loss", tol=TOL
    )
    # and an optimizer step on the shared parameters changes what the patched model computes
    loss0 = model(ids, labels=labels).loss
    loss0.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert model(ids, labels=labels).loss < loss0
    assert patch.calls["fused_loss"] == 3


def test_peft_style_wrapper_is_unwrapped():
    class Wrapper(nn.Module):  # the get_base_model() interface of peft.PeftModel
        def __init__(self, model):
            super().__init__()
            self.base = model

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    ref, mine, _ = pair(**CONFIGS["mha_tied"], patch=False)
    wrapped = Wrapper(mine)
    patch = apply_coda(wrapped)
    assert patch.model is mine
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), wrapped.train()
    assert_close_to_reference(
        wrapped(ids, labels=labels).loss, ref(ids, labels=labels).loss, name="loss", tol=TOL
    )
    assert patch.calls["fused_loss"] == 1
    revert_coda(wrapped)
    assert "forward" not in mine.__dict__


def test_adapter_wrapped_projection_is_refused_by_name():
    class LoraLinear(nn.Module):  # a projection wrapped the way PEFT's LoRA wraps it
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.weight = base, base.weight

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIGS["gqa"]))
    attn = model.model.layers[1].self_attn
    attn.v_proj = LoraLinear(attn.v_proj)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.v_proj"):
        apply_coda(model)
    assert "forward" not in model.__dict__  # nothing patched on error


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(attention_bias=True), "config.attention_bias"),
        (dict(mlp_bias=True), "config.mlp_bias"),
        (dict(hidden_act="gelu"), "config.hidden_act"),
        (dict(attention_dropout=0.1), "config.attention_dropout"),
        (
            rope_config("dynamic", 1e4, factor=2.0),
            r"config\.rope_(parameters|scaling)\['rope_type'\]='dynamic'",
        ),
        (
            rope_config("yarn", 1e4, factor=2.0, original_max_position_embeddings=8),
            r"(?s)'yarn'.*rotary_emb\.attention_scaling",
        ),
    ],
)
def test_unsupported_config_error_names_the_field(change, field):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(CONFIGS["gqa"], **change)))
    with pytest.raises(UnsupportedModelError, match=field):
        apply_coda(model)
    assert "forward" not in model.__dict__ and "forward" not in model.model.__dict__


def test_qwen2_is_refused_for_its_qkv_bias():
    cfg = {k: v for k, v in CONFIGS["gqa"].items() if not k.startswith("rope")}
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    with pytest.raises(UnsupportedModelError, match="qwen2") as info:
        apply_coda(model)
    assert "self_attn.q_proj.bias" in str(info.value)


def test_custom_loss_function_is_refused_unless_fuse_loss_false():
    ref, model, _ = pair(**CONFIGS["mha_tied"], patch=False)
    model.loss_function = lambda logits, labels, **kw: logits.sum()
    with pytest.raises(UnsupportedModelError, match="loss_function"):
        apply_coda(model)
    patch = apply_coda(model, fuse_loss=False)  # the stack is fused, HF's (custom) loss kept
    ids, labels = batch(ref.config.vocab_size)
    model.train()
    out = model(ids, labels=labels)
    assert patch.calls == {"fused_stack": 1}
    assert_close_to_reference(out.loss, ref(ids).logits.sum(), name="custom loss", tol=TOL)


def test_nothing_matched_raises():
    with pytest.raises(NothingMatchedError, match="nothing was patched"):
        apply_coda(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(NothingMatchedError):
        apply_coda(nn.Linear(4, 4))


def test_bare_decoder_stack_is_patched():
    ref, _, _ = pair(**CONFIGS["gqa"], patch=False)
    stack = copy.deepcopy(ref.model).float()
    patch = apply_coda(stack)
    assert [r.path for r in patch.replaced] == [""]
    ids, _ = batch(ref.config.vocab_size)
    stack.train(), ref.train()
    got = stack(ids).last_hidden_state
    assert_close_to_reference(got, ref.model(ids).last_hidden_state, name="hidden", tol=TOL)
    assert patch.calls == {"fused_stack": 1}


def test_deepcopy_of_a_patched_model_is_patched_on_its_own_weights():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    clone = copy.deepcopy(mine)  # e.g. a frozen reference model for RL / distillation
    clone_patch = clone.__dict__["_coda_patch"]
    assert clone_patch is not patch and clone_patch.model is clone
    with torch.no_grad():
        clone.model.layers[0].mlp.down_proj.weight.mul_(3)
        ref_changed = copy.deepcopy(ref)
        ref_changed.model.layers[0].mlp.down_proj.weight.mul_(3)
    ids, labels = batch(ref.config.vocab_size)
    for m in (ref, ref_changed, mine, clone):
        m.train()
    assert_close_to_reference(
        clone(ids, labels=labels).loss, ref_changed(ids, labels=labels).loss, name="clone", tol=TOL
    )
    assert_close_to_reference(mine(ids, labels=labels).loss, ref(ids, labels=labels).loss, tol=TOL)
    assert clone_patch.calls["fused_loss"] == 1 and patch.calls["fused_loss"] == 1
    clone_patch.revert()
    assert "forward" not in clone.__dict__ and "forward" in mine.__dict__


def test_docs_example_runs():
    """docs/integrations.md: its example runs as written."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ns: dict = {}
    exec(compile(block, "docs/integrations.md", "exec"), ns)  # noqa: S102
    assert ns["generated"].shape == (2, 12)
    assert not ns["patch"].active and "forward" not in ns["model"].__dict__


@pytest.mark.parametrize("name", ["gqa", "mha_tied"])
def test_assembled_layouts_are_not_kept_from_forward_to_backward(name):
    """The fused ops save the per-step q|k|v and gate/up layouts as recipes: no tensor of
    their shapes reaches an outer saved-tensor hook, and the gradients still match HF."""
    ref, mine, patch = pair(**CONFIGS[name])
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    cfg = ref.config
    D = cfg.hidden_size // cfg.num_attention_heads
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
    shapes = {(qkv_rows, cfg.hidden_size), (2 * cfg.intermediate_size, cfg.hidden_size)}
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mine(ids, labels=labels)
    assert patch.calls["fused_stack"] == 1
    assert packed and not shapes & set(packed), sorted(set(packed))
    ref(ids, labels=labels).loss.backward()
    out.loss.backward()
    assert_grads_match(mine, ref)


def test_in_place_parameter_change_between_forward_and_backward_raises():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size)
    mine.train()
    out = mine(ids, labels=labels)
    with torch.no_grad():
        mine.model.layers[0].mlp.up_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.loss.backward()


def test_each_layers_weights_are_made_just_before_it_runs(monkeypatch):
    """The per-step layouts are assembled layer by layer, each right before its layer
    runs (so on a GPU the host assembles layer i + 1's while layer i's kernels run), and
    the result is unchanged (the gradients match Hugging Face's)."""
    from coda.integrations import transformers as integration
    from coda.nn import FusedLlamaDecoderLayer

    ref, mine, patch = pair(**CONFIGS["gqa"])
    events = []
    layer = integration._StackTensors.layer
    forward = FusedLlamaDecoderLayer.forward
    monkeypatch.setattr(
        integration._StackTensors, "layer", lambda s, i: events.append(i) or layer(s, i)
    )
    monkeypatch.setattr(
        FusedLlamaDecoderLayer, "forward", lambda s, *a: events.append("run") or forward(s, *a)
    )
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    out = mine(ids, labels=labels)
    assert patch.calls["fused_stack"] == 1
    assert events == [e for i in range(ref.config.num_hidden_layers) for e in (i, "run")]
    ref(ids, labels=labels).loss.backward()
    out.loss.backward()
    assert_grads_match(mine, ref)


# ---- what changes after apply_coda (the integration audit of 2026-11-29) ---------------


class _LoraLinear(nn.Module):
    """A projection wrapped the way PEFT's LoRA wraps it: base weight plus a low-rank
    update the fused stack would not see."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.normal_(self.lora_B.weight, std=0.5)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_adapters_added_after_apply_fall_back_and_train_the_adapters():
    """LoRA put on the projections after patching (what get_peft_model does to a patched
    model): the fused stack would compute the base model alone; the call falls back to
    the original forward, whose loss and adapter gradients match the unpatched model's."""
    ref, mine, patch = pair(**CONFIGS["gqa"])
    torch.manual_seed(3)
    for theirs, ours in zip(ref.model.layers, mine.model.layers, strict=True):
        theirs.self_attn.q_proj = _LoraLinear(theirs.self_attn.q_proj)
        ours.self_attn.q_proj = _LoraLinear(ours.self_attn.q_proj)
        for name in ("lora_A", "lora_B"):
            getattr(ours.self_attn.q_proj, name).weight.data.copy_(
                getattr(theirs.self_attn.q_proj, name).weight.data
            )
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()
    want, out = ref(ids, labels=labels).loss, mine(ids, labels=labels).loss
    assert_close_to_reference(out, want, name="loss with adapters", tol=TOL)
    assert "fused_stack" not in patch.calls
    assert list(patch.fallbacks) == [
        "a module under model.layers.0.self_attn was replaced after apply_coda (adapters or "
        "quantized layers added since? revert and re-apply coda)"
    ]
    want.backward()
    out.backward()
    a_ref = ref.model.layers[1].self_attn.q_proj.lora_A.weight.grad
    a_mine = mine.model.layers[1].self_attn.q_proj.lora_A.weight.grad
    assert a_mine is not None
    assert_close_to_reference(a_mine, a_ref, name="dlora_A", tol=TOL)


def test_a_new_rotary_embedding_or_eps_after_apply_falls_back():
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size)
    mine.train()
    mine.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-2
    mine(ids, labels=labels)
    assert list(patch.fallbacks) == [
        "model.layers.1.post_attention_layernorm's eps changed after apply_coda (1e-06 -> 0.01)"
    ]
    mine.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-6
    mine.model.rotary_emb = copy.deepcopy(mine.model.rotary_emb)
    mine(ids, labels=labels)
    assert "a module under model was replaced" in list(patch.fallbacks)[-1]


def test_hooks_on_bypassed_modules_run_through_the_original_forward():
    """A forward hook on a decoder layer (or the final norm, or the LM head) would be
    skipped by the fused stack: the call falls back and the hook runs (and its change
    reaches the loss and gradients as in the unpatched model)."""
    ref, mine, patch = pair(**CONFIGS["gqa"])
    ids, labels = batch(ref.config.vocab_size)
    ref.train(), mine.train()

    def shift(module, inputs, output):
        return (output[0] + 0.5,) + tuple(output[1:]) if isinstance(output, tuple) else output + 0.5

    for model in (ref, mine):
        model.model.layers[1].register_forward_hook(shift)
    want, out = ref(ids, labels=labels).loss, mine(ids, labels=labels).loss
    assert_close_to_reference(out, want, name="loss with a layer hook", tol=TOL)
    assert list(patch.fallbacks) == ["hooks on model.layers.1"]
    want.backward()
    out.backward()
    assert_grads_match(mine, ref)
    fired = []
    _, mine2, patch2 = pair(**CONFIGS["gqa"])
    mine2.train()
    mine2.model.norm.register_forward_hook(lambda *a: fired.append("norm"))
    mine2(ids, labels=labels)
    assert fired == ["norm"] and patch2.calls["fused_stack"] == 1  # through the stack's seam
    mine2.lm_head.register_forward_pre_hook(lambda *a: fired.append("head"))
    mine2(ids, labels=labels)
    assert fired[-1] == "head" and patch2.fallbacks["hooks on lm_head"] == 1


def test_patching_the_stack_then_the_model_is_refused():
    _, mine, patch = pair(patch=False, **CONFIGS["gqa"])
    first = apply_coda(mine.model)
    with pytest.raises(ValueError, match=r"decoder stack \(model\) is already patched"):
        apply_coda(mine)
    first.revert()
    apply_coda(mine).revert()


def test_a_compiled_model_is_refused_with_the_order_that_works():
    _, mine, _ = pair(patch=False, **CONFIGS["gqa"])
    with pytest.raises(UnsupportedModelError, match=r"apply_coda\(model\); model = torch.compile"):
        apply_coda(torch.compile(mine))


def test_float64_weights_fall_back_with_the_reason():
    """coda's ops take bf16 / fp16 / fp32; a float64 model runs its original forward and
    Hugging Face's loss (not an internal dtype error)."""
    ref, _, _ = pair(patch=False, **CONFIGS["gqa"])  # ref is float64
    patch = apply_coda(ref)
    ids, labels = batch(ref.config.vocab_size)
    ref.train()
    out = ref(ids, labels=labels)
    assert out.logits is not None and torch.isfinite(out.loss)
    # the causal LM's original forward, whose call of the stack falls back too
    assert patch.fallbacks == {"lm_head weight in float64": 1, "weights in float64": 1}
    ref.eval()
    ref(ids, use_cache=False)
    assert patch.fallbacks["weights in float64"] == 2


def test_a_model_built_on_meta_is_patched_and_reads_its_frequencies_later():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS["gqa"], attn_implementation="eager"))
    patch = apply_coda(model)
    ids, labels = batch(model.config.vocab_size)
    model.train()
    model(ids, labels=labels)  # Hugging Face's own forward, on meta tensors
    assert "meta device" in list(patch.fallbacks)[0]
    ref = LlamaForCausalLM(LlamaConfig(**CONFIGS["gqa"], attn_implementation="eager"))
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    model.model.rotary_emb.inv_freq.copy_(ref.model.rotary_emb.inv_freq)
    ref.train()
    assert_close_to_reference(
        model(ids, labels=labels).loss, ref(ids, labels=labels).loss, name="loss", tol=TOL
    )
    assert patch.calls["fused_stack"] == 1
