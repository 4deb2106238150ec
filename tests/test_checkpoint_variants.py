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
