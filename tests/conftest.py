import rankserve  # noqa: F401  (first: it takes the checkout off sys.path, see launch/_root)

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES_SHARED = SHARED / "models" / "stories260K"
STORIES_EMBEDDED = REPO / "models" / "default" / "stories260K"
STORIES_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. "
                "One day, she saw a big, red ball.")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one intra-op thread: the test models are tiny, and on CI's 2 cores a second OpenMP thread only
# spins at every barrier against the engine's own threads (grammar fills, async scheduling) and
# the servers and ranks the tests start: constrained generation ran 6x slower with two
torch.set_num_threads(1)


def make_checkpoint(path: Path, arch: str, **overrides) -> str:
    """Save a tiny random fp32 checkpoint of `arch` with transformers (plus stories' tokenizer,
    whose 512-token vocabulary the configs use)."""
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    specific = {
        "LlamaForCausalLM": (transformers.LlamaConfig, dict(rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
        "MistralForCausalLM": (transformers.MistralConfig, dict(sliding_window=None)),
        "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
        "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(head_dim=32)),
        "Qwen3MoeForCausalLM": (transformers.Qwen3MoeConfig, dict(
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            head_dim=16)),
        "MixtralForCausalLM": (transformers.MixtralConfig, dict(num_local_experts=4,
                                                                num_experts_per_tok=2)),
        # interleaved local (window 8, base 10k) / global (1M, linear x2) layers, soft-capping
        "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, dict(
            num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e6}},
            final_logit_softcapping=3.0, attn_logit_softcapping=2.0,  # the latter unused by HF
            tie_word_embeddings=True,
            pad_token_id=0)),
        # Mamba2, attention, Mamba2, MLP blocks; 4 heads x 16 channels, 2 groups, state 16
        "NemotronHForCausalLM": (transformers.NemotronHConfig, dict(
            layers_block_type=["mamba", "attention", "mamba", "mlp"], num_hidden_layers=4,
            head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            conv_kernel=4, chunk_size=8, pad_token_id=0)),
        # MLA (latent 32 + rope 16), 1 dense + 2 MoE layers (8 experts in 4 groups, top-2 of the
        # best 2 groups, 1 shared expert), YaRN with mscale; the model has one MTP layer
        "DeepseekV3ForCausalLM": (transformers.DeepseekV3Config, dict(
            num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=24, num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
        # V2: no q compression, softmax routing limited to the best 2 of 4 groups, 2 shared experts
        "DeepseekV2ForCausalLM": (transformers.DeepseekV2Config, dict(
            num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
            n_shared_experts=2, num_experts_per_tok=2, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=1.5, moe_intermediate_size=32,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16)),
    }
    cls, extra = specific[arch]
    cfg = cls(**{**common, **extra, **overrides})
    cfg.architectures = [arch]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so logits are far from flat
        for _name, p in model.named_parameters():
            if p.dim() >= 2 or arch.startswith("Gemma"):  # Gemma's norms start at 0 (1 + w)
                p.normal_(0, 0.1)
            elif arch.startswith("NemotronH"):  # per-head / per-channel values that differ, so
                p.mul_(1 + 0.2 * torch.randn_like(p))  # a tensor-parallel split must get them right
            if "conv1d" in _name:  # x, B, C large enough that the SSM state (not only D x) counts
                p.normal_(0, 0.5)
            if _name.endswith("dt_bias"):  # time steps of a trained model's range, not HF's init
                p.uniform_(-2, 1)  # (whose tiny dt would hit transformers' prefill-only clamp)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: let it matter
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES_EMBEDDED / f, path / f)
    return str(path)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(arch: str, **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def stories_llm():
    from rankserve import LLM
    # a fixed KV cache on CUDA: other engines of the same test process need memory too
    return LLM(str(STORIES_EMBEDDED), **({"num_gpu_blocks_override": 256} if torch.cuda.is_available() else {}))


@pytest.fixture(scope="session")
def qwen3_chat_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint with the real Qwen3 tokenizer and chat template."""
    import shutil
    import transformers
    tok = SHARED / "tokenizers" / "qwen3"
    if not tok.exists():
        pytest.skip("../shared/tokenizers/qwen3 not present")
    path = tmp_path_factory.mktemp("qwen3tiny")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=2048, bos_token_id=151643, eos_token_id=151645)
    cfg.architectures = ["Qwen3ForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # large weights: varied tokens instead of one repeated token
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    for f in tok.iterdir():
        shutil.copy(f, path / f.name)
    return path


def triton_interpreting() -> bool:
    """True in a process that imported triton with TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction
    from rankserve.kernels import triton_attention
    return isinstance(triton_attention._unified_attention_kernel, InterpretedFunction)


@pytest.fixture(scope="module")
def interp():
    """Runs fn(*args) in a worker that imported triton with TRITON_INTERPRET=1 (it must be set
    before triton is imported, so the kernel tests' bodies run there; pytest never sees it)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the worker started just below
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        assert pool.submit(triton_interpreting).result(), "worker is not using the Triton interpreter"
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield lambda fn, *args: pool.submit(fn, *args).result()
    pool.shutdown()


@pytest.fixture(scope="session")
def _qwen3_servers():
    started = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def structured_qwen3_server(_qwen3_servers, qwen3_chat_dir):
    """The server of test_structured_api.structured_server, started once for the modules that
    use it with the same arguments (test_server_chat, test_structured_api, test_structured_edge);
    started again for the next module if one ended it (test_structured_edge's last test does)."""
    from test_structured_api import structured_server
    if not _qwen3_servers or _qwen3_servers[-1].proc.poll() is not None:
        _qwen3_servers.append(structured_server(qwen3_chat_dir))
    return _qwen3_servers[-1]


# clients of the module's `server` fixture (each server test module starts its own server)
@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    import anthropic
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def assert_logprobs_close(got, want, atol=1e-4):
    """Two offline logprob lists (vLLM's shape: per position {token id: Logprob}): the same
    tokens and ranks at every position, logprobs within atol."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert [(t, x.rank) for t, x in a.items()] == [(t, x.rank) for t, x in b.items()]
        assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= atol
