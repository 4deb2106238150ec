"""Skinny GEMMs for decode (M <= MAX_M rows): y = x @ w.T (+ bias), the weight w [N, K] streamed
from HBM once, with the cheap op in front of each decode-layer GEMM folded into its prologue:

  skinny_linear(x, w, bias)                 x @ w.T + bias                        (o_proj)
  add_rms_norm_linear(h, delta, norm_w, eps, w, bias)
                                            (rmsnorm(h + delta) @ w.T + bias, h + delta)
                                                                                  (qkv, gate_up)
  silu_mul_linear(gu, w, bias)              (silu(gu[:, :I]) * gu[:, I:]) @ w.T + bias  (down)
  add_rms_norm_swiglu(h, delta, norm_w, eps, w, bias)
                                            (silu(g) * u for [g | u] = rmsnorm(h + delta) @ w.T
                                             + bias, h + delta)       (gate_up, SwiGLU epilogue)

Rounding follows models/layers.py exactly (RMSNorm: normalise in fp32, cast, then times the
weight; GatedMLP: silu rounded to the dtype, then the product), so the fused layer equals the
unfused one up to the GEMM's summation order.

The SwiGLU epilogue (opt-in, RANKSERVE_SWIGLU_EPILOGUE) moves the SiLU product from down's
prologue (every down program recomputed it over all of I) into gate_up's epilogue: a program
computes gate columns j..j+BLOCK_N and the matching up columns, so down becomes a plain GEMV.

Kernel: one program per (row, BLOCK_N output columns); it walks K in BLOCK_K chunks, builds the
row's activation chunk (with its prologue) from the small, L2-resident activations, multiplies it
elementwise into the [BLOCK_N, BLOCK_K] weight tile and reduces once after the loop. The rows of a
column tile are adjacent in launch order, so HBM sees each weight tile once. (A padded tl.dot
version for 2..16 rows measured 3-8x slower with the prologues on an H200.) Configs are picked
from shapes, not autotuned, so nothing is benchmarked under CUDA-graph capture (the first call of
each shape still compiles: warm up first). Above MAX_M the L2 re-reads grow and cuBLAS wins: one
Triton prologue kernel, then F.linear. Without CUDA or the Triton interpreter, everything is the
plain-torch reference.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import pdl
from .attention import rms_norm
from .custom_op import custom_op

# Rows up to which the skinny kernel runs; 0 turns it off (the prologue kernels + cuBLAS run
# instead). Measured on an H200 at Llama-8B sizes (benchmarks/): at one row the fused
# ops beat cuBLAS plus a separate norm / SiLU kernel (~5 us a layer); at 2 and 4 rows the
# per-row prologue work makes them slower, so the default is 1. (Compiled CUDA graphs pad decode
# to 2 rows, so this path serves eager and --compilation-level 1 runs.)
MAX_M = 1  # the runtime sets it from RANKSERVE_SKINNY_MAX_M (runtime/envs.py) at start-up

LINEAR, ADD_RMS_NORM, SILU_MUL = 0, 1, 2  # prologues
SWIGLU_EPILOGUE = False  # the runtime sets it from RANKSERVE_SWIGLU_EPILOGUE (runtime/envs.py)
# The norm prologue's rstd pre-pass loads up to this many columns of h and delta at once: one L2
# round trip before the weight stream starts instead of K / BLOCK_K dependent ones (H200, Llama-8B
# decode layers: 116.4 against 119.9 us a layer, benchmarks/2026-12-04-h200-s12)
RSTD_MAX = 8192


# ----------------------------------------------------------------------------------------------
# plain-torch references (the unfused model code)
# ----------------------------------------------------------------------------------------------

def ref_skinny_linear(x, w, bias=None):
    return F.linear(x, w, bias)


def ref_add_rms_norm_linear(h, delta, norm_w, eps, w, bias=None):
    h_new = h + delta
    return F.linear(rms_norm(h_new, norm_w, eps), w, bias), h_new


def silu_mul_ref(gu):
    """SwiGLU as HF computes it: silu(gate) rounded to the dtype, then times up."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_silu_mul_linear(gu, w, bias=None):
    return F.linear(silu_mul_ref(gu), w, bias)


def ref_add_rms_norm_swiglu(h, delta, norm_w, eps, w, bias=None):
    gu, h_new = ref_add_rms_norm_linear(h, delta, norm_w, eps, w, bias)
    return silu_mul_ref(gu), h_new


# ----------------------------------------------------------------------------------------------
# prologue math, shared by the skinny kernel and the large-M prologue kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _add(h, d):
    return (h.to(tl.float32) + d.to(tl.float32)).to(h.dtype)  # torch: add in fp32, round once


@triton.jit
def _rms_scale(hn, rstd, nw):
    # norm_w * (h_new * rstd).to(dtype): both products rounded to the dtype, like RMSNorm
    xn = (hn.to(tl.float32) * rstd).to(hn.dtype)
    return (xn.to(tl.float32) * nw.to(tl.float32)).to(hn.dtype)


@triton.jit
def _silu_mul(g, u):
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype)  # F.silu rounds to the dtype before the product
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _rstd(h_ptr, d_ptr, row, K, eps, BLOCK_K: tl.constexpr):
    # every program recomputes its row's rstd (a pass over h, delta in L2): no cross-program sync
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs_k < K
        hn = _add(tl.load(h_ptr + row * K + k0 + offs_k, mask=mask, other=0.0),
                  tl.load(d_ptr + row * K + k0 + offs_k, mask=mask, other=0.0)).to(tl.float32)
        ss += hn * hn
    return tl.math.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _act_chunk(a_ptr, b_ptr, nw_ptr, h_out_ptr, row, offs_k, mask, K, rstd, write_h,
               PROLOGUE: tl.constexpr):
    """Activation chunk [BLOCK_K] of one row at columns offs_k, in the activation dtype."""
    if PROLOGUE == 0:  # LINEAR: a = x
        x = tl.load(a_ptr + row * K + offs_k, mask=mask, other=0.0)
    elif PROLOGUE == 1:  # ADD_RMS_NORM: a = h, b = delta
        hn = _add(tl.load(a_ptr + row * K + offs_k, mask=mask, other=0.0),
                  tl.load(b_ptr + row * K + offs_k, mask=mask, other=0.0))
        if write_h:  # one program column writes h_new
            tl.store(h_out_ptr + row * K + offs_k, hn, mask=mask)
        nw = tl.load(nw_ptr + offs_k, mask=mask, other=0.0)
        x = _rms_scale(hn, rstd, nw)
    else:  # SILU_MUL: a = gu [M, 2K], gate then up
        x = _silu_mul(tl.load(a_ptr + row * 2 * K + offs_k, mask=mask, other=0.0),
                      tl.load(a_ptr + row * 2 * K + K + offs_k, mask=mask, other=0.0))
    return x


@triton.jit
def _skinny_kernel(a_ptr, b_ptr, nw_ptr, w_ptr, bias_ptr, y_ptr, h_out_ptr, N, K, eps,
                   PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
                   RSTD_BLOCK: tl.constexpr, SWIGLU: tl.constexpr):
    # Program (row, column tile). Rows vary fastest in launch order, so the programs of one
    # column tile run together and all but the first read its weight tile from L2: HBM sees the
    # weight once for any small M. SWIGLU: w is [2N, K] (gate | up); a program takes gate rows
    # offs_n and up rows N + offs_n and stores silu(gate) * up.
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    u_ptrs = w_ptr + (N + offs_n).to(tl.int64)[:, None] * K + offs_k[None, :]  # SWIGLU only
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # elementwise partial sums, reduced once
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile (no kernel writes weights) streams in before the wait
        w0 = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        if SWIGLU:
            u0 = tl.load(u_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    pdl.wait_and_release(USE_PDL)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = _rstd(a_ptr, b_ptr, row, K, eps, RSTD_BLOCK)
    if USE_PDL:
        a0 = _act_chunk(a_ptr, b_ptr, nw_ptr, h_out_ptr, row, offs_k, offs_k < K, K, rstd,
                        pid_n == 0, PROLOGUE)
        acc += w0.to(tl.float32) * a0.to(tl.float32)[None, :]
        if SWIGLU:
            acc_u += u0.to(tl.float32) * a0.to(tl.float32)[None, :]
        k_start = BLOCK_K
    # an explicit num_stages lets Triton pipeline (cp.async) the loads of this dot-free loop
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = k0 + offs_k < K
        a = _act_chunk(a_ptr, b_ptr, nw_ptr, h_out_ptr, row, k0 + offs_k, k_mask, K, rstd,
                       pid_n == 0, PROLOGUE)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        if SWIGLU:
            u = tl.load(u_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_u += u.to(tl.float32) * a.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = out.to(y_ptr.dtype.element_ty)
    if SWIGLU:  # gate and up rounded to the dtype first, as the unfused GEMM's output is
        up = tl.sum(acc_u, 1)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        out = _silu_mul(out, up.to(y_ptr.dtype.element_ty))
    tl.store(y_ptr + row * N + offs_n, out, mask=n_mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, nw_ptr, h_out_ptr, x_ptr, K, eps, BLOCK: tl.constexpr):
    # large-M prologue: one program per row, the whole row in registers
    offs = tl.program_id(0).to(tl.int64) * K + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < K
    hn = _add(tl.load(h_ptr + offs, mask=mask, other=0.0),
              tl.load(d_ptr + offs, mask=mask, other=0.0))
    tl.store(h_out_ptr + offs, hn, mask=mask)
    hf = hn.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, 0) / K + eps)
    nw = tl.load(nw_ptr + tl.arange(0, BLOCK), mask=mask, other=0.0)
    tl.store(x_ptr + offs, _rms_scale(hn, rstd, nw), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, x_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=mask, other=0.0)
    tl.store(x_ptr + row * I + cols, _silu_mul(g, u), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

_INTERPRET = isinstance(_skinny_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 at import


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def _config(N: int, on_gpu: bool) -> dict:
    """Block shapes from N only (no autotuning, see module doc). 16 columns a program gives
    Llama-8B's qkv / o_proj / down 256..384 column tiles (>= 2 per SM of 132); gate_up (N 28672)
    takes 32, which halves the programs that each re-read the activations (and, with the norm
    prologue, recompute rstd). A [16, 256] bf16 weight tile is 8 KB: 4 stages keep ~24 KB of loads
    in flight per program, above what an SM needs at its 1/132 share of ~4.3 TB/s."""
    if not on_gpu:  # interpreter: small tiles, several K steps and ragged edges on small tests
        return dict(BLOCK_N=16, BLOCK_K=32, NUM_STAGES=1, num_warps=4)
    return dict(BLOCK_N=32 if N >= 16384 else 16, BLOCK_K=256, NUM_STAGES=4, num_warps=4)


def _skinny(prologue, a, w, bias, K, b=None, norm_w=None, eps=0.0, h_out=None, swiglu=False):
    M, N = a.shape[0], w.shape[0] // (2 if swiglu else 1)
    assert w.shape[1] == K and w.dtype == a.dtype, "skinny GEMM: weight shape or dtype mismatch"
    w = w.contiguous()
    y = a.new_empty(M, N)
    # SWIGLU: a program's BLOCK_N gate + BLOCK_N up rows are the tile of 2 * BLOCK_N rows that
    # gate_up (2N columns) gets without it
    cfg = _config(2 * N if swiglu else N, a.is_cuda)
    if swiglu and a.is_cuda:
        cfg["BLOCK_N"] //= 2
    rstd_block = min(triton.next_power_of_2(K), RSTD_MAX if a.is_cuda else cfg["BLOCK_K"])
    _skinny_kernel[(M, triton.cdiv(N, cfg["BLOCK_N"]))](
        a, b, norm_w, w, bias, y, h_out, N, K, eps, PROLOGUE=prologue,
        HAS_BIAS=bias is not None, RSTD_BLOCK=rstd_block, SWIGLU=swiglu, **cfg, **pdl.launch(a))
    return y


def skinny_linear_triton(x, w, bias=None):
    if not 0 < x.shape[0] <= MAX_M:
        return F.linear(x, w, bias)
    return _skinny(LINEAR, x.contiguous(), w, bias, x.shape[1])


def add_rms_norm_triton(h, delta, norm_w, eps):
    """(x, h_new): x = rmsnorm(h + delta) for any M, one launch."""
    h, delta = h.contiguous(), delta.contiguous()
    M, K = h.shape
    h_new, x = torch.empty_like(h), torch.empty_like(h)
    block = triton.next_power_of_2(K)
    _add_rms_norm_kernel[(M,)](h, delta, norm_w, h_new, x, K, eps, BLOCK=block,
                               num_warps=min(max(block // 512, 1), 16))
    return x, h_new


def add_rms_norm_linear_triton(h, delta, norm_w, eps, w, bias=None):
    if not 0 < h.shape[0] <= MAX_M:
        x, h_new = add_rms_norm_triton(h, delta, norm_w, eps)
        return F.linear(x, w, bias), h_new
    h, delta = h.contiguous(), delta.contiguous()
    h_new = torch.empty_like(h)  # separate output: other programs still read h
    y = _skinny(ADD_RMS_NORM, h, w, bias, h.shape[1], b=delta, norm_w=norm_w, eps=eps,
                h_out=h_new)
    return y, h_new


def add_rms_norm_swiglu_triton(h, delta, norm_w, eps, w, bias=None):
    assert w.shape[0] % 2 == 0, "SwiGLU: gate_up's weight needs an even number of rows"
    if not 0 < h.shape[0] <= MAX_M:
        gu, h_new = add_rms_norm_linear_triton(h, delta, norm_w, eps, w, bias)
        return silu_mul_triton(gu), h_new
    h, delta = h.contiguous(), delta.contiguous()
    h_new = torch.empty_like(h)
    act = _skinny(ADD_RMS_NORM, h, w, bias, h.shape[1], b=delta, norm_w=norm_w, eps=eps,
                  h_out=h_new, swiglu=True)
    return act, h_new


def silu_mul_triton(gu):
    gu = gu.contiguous()
    M, inter = gu.shape[0], gu.shape[1] // 2
    x = gu.new_empty(M, inter)
    block = min(triton.next_power_of_2(inter), 2048)
    _silu_mul_kernel[(M, triton.cdiv(inter, block))](gu, x, inter, BLOCK=block, num_warps=4)
    return x


def silu_mul_linear_triton(gu, w, bias=None):
    if not 0 < gu.shape[0] <= MAX_M:
        return F.linear(silu_mul_triton(gu), w, bias)
    return _skinny(SILU_MUL, gu.contiguous(), w, bias, gu.shape[1] // 2)


# ----------------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------------

@custom_op("rankserve::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [M, K], w [N, K], bias [N] -> x @ w.T + bias [M, N]."""
    if _use_triton(x):
        return skinny_linear_triton(x, w, bias)
    return ref_skinny_linear(x, w, bias)


@skinny_linear.register_fake
def _(x, w, bias=None):
    return x.new_empty(x.shape[0], w.shape[0])


@custom_op("rankserve::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(h: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [M, K], norm_w [K], w [N, K] -> (rmsnorm(h + delta) @ w.T + bias, h + delta)."""
    if _use_triton(h):
        return add_rms_norm_linear_triton(h, delta, norm_w, eps, w, bias)
    return ref_add_rms_norm_linear(h, delta, norm_w, eps, w, bias)


@add_rms_norm_linear.register_fake
def _(h, delta, norm_w, eps, w, bias=None):
    return h.new_empty(h.shape[0], w.shape[0]), torch.empty_like(h)


@custom_op("rankserve::silu_mul_linear", mutates_args=())
def silu_mul_linear(gu: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """gu [M, 2I] (gate | up), w [N, I] -> (silu(gate) * up) @ w.T + bias [M, N]."""
    if _use_triton(gu):
        return silu_mul_linear_triton(gu, w, bias)
    return ref_silu_mul_linear(gu, w, bias)


@silu_mul_linear.register_fake
def _(gu, w, bias=None):
    return gu.new_empty(gu.shape[0], w.shape[0])


@custom_op("rankserve::add_rms_norm_swiglu", mutates_args=())
def add_rms_norm_swiglu(h: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [M, K], norm_w [K], w [2I, K] (gate | up) -> (silu(g) * u [M, I] for
    [g | u] = rmsnorm(h + delta) @ w.T + bias, h + delta)."""
    if _use_triton(h):
        return add_rms_norm_swiglu_triton(h, delta, norm_w, eps, w, bias)
    return ref_add_rms_norm_swiglu(h, delta, norm_w, eps, w, bias)


@add_rms_norm_swiglu.register_fake
def _(h, delta, norm_w, eps, w, bias=None):
    return h.new_empty(h.shape[0], w.shape[0] // 2), torch.empty_like(h)


@custom_op("rankserve::add_rms_norm", mutates_args=())
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [M, K] -> (rmsnorm(h + delta), h + delta) in one kernel: the prologue of a
    quantized GEMM, whose kernel takes the normed input as is (models/fused.py)."""
    if _use_triton(h):
        return add_rms_norm_triton(h, delta, norm_w, eps)
    h_new = h + delta
    return rms_norm(h_new, norm_w, eps), h_new


@add_rms_norm.register_fake
def _(h, delta, norm_w, eps):
    return torch.empty_like(h), torch.empty_like(h)
