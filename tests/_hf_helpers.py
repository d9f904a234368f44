"""Helpers shared by the Hugging Face integration tests (CPU and GPU, single process and
FSDP): deterministic weights and the distributed plumbing."""

from __future__ import annotations

import math
import socket

import torch

#: A small Llama config for the GPU tests (GQA 2:1, head_dim 64, an odd vocabulary):
#: ``LlamaConfig(**SMALL_LLAMA, ...)``.
SMALL_LLAMA = dict(
    vocab_size=1531,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order one (HF's init, std 0.02, makes every logit nearly equal): norm
    weights near 1, matrices scaled by 1 / sqrt(fan-in), drawn in fp32 from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.2 * r if p.dim() == 1 else r / math.sqrt(p.shape[-1]))


def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one whole tensor: a DTensor (an FSDP2 gradient) gathered, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


#: the FSDP2 shardings the FSDP tests run: "root" (``fully_shard(model)`` only), "layers"
#: (each decoder layer a unit, then the root), "head" (the LM head a unit too)
SHARDINGS = ("root", "layers", "head")


def shard(model: torch.nn.Module, mode: str, mesh) -> torch.nn.Module:
    """Apply FSDP2's ``fully_shard`` to a Hugging Face causal LM as ``mode`` says
    (``SHARDINGS``); returns the model."""
    from torch.distributed.fsdp import fully_shard

    if mode != "root":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    if mode == "head":
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
