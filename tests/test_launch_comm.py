"""`bench comm` at a model's own sizes never drops a requested op silently (the CLI raises the
error before the rendezvous as a LaunchError: one line from rank 0, see test_launch_preflight)."""
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

