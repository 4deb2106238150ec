"""The Triton MLA kernel (kernels/triton_mla.py) against its plain-torch reference (kernels/mla.py):
under the Triton interpreter on CPU, and in bf16 on the GPU."""
import pytest
import torch


def _case(device, dtype, L, R, H, q_lens, seq_lens, block_size=16, seed=0):
    """A random paged latent cache (blocks shuffled, block 0 unused) and queries."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = B * max_blocks + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1)[:B * max_blocks]
    table = perm.view(B, max_blocks).to(torch.int32)
    cache = torch.randn(num_blocks, block_size, 1, L + R, generator=g).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T + 2, H, L + R, generator=g).to(dtype)  # 2 padding rows
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    args = (q, cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table)
    return [a.to(device) for a in args]


CASES = [  # (q_lens, seq_lens, is_decode): mixed prefill / chunk / decode, then decode only
    ([5, 1, 3, 0], [5, 20, 35, 7], False),
    ([1, 1, 1], [1, 17, 40], True),
]


LONG = [  # on the GPU: contexts long enough for split-KV decode, and a longer prefill chunk
    ([1, 1, 1, 1], [1, 700, 3000, 129], True),
    ([300, 1, 64], [300, 2048, 1000], False),
]


def _check(device, dtype, L, R, H, atol, cases=CASES, fp8=False):
    from rankserve.kernels.mla import mla_attention_ref
    from rankserve.kernels.triton_mla import mla_attention_triton
    for q_lens, seq_lens, decode in cases:
        q, cache, qsl, lens, table = _case(device, dtype, L, R, H, q_lens, seq_lens)
        kv_scale = None
        if fp8:  # an fp8 latent cache with its per-layer scale
            kv_scale = torch.tensor(0.37, device=device)
            cache = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
        if decode:  # T == B
            q = q[:len(seq_lens)]
        scale = (L + R) ** -0.5
        ref = mla_attention_ref(q, cache, qsl, lens, table, scale, L, is_decode=decode, kv_scale=kv_scale)
        out = mla_attention_triton(q, cache, qsl, lens, table, scale, L, is_decode=decode,
                                   kv_scale=kv_scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
        assert out[int(qsl[-1]):].abs().max().item() == 0 if out.shape[0] > int(qsl[-1]) else True


def _store_check(device):
    from rankserve.kernels.mla import store_latent_ref
    from rankserve.kernels.triton_mla import store_latent
    kv = torch.randn(5, 24, device=device) * 100
    slots = torch.tensor([3, -1, 17, 0, 30], device=device)
    for dtype in (torch.float32, torch.float8_e4m3fn):  # fp8: scaled, saturated, bit for bit
        scale = torch.tensor(0.37, device=device)
        a, b = (torch.zeros(2, 16, 1, 24, device=device).to(dtype) for _ in range(2))
        store_latent_ref(kv, a, slots, scale)
        store_latent(kv, b, slots, scale)
        assert torch.equal(a.view(torch.uint8) if dtype != torch.float32 else a,
                           b.view(torch.uint8) if dtype != torch.float32 else b)


def _interp_body():
    _check("cpu", torch.float32, 32, 16, 4, 1e-5)
    _check("cpu", torch.float32, 48, 16, 20, 1e-5)  # L not a power of two, two head blocks
    # the 16-bit path (tensor-core dots, p rounded to the cache dtype); fp16, as the
    # interpreter computes bf16 wrongly (the paged-attention kernel's too)
    _check("cpu", torch.float16, 64, 16, 20, 2e-2)
    _check("cpu", torch.float32, 32, 16, 4, 1e-5, fp8=True)
    _store_check("cpu")


def test_mla_kernel_interpreter(interp):
    interp(_interp_body)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mla_kernel_gpu_bf16():
    _check("cuda", torch.bfloat16, 512, 64, 16, 2e-2)  # DeepSeek-V3's latent widths
    _check("cuda", torch.bfloat16, 512, 64, 128, 2e-2, CASES + LONG)
    _check("cuda", torch.bfloat16, 512, 64, 128, 2e-2, CASES + LONG, fp8=True)
    _store_check("cuda")
