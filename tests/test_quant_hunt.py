"""Quantized checkpoints driven as users would, at the config variants published checkpoints
use (models/quantization.py). Writers and the reference come from tests/test_quantization.py and
tests/test_quant_edge.py."""
from __future__ import annotations

import pytest

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import assert_matches, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def test_awq_zero_point_false_reads_the_stored_zero_points(llama, tmp_path):
    """AutoAWQ's GEMM layout always stores `qzeros`; a config saying `zero_point: false` must not
    make the loader drop them for a fixed zero of 8 (silently wrong weights). vLLM reads them too."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}
    ref, quantized = write_checkpoint(llama, tmp_path / "q", tq.write_awq, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)
