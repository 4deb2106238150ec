"""Speculative decoding through the server (greedy completions equal plain ones, the
spec_decode counters in /metrics) and under `mpiexec -n 2 --tp 2` (n-gram and a draft model)."""
import json
import shutil

import httpx
import pytest

from rankserve import LLM, SamplingParams
from rankserve.runtime.sampling_params import StructuredOutputsParams

from conftest import STORIES_EMBEDDED
from test_multirank import PROMPTS, mpi_generate, single
from test_server import Server
from test_spec_decode import stories_draft

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
REPEAT = "Lily and Tom went to the park. Lily and Tom went to the"


@pytest.mark.slow
def test_server_greedy_equals_plain_and_metrics(tmp_path):
    draft = stories_draft(tmp_path / "draft")
    llm = LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05)
    want = llm.generate([REPEAT, "Once upon a time"], SamplingParams(temperature=0, max_tokens=40))
    regex = r" park\. [A-Za-z]+( [a-z]+){0,6}\."  # structured outputs speculate too
    so = llm.generate(REPEAT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(regex=regex))))[0].outputs[0].text
    for spec in (NGRAM, json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 2})):
        s = Server("--speculative-config", spec, "--kv-cache-memory-gb", "0.05")
        try:
            with httpx.Client(base_url=s.url, timeout=120) as c:
                for prompt, w in zip([REPEAT, "Once upon a time"], want):
                    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40,
                                                        "temperature": 0})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == w.outputs[0].text
                r = c.post("/v1/completions", json={"prompt": REPEAT, "max_tokens": 40, "temperature": 0,
                                                    "structured_outputs": {"regex": regex}})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == so, r.text
                # streamed: several tokens may arrive in one chunk; the text is the same
                with c.stream("POST", "/v1/completions", json={
                        "prompt": REPEAT, "max_tokens": 40, "temperature": 0, "stream": True}) as r:
                    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                   if line.startswith("data: {"))
                assert text == want[0].outputs[0].text
                m = c.get("/metrics").text
            vals = {line.split(" ")[0].split("{")[0]: float(line.split(" ")[-1]) for line in m.splitlines()
                    if line.startswith("rankserve:spec_decode") and "_created" not in line}
            assert vals["rankserve:spec_decode_num_drafts_total"] > 0, m
            assert 0 < vals["rankserve:spec_decode_num_accepted_tokens_total"] \
                <= vals["rankserve:spec_decode_num_draft_tokens_total"]
            assert 'rankserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in m
            assert 'position="0"' in m
        finally:
            assert s.stop() == 0


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_matches_single_rank(checkpoint):
    model = checkpoint("LlamaForCausalLM")
    draft = checkpoint("LlamaForCausalLM", num_hidden_layers=1)
    want = single(model)
    assert mpi_generate(2, model, "--tp", "2", "--speculative-config", NGRAM) == want
    spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                       "draft_tensor_parallel_size": 2})
    assert mpi_generate(2, model, "--tp", "2", "--speculative-config", spec) == want
    # a constrained output's mask rows (one per draft position) travel in the plan to rank 1
    regex = "( [a-z]+| [A-Z][a-z]+[.,]){2,12}"
    so = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(regex=regex))
    want = [o.outputs[0].token_ids for o in LLM(model).generate(PROMPTS, so)]
    assert mpi_generate(2, model, "--tp", "2", "--speculative-config", NGRAM, "--regex", regex) == want
