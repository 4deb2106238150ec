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
A SwiGLU MLP also names `swiglu_down`: with RANKSERVE_SWIGLU_EPILOGUE and a plain 16-bit gate_up
(no quantization, no LoRA), gate_up's kernel applies silu(gate) * up in its epilogue
(kernels/gemv.py `add_rms_norm_swiglu`) and down runs as a plain GEMM.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels import gemv
from .quantization import Unquantized


def add_norm_then(block: nn.Module, h: torch.Tensor, delta: torch.Tensor, norm: nn.Module,
                  *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(block(norm(h + delta), *args), h + delta)."""
    proj = getattr(block, "in_proj", None)
    if proj is None:
        h = h + delta
        return block(norm(h), *args), h
    down = getattr(block, "swiglu_down", None)
    if down is not None and gemv.SWIGLU_EPILOGUE and type(proj.quant) is Unquantized:
        act, h = gemv.add_rms_norm_swiglu(h, delta, norm.weight, norm.eps, proj.weight, proj.bias)
        return down(act), h
    y, h = proj.quant.add_rms_norm_apply(proj, h, delta, norm.weight, norm.eps, proj.bias)
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
    layers and adds the last delta at the end.

    Auxiliary hidden states (EAGLE-3 reads the target's residual stream at a few depths):
    `capture_aux(layer_ids, out)` makes every forward copy the stream entering layer i (i ==
    num_layers: leaving the last layer, before the norm) into its column block of `out`, a
    persistent buffer, so CUDA graphs replay the copies too."""
    aux_slots: dict[str, int] = {}
    aux_out: torch.Tensor | None = None

    def capture_aux(self, layer_ids: list[int], out: torch.Tensor) -> None:
        self.aux_slots = {str(i): j for j, i in enumerate(layer_ids)}
        self.aux_out = out

    def _aux(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        j = self.aux_slots.get(key)
        if j is not None:
            H = h.shape[-1]
            self.aux_out[:h.shape[0], j * H:(j + 1) * H].copy_(h + delta)

    def forward(self, input_ids, positions, attn, hidden_states=None):
        h = self.embed_tokens(input_ids) if self.pi.is_first_stage else hidden_states
        delta = torch.zeros_like(h)  # h + 0 is exact: the first layer sees h unchanged
        for key, layer in self.layers.items():
            if self.aux_slots:
                self._aux(key, h, delta)
            h, delta = layer(h, delta, positions, attn)
        if self.aux_slots:
            self._aux(str(int(key) + 1), h, delta)
        h = h + delta
        return self.norm(h) if self.pi.is_last_stage else h
