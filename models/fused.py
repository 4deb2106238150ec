"""The fused residual/norm fast path, for families that opt in (`CausalLM.fused_residual`).

A plain pre-norm block is `x = x + attn(norm(x)); x = x + mlp(norm(x))`. Here the residual
stream travels between blocks as a pair (h, delta) with x = h + delta: each block adds the
previous block's output itself, so that the add and the following RMSNorm ride in the prologue of
the block's first GEMM (kernels/gemv.py `add_rms_norm_linear`: at decode sizes one kernel instead
of three), also when each layer is compiled on its own (the runner compiles layers, not the
model: one compilation serves all of them). The arithmetic and its order are the plain block's.

A sub-block takes part by naming its input projection: `in_proj` (a ColumnParallelLinear) and
`from_in_proj(y, *args)`, the rest of its forward. When that projection is quantized (or has
LoRA), its linear method runs the prologue (`add_rms_norm_apply`, models/quantization.py: the add
and the norm in one kernel before the GEMM; FP8 at decode sizes also quantizes the activations
in that kernel, kernels/fp8_prologue.py); any other sub-block gets the add and the norm unfused.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.gemv import add_rms_norm_linear


def add_norm_then(block: nn.Module, h: torch.Tensor, delta: torch.Tensor, norm: nn.Module,
                  *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(block(norm(h + delta), *args), h + delta)."""
    proj = getattr(block, "in_proj", None)
    if proj is None:
        h = h + delta
        return block(norm(h), *args), h
    if not proj.quant.dense:  # quantized (or LoRA): the method's own prologue path
        y, h = proj.quant.add_rms_norm_apply(proj, h, delta, norm.weight, norm.eps, proj.bias)
        return block.from_in_proj(y, *args), h
    y, h = add_rms_norm_linear(h, delta, norm.weight, norm.eps, proj.weight, proj.bias)
    return block.from_in_proj(y, *args), h


class FusedResidualLayer:
    """Mixin for a pre-norm decoder layer (input_layernorm, self_attn, post_attention_layernorm,
    mlp): forward on the (h, delta) stream."""

    def forward(self, h: torch.Tensor, delta: torch.Tensor, positions: torch.Tensor, attn
                ) -> tuple[torch.Tensor, torch.Tensor]:
        a, h = add_norm_then(self.self_attn, h, delta, self.input_layernorm, positions, attn)
        y, h = add_norm_then(self.mlp, h, a, self.post_attention_layernorm)
        return h, y


class FusedResidualDecoder:
    """Mixin for the decoder stack (embed_tokens, layers, norm): threads (h, delta) through the
    layers and adds the last delta at the end."""

    def forward(self, input_ids, positions, attn, hidden_states=None):
        h = self.embed_tokens(input_ids) if self.pi.is_first_stage else hidden_states
        delta = torch.zeros_like(h)  # h + 0 is exact: the first layer sees h unchanged
        for layer in self.layers.values():
            h, delta = layer(h, delta, positions, attn)
        h = h + delta
        return self.norm(h) if self.pi.is_last_stage else h
