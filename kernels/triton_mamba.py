"""Triton kernels for Mamba2 layers (layout and semantics: kernels/mamba.py).

- `causal_conv1d`: one program per (token, channel block) reads its K inputs from this step's
  tokens or, before the request's first token, from its saved conv state; a second launch then
  writes each request's new state (after every program has read the old one).
- `causal_conv1d_update`: decode (one token per request): conv and state shift in one program.
- `ssd_scan`: chunked scan (SSD) for prefill / chunked prefill: one program per (request, head)
  walks its tokens a chunk of CHUNK at a time with the state [P, N] in registers: inside a chunk
  y = ((C B^T) * exp(cs_i - cs_j) * dt_j, causal) X + exp(cs_i) C s + D x, then
  s = exp(cs_L) s + sum_j exp(cs_L - cs_j) dt_j x_j B_j^T (cs: the cumulative sum of dt * A).
- `ssd_update`: the single-step decode update, one program per (request, head).
Grids depend on shapes only; nothing is read back to the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _req_of(qsl_ptr, tok, num_seqs):
    """Largest i in [0, num_seqs) with qsl[i] <= tok (binary search)."""
    lo = tok * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = tl.load(qsl_ptr + mid) <= tok
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def _conv1d_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, seq_lens_ptr, idx_ptr,
                   num_seqs, stride_xt, stride_ss, stride_sk, stride_ot, C: tl.constexpr,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    tok = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cs < C
    if tok >= tl.load(qsl_ptr + num_seqs):  # padding row
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + cs, tl.zeros([BLOCK_C], out_ptr.dtype.element_ty), mask=cm)
        return
    req = _req_of(qsl_ptr, tok, num_seqs)
    start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - start
    slot = tl.load(idx_ptr + req).to(tl.int64)
    # saved-state rows readable: K - 1 when continuing (and a real slot), else none (zeros)
    lim = tl.where((tl.load(seq_lens_ptr + req) > q_len) & (slot >= 0), K - 1, 0)
    acc = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cs, mask=cm, other=0.0).to(tl.float32)
    for k in tl.static_range(K):
        # input position (token row); before `start`: the saved state (as a vector: the
        # interpreter wants vector masks)
        src = tok - (K - 1) + k + tl.zeros([BLOCK_C], tl.int32)
        from_x = src >= start
        v = tl.load(x_ptr + src.to(tl.int64) * stride_xt + cs, mask=cm & from_x, other=0.0)
        j = K - 1 + (src - start)  # row of the saved state (0..K-2) when src < start
        sv = tl.load(state_ptr + slot * stride_ss + j * stride_sk + cs,
                     mask=cm & (src < start) & (src >= start - lim), other=0.0)
        v = tl.where(from_x, v.to(tl.float32), sv.to(tl.float32))
        acc += v * tl.load(w_ptr + cs * K + k, mask=cm, other=0.0).to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + cs, y.to(out_ptr.dtype.element_ty),
             mask=cs < tl.where(slot >= 0, C, 0))


@triton.jit
def _conv1d_state_kernel(x_ptr, state_ptr, qsl_ptr, seq_lens_ptr, idx_ptr, stride_xt, stride_ss,
                         stride_sk, C: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr):
    # new state = the last K - 1 rows of [old state; x]; rows are built in registers first, so
    # the old state is fully read before any row is overwritten
    req = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cs < C
    start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - start
    slot = tl.load(idx_ptr + req).to(tl.int64)
    if (q_len == 0) | (slot < 0):
        return
    lim = tl.where(tl.load(seq_lens_ptr + req) > q_len, K - 1, 0)
    rows = tl.arange(0, 8)  # K - 1 <= 8 rows
    rm = rows < K - 1
    src = q_len - (K - 1) + rows  # position in this request's tokens (< 0: old state row)
    from_x = src >= 0
    v = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + cs[None, :],
                mask=(rm & from_x)[:, None] & cm[None, :], other=0.0)
    j = K - 1 + src
    sv = tl.load(state_ptr + slot * stride_ss + j[:, None] * stride_sk + cs[None, :],
                 mask=(rm & (src < 0) & (src >= -lim))[:, None] & cm[None, :], other=0.0)
    new = tl.where(from_x[:, None], v.to(tl.float32), sv.to(tl.float32))
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_ss + rows[:, None] * stride_sk + cs[None, :],
             new.to(state_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, seq_lens, state_idx):
    """Triton twin of `mamba.causal_conv1d_ref` (prefill, chunked prefill, decode)."""
    T, C = x.shape
    K = weight.shape[1]
    assert K - 1 <= 8 and conv_state.shape[1:] == (K - 1, C) and conv_state.stride(2) == 1
    out = torch.empty_like(x)
    B = seq_lens.shape[0]
    if T == 0:
        return out
    block_c = min(128, triton.next_power_of_2(C))
    w = weight.contiguous()
    _conv1d_kernel[(T, triton.cdiv(C, block_c))](
        x, w, bias if bias is not None else w, conv_state, out, query_start_loc, seq_lens,
        state_idx, B, x.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        C=C, K=K, HAS_BIAS=bias is not None, BLOCK_C=block_c)
    _conv1d_state_kernel[(B, triton.cdiv(C, block_c))](
        x, conv_state, query_start_loc, seq_lens, state_idx, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), C=C, K=K, BLOCK_C=block_c)
    return out


@triton.jit
def _conv1d_update_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, seq_lens_ptr, idx_ptr,
                          stride_xt, stride_ss, stride_sk, stride_ot, C: tl.constexpr,
                          K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    # decode: request i owns token i (T == B); a padding request (no token, or slot -1) writes
    # a zero output row and touches no state
    i = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cs < C
    tok = tl.load(qsl_ptr + i)
    slot = tl.load(idx_ptr + i).to(tl.int64)
    out_ptrs = out_ptr + i.to(tl.int64) * stride_ot + cs
    if (tl.load(qsl_ptr + i + 1) == tok) | (slot < 0):
        tl.store(out_ptrs, tl.zeros([BLOCK_C], out_ptr.dtype.element_ty), mask=cm)
        return
    # a fresh request (a one-token prompt) starts from zeros
    sm = cm & (tl.zeros([BLOCK_C], tl.int32) + tl.load(seq_lens_ptr + i) > 1)
    acc = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cs, mask=cm, other=0.0).to(tl.float32)
    row = state_ptr + slot * stride_ss + cs
    for k in tl.static_range(K - 1):
        v = tl.load(row + k * stride_sk, mask=sm, other=0.0)
        acc += v.to(tl.float32) * tl.load(w_ptr + cs * K + k, mask=cm, other=0.0).to(tl.float32)
        if k > 0:  # shift left: row k - 1 was read in the previous iteration
            tl.store(row + (k - 1) * stride_sk, v, mask=cm)
    x = tl.load(x_ptr + tok.to(tl.int64) * stride_xt + cs, mask=cm, other=0.0)
    acc += x.to(tl.float32) * tl.load(w_ptr + cs * K + K - 1, mask=cm, other=0.0).to(tl.float32)
    tl.store(row + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=cm)
    tl.store(out_ptrs, (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty), mask=cm)


def causal_conv1d_update(x, weight, bias, conv_state, query_start_loc, seq_lens, state_idx):
    """Decode twin of `causal_conv1d` (at most one token per request, T == B: the model
    runner's promise in decode mode): conv and state shift in one launch, no search."""
    T, C = x.shape
    K = weight.shape[1]
    assert K >= 2 and T == seq_lens.shape[0] and conv_state.shape[1:] == (K - 1, C)
    assert conv_state.stride(2) == 1
    out = torch.empty_like(x)
    if T == 0:
        return out
    block_c = min(128, triton.next_power_of_2(C))
    w = weight.contiguous()
    _conv1d_update_kernel[(T, triton.cdiv(C, block_c))](
        x, w, bias if bias is not None else w, conv_state, out, query_start_loc, seq_lens,
        state_idx, x.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        C=C, K=K, HAS_BIAS=bias is not None, BLOCK_C=block_c)
    return out


@triton.jit
def _ssd_scan_kernel(x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, state_ptr, y_ptr,
                     qsl_ptr, seq_lens_ptr, idx_ptr, stride_xt, stride_xh, stride_dtt,
                     stride_bt, stride_bg, stride_ct, stride_cg, stride_ss, stride_sh, stride_sp,
                     stride_yt, stride_yh, P: tl.constexpr, N: tl.constexpr, REP: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    g = h // REP
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(idx_ptr + req).to(tl.int64)
    if (end == start) | (slot < 0):
        return
    # continuing requests read their saved state; new ones start from zeros
    lim = tl.where(tl.load(seq_lens_ptr + req) > end - start, P, 0)
    ps = tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    pm = ps < P
    nm = ns < N
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + ps[:, None] * stride_sp + ns[None, :]
    s = tl.load(s_ptrs, mask=(ps < lim)[:, None] & nm[None, :], other=0.0).to(tl.float32)  # [P, N]
    A = tl.load(A_ptr + h).to(tl.float32)
    Dh = tl.load(D_ptr + h).to(tl.float32)
    dtb = tl.load(dt_bias_ptr + h).to(tl.float32)
    ls = tl.arange(0, CHUNK)
    causal = ls[:, None] >= ls[None, :]
    for c0 in range(start, end, CHUNK):
        t = c0 + ls
        tm = t < end
        t64 = t.to(tl.int64)
        x = tl.load(x_ptr + t64[:, None] * stride_xt + h * stride_xh + ps[None, :],
                    mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)  # [L, P]
        Bm = tl.load(B_ptr + t64[:, None] * stride_bt + g * stride_bg + ns[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0).to(tl.float32)  # [L, N]
        Cm = tl.load(C_ptr + t64[:, None] * stride_ct + g * stride_cg + ns[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        dt = _softplus(tl.load(dt_ptr + t64 * stride_dtt + h, mask=tm, other=0.0).to(tl.float32) + dtb)
        dt = tl.where(tm, dt, 0.0)  # rows past the end: no decay, no input
        cs = tl.cumsum(dt * A, 0)  # [L] log of the decay from the chunk start
        total = tl.sum(dt * A, 0)
        decay = tl.where(causal, tl.exp(cs[:, None] - cs[None, :]), 0.0)  # [L, L]
        M = tl.dot(Cm, tl.trans(Bm)) * decay * dt[None, :]
        y = tl.dot(M, x) + tl.exp(cs)[:, None] * tl.dot(Cm, tl.trans(s)) + Dh * x
        tl.store(y_ptr + t64[:, None] * stride_yt + h * stride_yh + ps[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=tm[:, None] & pm[None, :])
        w = tl.exp(total - cs) * dt  # weight of each token's input in the chunk's final state
        s = tl.exp(total) * s + tl.dot(tl.trans(x * w[:, None]), Bm)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=pm[:, None] & nm[None, :])


@triton.jit
def _ssd_update_kernel(x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, state_ptr, y_ptr,
                       qsl_ptr, seq_lens_ptr, idx_ptr, stride_xt, stride_xh, stride_dtt,
                       stride_bt, stride_bg, stride_ct, stride_cg, stride_ss, stride_sh,
                       stride_sp, stride_yt, stride_yh, P: tl.constexpr, N: tl.constexpr,
                       REP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    g = h // REP
    tok = tl.load(qsl_ptr + req)
    slot = tl.load(idx_ptr + req).to(tl.int64)
    if (tl.load(qsl_ptr + req + 1) == tok) | (slot < 0):
        return
    lim = tl.where(tl.load(seq_lens_ptr + req) > 1, P, 0)
    ps = tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    pm = ps < P
    nm = ns < N
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + ps[:, None] * stride_sp + ns[None, :]
    s = tl.load(s_ptrs, mask=(ps < lim)[:, None] & nm[None, :], other=0.0).to(tl.float32)
    t64 = tok.to(tl.int64)
    x = tl.load(x_ptr + t64 * stride_xt + h * stride_xh + ps, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + t64 * stride_bt + g * stride_bg + ns, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + t64 * stride_ct + g * stride_cg + ns, mask=nm, other=0.0).to(tl.float32)
    dt = _softplus(tl.load(dt_ptr + t64 * stride_dtt + h).to(tl.float32)
                   + tl.load(dt_bias_ptr + h).to(tl.float32))
    s = s * tl.exp(dt * tl.load(A_ptr + h).to(tl.float32)) + (dt * x)[:, None] * b[None, :]
    y = tl.sum(s * c[None, :], 1) + tl.load(D_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + t64 * stride_yt + h * stride_yh + ps, y.to(y_ptr.dtype.element_ty), mask=pm)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=pm[:, None] & nm[None, :])


def _ssd_args(x, dt, B, C, ssm_state, y):
    return (x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
            C.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
            y.stride(0), y.stride(1))


def ssd_scan(x, dt, dt_bias, A, B, C, D, ssm_state, query_start_loc, seq_lens, state_idx, *,
             is_decode: bool = False):
    """Triton twin of `mamba.ssd_scan_ref`; `is_decode` (at most one token per request, the
    model runner's promise) takes the single-step update kernel."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_state.stride(3) == 1
    y = torch.zeros_like(x)  # padding rows stay 0
    nb = seq_lens.shape[0]
    if T == 0 or nb == 0:
        return y
    common = dict(P=P, N=N, REP=H // G, BLOCK_P=max(16, triton.next_power_of_2(P)),
                  BLOCK_N=max(16, triton.next_power_of_2(N)))
    args = (x, dt, dt_bias, A, B, C, D, ssm_state, y, query_start_loc, seq_lens, state_idx,
            *_ssd_args(x, dt, B, C, ssm_state, y))
    if is_decode:
        _ssd_update_kernel[(nb, H)](*args, num_warps=8 if common["BLOCK_P"] * common["BLOCK_N"] > 4096
                                    else 4, **common)
    else:
        # a [P, N] state and [64, N] B/C tiles per program: more warps above 64 x 64 keep them
        # in registers; two stages bound the shared memory the chunk loop's loads are staged in
        big = common["BLOCK_P"] * common["BLOCK_N"] > 4096
        _ssd_scan_kernel[(nb, H)](*args, CHUNK=16 if not x.is_cuda else 64, num_warps=8 if big else 4,
                                  num_stages=2, **common)
    return y
