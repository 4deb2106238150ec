"""Mamba2 layer ops on varlen batches with per-request state slots: the causal depthwise conv1d
(prefill and decode) and the SSD scan (chunked prefill and the single-step decode update), as
plain-torch references; the Triton twins are in kernels/triton_mamba.py.

Layout (mixed batches as in kernels/attention.py):
  x: [T, C] (conv) or [T, H, P] (scan), the tokens of request i at query_start_loc[i]:[i+1]
  query_start_loc: int32 [B + 1]; seq_lens: int32 [B], context length *including* this step's
      tokens, so a request continues from its saved state iff seq_lens[i] > q_len_i
      (a new or preempted request starts from zeros; nothing needs clearing)
  state_idx: int32 [B], the request's state slot (-1: a padding request, touches nothing)
  conv_state: [num_slots, K - 1, C], the last K - 1 inputs of the request (oldest first)
  conv weight: [C, K], bias [C] or None; output silu(conv(x) + bias)
  ssm_state: [num_slots, H, P, N] (fp32); dt: [T, H] raw (softplus(dt + dt_bias) applied here);
  A: [H] (negative: -exp(A_log)); B, C: [T, G, N] with H % G == 0 (head h reads group
  h // (H // G)); D: [H]; y: [T, H, P]
Recurrence per head, token t: dt = softplus(dt_t + dt_bias), s = exp(dt * A) * s + dt * x_t B_t^T,
y_t = s C_t + D x_t. The chunked (SSD) form computes the same thing a chunk at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .custom_op import custom_op


def _spans(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_idx: torch.Tensor):
    qsl = query_start_loc.tolist()
    for i, (slot, seq_len) in enumerate(zip(state_idx.tolist(), seq_lens.tolist())):
        start, end = qsl[i], qsl[i + 1]
        if slot < 0 or end == start:
            continue
        yield start, end, slot, seq_len > end - start  # continues from its saved state?


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, state_idx: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) of each request's tokens after its saved K - 1 inputs; the
    state is updated in place. Prefill, chunked prefill and decode alike."""
    K = weight.shape[1]
    out = torch.zeros_like(x)
    for start, end, slot, cont in _spans(query_start_loc, seq_lens, state_idx):
        prev = conv_state[slot].float() if cont else x.new_zeros(K - 1, x.shape[1], dtype=torch.float32)
        ext = torch.cat([prev, x[start:end].float()])  # [K - 1 + L, C]
        y = sum(ext[k:k + end - start] * weight[:, k].float() for k in range(K))
        if bias is not None:
            y = y + bias.float()
        out[start:end] = F.silu(y).to(x.dtype)
        conv_state[slot] = ext[-(K - 1):].to(conv_state.dtype)
    return out


def ssd_scan_ref(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 state_idx: torch.Tensor) -> torch.Tensor:
    """The Mamba2 recurrence token by token (fp32), from each request's saved state (or zeros);
    the final state is written back. The reference for both the chunked scan and the decode
    update."""
    T, H, P = x.shape
    G = B.shape[1]
    rep = H // G
    y = torch.zeros_like(x)
    for start, end, slot, cont in _spans(query_start_loc, seq_lens, state_idx):
        s = ssm_state[slot].float() if cont else x.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        for t in range(start, end):
            d = F.softplus(dt[t].float() + dt_bias.float())  # [H]
            b = B[t].float().repeat_interleave(rep, 0)  # [H, N]
            c = C[t].float().repeat_interleave(rep, 0)
            xt = x[t].float()  # [H, P]
            s = s * torch.exp(d * A.float())[:, None, None] + (d[:, None] * xt)[:, :, None] * b[:, None, :]
            y[t] = ((s @ c[:, :, None])[..., 0] + D.float()[:, None] * xt).to(x.dtype)
        ssm_state[slot] = s.to(ssm_state.dtype)
    return y


@custom_op("rankserve::mamba_conv1d", mutates_args=("conv_state",))
def mamba_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 conv_state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 state_idx: torch.Tensor, is_decode: bool) -> torch.Tensor:
    """silu(causal depthwise conv1d) over a mixed batch, conv states updated (module doc);
    `is_decode` (one token per request, T == B) selects the single-step kernel on the GPU."""
    if x.is_cuda:
        from . import triton_mamba as tm
        conv = tm.causal_conv1d_update if is_decode else tm.causal_conv1d
        return conv(x, weight, bias, conv_state, query_start_loc, seq_lens, state_idx)
    return causal_conv1d_ref(x, weight, bias, conv_state, query_start_loc, seq_lens, state_idx)


@mamba_conv1d.register_fake
def _(x, weight, bias, conv_state, query_start_loc, seq_lens, state_idx, is_decode):
    return torch.empty_like(x)


@custom_op("rankserve::ssd_scan", mutates_args=("ssm_state",))
def ssd_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_idx: torch.Tensor,
             is_decode: bool) -> torch.Tensor:
    """The Mamba2 scan over a mixed batch, SSM states updated (module doc); `is_decode` (at
    most one token per request) selects the single-step update kernel on the GPU."""
    if x.is_cuda:
        from . import triton_mamba as tm
        return tm.ssd_scan(x, dt, dt_bias, A, B, C, D, ssm_state, query_start_loc, seq_lens,
                           state_idx, is_decode=is_decode)
    return ssd_scan_ref(x, dt, dt_bias, A, B, C, D, ssm_state, query_start_loc, seq_lens, state_idx)


@ssd_scan.register_fake
def _(x, dt, dt_bias, A, B, C, D, ssm_state, query_start_loc, seq_lens, state_idx, is_decode):
    return torch.empty_like(x)
