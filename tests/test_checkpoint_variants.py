"""Checkpoints as users bring them from the Hub / vLLM: config fields that change the math are
either honoured or refused by name (never run as something else), and the files beside the
weights (generation_config.json, config.json's eos ids) act as they do in vLLM."""
import pytest

from rankserve import LLM


@pytest.mark.parametrize("arch, field, value", [
    ("LlamaForCausalLM", "hidden_act", "gelu"),
    ("Qwen3ForCausalLM", "hidden_act", "gelu_pytorch_tanh"),
    ("MixtralForCausalLM", "hidden_act", "relu"),
    ("Gemma3ForCausalLM", "hidden_activation", "gelu"),
    ("NemotronHForCausalLM", "mlp_hidden_act", "silu"),
])
def test_an_activation_the_model_does_not_run_is_refused_naming_it(checkpoint, arch, field, value):
    """transformers runs the config's activation; running SiLU (GELU-tanh, relu²) in its place
    gives other tokens with no error."""
    path = checkpoint(arch, **{field: value})
    with pytest.raises(ValueError, match=f"{field} {value!r} is not supported"):
        LLM(path, dtype="float32", max_num_seqs=2)


def _stories_copy(tmp_path, generation_config: dict | None, tokenizer: bool = True, **config) -> str:
    """stories260K with its generation_config.json replaced (None: removed), `config` merged
    into its config.json, and without its tokenizer unless `tokenizer`."""
    import json
    import shutil
    from conftest import STORIES_EMBEDDED
    path = tmp_path / "stories"
    shutil.copytree(STORIES_EMBEDDED, path, ignore=None if tokenizer else shutil.ignore_patterns("tokenizer*"))
    (path / "generation_config.json").unlink()
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(path)


PROMPTS = ["Once upon a time", "The little dog"]


def test_offline_generate_without_sampling_params_takes_generation_config_defaults(tmp_path):
    """vLLM's LLM.generate(prompts) samples with the checkpoint's generation_config.json
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as
    its server does for the fields a request leaves out."""
    from rankserve import SamplingParams
    path = _stories_copy(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7,
                                    "top_k": 1, "max_new_tokens": 5})
    llm = LLM(path, max_num_seqs=4)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):  # top_k 1: the greedy tokens every time, 5 of them
        outs = llm.generate(PROMPTS)
        assert [o.outputs[0].token_ids for o in outs] == [g.outputs[0].token_ids for g in greedy]


def test_cli_generate_takes_generation_config_defaults_for_flags_left_out(tmp_path):
    """`rankserve generate` showed --generation-config / --override-generation-config but always
    sampled greedily with 64 tokens: the flags did nothing. Now the fields its own flags leave
    out come from them (as LLM.generate and the server), else greedy and 64 tokens."""
    import json
    from click.testing import CliRunner
    from rankserve.launch.cli import main
    path = _stories_copy(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 5})

    def run(*flags):
        r = CliRunner().invoke(main, ["generate", path, "--prompt", "Once upon a time", "--json",
                                      "--ignore-eos", *flags])
        assert r.exit_code == 0, r.output
        out = r.output  # stderr's progress bar may share the JSON's line
        return json.loads(out[out.rindex('{"prompt"'):].splitlines()[0])["token_ids"]
    greedy = run("--max-tokens", "9")
    assert len(greedy) == 9
    assert run() == greedy[:5]  # max_new_tokens, greedy without a temperature anywhere
    assert len(run("--override-generation-config", '{"max_new_tokens": 7}')) == 7
    assert len(run("--generation-config", "vllm")) == 64
    hot = '{"temperature": 50.0}'
    sampled = [run("--override-generation-config", hot, "--sampling-seed", str(s)) for s in (1, 2)]
    assert sampled[0] != sampled[1] and greedy[:5] not in sampled
    assert run("--override-generation-config", hot, "--temperature", "0") == greedy[:5]


def test_eos_ids_of_config_json_stop_generation_without_a_generation_config(tmp_path):
    """Without generation_config.json vLLM reads the generation defaults, eos ids included, from
    config.json (GenerationConfig.from_model_config): each id of a list stops a request."""
    from rankserve import SamplingParams
    plain = LLM(_stories_copy(tmp_path / "a", None), max_num_seqs=4)
    greedy = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert len(greedy.token_ids) == 8
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    llm = LLM(_stories_copy(tmp_path / "b", None, eos_token_id=[2, stop]), max_num_seqs=4)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"


def test_an_untied_lm_head_missing_from_the_checkpoint_is_named(checkpoint, tmp_path):
    """tie_word_embeddings false and no lm_head.weight: the head is not the embedding, so the
    start fails naming it (as vLLM); it had run with an all-zero head (every token id 0)."""
    import shutil
    from safetensors.torch import load_file, save_file
    path = tmp_path / "nohead"
    shutil.copytree(checkpoint("LlamaForCausalLM"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for: \['lm_head.weight'\]"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


@pytest.mark.parametrize("field, value, tensor", [
    ("num_key_value_heads", 1, "model.layers.0.self_attn.k_proj.weight"),  # 2 heads stored
    ("vocab_size", 500, "(model.embed_tokens|lm_head).weight"),  # 512 rows stored
    ("vocab_size", 520, "(model.embed_tokens|lm_head).weight"),
])
def test_a_config_the_checkpoints_shapes_do_not_fit_is_refused_naming_the_tensor(
        checkpoint, tmp_path, field, value, tensor):
    """config.json and the weights disagree (a config of another size, an edited vocabulary):
    transformers refuses the sizes; reading the first rows (or leaving rows at zero) would run
    a different model."""
    import json
    import shutil
    path = tmp_path / "m"
    shutil.copytree(checkpoint("LlamaForCausalLM"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"{tensor}: has shape"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


def test_a_model_without_a_tokenizer_stops_at_its_generation_config_eos_ids(tmp_path):
    """A directory without tokenizer files serves token ids; its generation_config.json's eos
    ids still end a request (vLLM with skip_tokenizer_init), instead of running to max_tokens."""
    from rankserve import SamplingParams
    prompt = {"prompt_token_ids": [1, 403, 407, 261, 378]}  # "Once upon a time"
    sp = SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(_stories_copy(tmp_path / "a", None, tokenizer=False), max_num_seqs=4)
    greedy = plain.generate(prompt, sp)[0].outputs[0].token_ids
    assert len(greedy) == 8
    stop = greedy[3]
    llm = LLM(_stories_copy(tmp_path / "b", {"eos_token_id": [stop, 2]}, tokenizer=False), max_num_seqs=4)
    out = llm.generate(prompt, sp)[0].outputs[0]
    assert out.token_ids == greedy[:greedy.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("arch, rope", [
    ("Qwen3ForCausalLM", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("LlamaForCausalLM", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                          "beta_fast": 16, "beta_slow": 2}),
    ("Qwen2ForCausalLM", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                          "attention_factor": 1.3}),
])
def test_yarn_rope_matches_transformers(checkpoint, arch, rope):
    """YaRN as Qwen's model cards add it to config.json (`rope_scaling`, either key spelling):
    the frequencies blend, and cos/sin scale by the attention factor, as transformers does."""
    import torch
    import transformers
    from test_parity import NEW, PROMPTS, hf_greedy, model_logits
    from rankserve import SamplingParams
    path = checkpoint(arch, rope_scaling=rope)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(model_logits(llm, p), ref, atol=1e-4, rtol=1e-4)


def test_generate_cli_on_a_directory_without_a_tokenizer_names_the_flag(tmp_path):
    """`rankserve generate DIR --prompt TEXT` where DIR has weights but no tokenizer files: the
    error says how to give one (the CLI cannot pass token ids)."""
    import subprocess
    import sys
    path = _stories_copy(tmp_path, None, tokenizer=False)
    r = subprocess.run([sys.executable, "-m", "rankserve.launch", "generate", path, "--prompt", "Hi",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--tokenizer" in r.stderr.splitlines()[-1], r.stderr[-500:]


def test_yarn_extends_the_context_past_max_position_embeddings(checkpoint):
    """As vLLM derives it, YaRN's context is original_max_position_embeddings x factor (Qwen3:
    32768 x 4 = 131072 against max_position_embeddings 40960): the default --max-model-len, and
    positions past max_position_embeddings match transformers."""
    import torch
    import transformers
    from test_parity import hf_greedy
    from rankserve import SamplingParams
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 96}
    path = checkpoint("Qwen3ForCausalLM", rope_scaling=rope, max_position_embeddings=128)
    llm = LLM(path, dtype="float32", max_num_seqs=2)
    assert llm.engine.executor.runner.max_model_len == 384
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(199)]  # 200 tokens, past 128
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                    ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt)
    with pytest.raises(ValueError, match="--max-model-len 400 exceeds"):
        LLM(path, dtype="float32", max_num_seqs=2, max_model_len=400)


def test_bench_context_check_takes_the_scaled_context(checkpoint):
    """`rankserve bench` checks that its requests fit the context the engine will serve: with
    YaRN that is original_max_position_embeddings x factor, not max_position_embeddings."""
    from rankserve.models.loader import load_hf_config
    from rankserve.runtime.bench.common import check_context
    from rankserve.runtime.config import EngineConfig
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 96}
    path = checkpoint("Qwen3ForCausalLM", rope_scaling=rope, max_position_embeddings=128)
    cfg = EngineConfig.from_kwargs(model=path)
    check_context(cfg, load_hf_config(path), 300, 84)
    with pytest.raises(ValueError, match="more than the context of 384"):
        check_context(cfg, load_hf_config(path), 300, 85)


@pytest.mark.parametrize("drop, named", [
    ("model.layers.0.mlp.up_proj.weight", r"model.layers.0.mlp.gate_up_proj.weight \(part 1 of 2"),
    ("model.layers.1.self_attn.v_proj.weight", r"model.layers.1.self_attn.qkv_proj.weight \(part 2 of 3"),
])
def test_a_checkpoint_lacking_one_part_of_a_fused_layer_is_named(checkpoint, tmp_path, drop, named):
    """An incomplete download whose missing shard held up_proj but not gate_proj: the fused
    gate_up weight is half loaded, and the start must say so (it had run on the other half's
    uninitialized memory)."""
    import shutil
    from safetensors.torch import load_file, save_file
    path = tmp_path / "m"
    shutil.copytree(checkpoint("LlamaForCausalLM"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors[drop]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"lacks weights for: .*{named}"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


@pytest.mark.parametrize("arch, drop, named", [
    ("Qwen3MoeForCausalLM", "model.layers.0.mlp.experts.3.up_proj.weight",
     r"model.layers.0.mlp.experts.w13 \(expert 3's up_proj"),
    ("MixtralForCausalLM", "model.layers.1.block_sparse_moe.experts.2.w2.weight",
     r"model.layers.1.mlp.experts.w2 \(expert 2's down_proj"),
])
def test_a_checkpoint_lacking_one_expert_part_is_named(checkpoint, tmp_path, arch, drop, named):
    """One expert's up_proj (or down_proj) left out: the stacked expert weights are loaded for
    the other experts, and this one would run on uninitialized memory."""
    import shutil
    from safetensors.torch import load_file, save_file
    path = tmp_path / "m"
    shutil.copytree(checkpoint(arch), path)
    tensors = load_file(path / "model.safetensors")
    del tensors[drop]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"lacks weights for: .*{named}"):
        LLM(str(path), dtype="float32", max_num_seqs=2)
