"""`bench comm` at a model's own sizes never drops a requested op silently."""
import shutil
import subprocess
import sys

import pytest

from rankserve.runtime.bench.comm import select_model_ops


def test_default_ops_name_what_is_left_out():
    ops, notice = select_model_ops(None, {"all_reduce": [1], "all_gather": [2]})
    assert ops == ["all_reduce", "all_gather"]
    assert "all_to_all (it needs a MoE model with --enable-expert-parallel)" in notice


def test_requested_op_the_model_does_not_send_is_an_error():
    with pytest.raises(ValueError, match="--ops all_to_all: the model sends none here"):
        select_model_ops(["all_reduce", "all_to_all"], {"all_reduce": [1]})
    assert select_model_ops(["all_reduce"], {"all_reduce": [1]}) == (["all_reduce"], None)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_all_to_all_without_ep_under_mpiexec_is_one_error_line():
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "bench", "comm",
                        "--ops", "all_to_all", "--iters", "1"], capture_output=True, text=True, timeout=120)
    errors = [x for x in r.stderr.splitlines() if "rankserve: error:" in x]
    assert r.returncode != 0 and len(errors) == 1 and "all_to_all" in errors[0], r.stderr[-2000:]
    assert "busbw" not in r.stdout
