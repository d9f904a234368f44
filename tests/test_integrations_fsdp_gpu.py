"""coda under FSDP2 on Hopper GPUs (marker ``gpu``): one NCCL process per visible GPU
trains a bf16 Hugging Face Llama patched by ``apply_coda`` (coda's fused kernels), and the
same model unpatched under the same sharding; both against one unsharded float64 model
that sees every rank's batch (FSDP averages the ranks' gradients).

The CPU twin is tests/test_integrations_fsdp.py (gloo, the reference path). Here DESIGN.md
6.3's rule: for the loss and every reduced gradient, the normwise relative error of coda
against float64 is at most 2 x that of the unpatched bf16 model under the same sharding
+ ``ATOL``. Shardings: the root unit only (the fused stack and loss inside its forward),
the decoder layers as units (the stack's original forward, the loss fused), and the LM
head as a unit too (the loss runs inside the head's call: FSDP regathers its weight for
the deferred dh GEMM of the backward and reduce-scatters dW). With one GPU the mesh has
one rank: every parameter is still a DTensor and every hook runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf_helpers import SHARDINGS, SMALL_LLAMA, free_port, randomize, shard, whole

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_nccl_available():
    pytest.skip("torch.distributed with NCCL is not available", allow_module_level=True)

ATOL = 2e-3
ROWS = 2  # sequences per rank
SEQ = 200  # tokens per sequence (ragged against every tile)
CONFIG = SMALL_LLAMA


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    randomize(model, 0)
    return model.to(torch.bfloat16)  # the float64 reference copies these bf16 weights


def _batches(world: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS * world, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :17] = -100  # a prompt
    return ids, labels


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = whole(p.grad).double()
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _worker(rank: int, world: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from coda.integrations.transformers import apply_coda

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        mesh = init_device_mesh("cuda", (world,))
        ids, labels = _batches(world)
        rows = slice(ROWS * rank, ROWS * rank + ROWS)
        base = _model()
        # the float64 reference: every rank's micro-batch, the mean of their losses
        ref = copy.deepcopy(base).to(dev, torch.float64).train()
        losses = [
            ref(
                ids[ROWS * r : ROWS * r + ROWS].to(dev),
                labels=labels[ROWS * r : ROWS * r + ROWS].to(dev),
            ).loss
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        want_loss = losses[rank].detach()
        want = {n: p.grad for n, p in ref.named_parameters()}
        del ref
        for mode in SHARDINGS:
            errs = {}
            for who in ("eager", "coda"):
                model = shard(copy.deepcopy(base).to(dev).train(), mode, mesh)
                patch = apply_coda(model) if who == "coda" else None
                out = model(ids[rows].to(dev), labels=labels[rows].to(dev))
                out.loss.backward()
                errs[who] = {"loss": _err(out.loss.detach(), want_loss)}
                errs[who].update({n: _err(g, want[n]) for n, g in _grads(model).items()})
                if patch is not None:
                    assert out.logits is None, mode
                    assert patch.calls["fused_loss"] == 1, (mode, patch.calls)
                    assert patch.calls["fused_stack"] == (mode == "root"), (mode, patch.calls)
                del model, out
            for name, e in errs["coda"].items():
                bound = 2 * errs["eager"][name] + ATOL
                assert e <= bound, (
                    f"{mode} {name}: coda {e:.2e} > {bound:.2e} (eager {errs['eager'][name]:.2e})"
                )
    finally:
        dist.destroy_process_group()


def test_fsdp2_training_on_every_gpu_matches_float64():
    world = torch.cuda.device_count()
    torch.multiprocessing.spawn(_worker, args=(world, free_port()), nprocs=world)
