"""`torch.library.custom_op` without the `torch._dynamo` import on an op's first eager call.

torch wraps every custom op's kernel in `torch._disable_dynamo`, which imports `torch._dynamo`
(and with it `torch.fx.experimental.symbolic_shapes` and sympy: ~2 s on the GPU machine) the
first time the op runs, even in a process that never compiles anything (compilation levels 0
and 1). Dynamo can only be tracing a frame once it has been imported (`torch.compile` imports
it), so until then the kernel is called as is; afterwards through torch's wrapper, as before."""
from __future__ import annotations

import sys

import torch


def custom_op(name: str, *, mutates_args):
    """`@torch.library.custom_op(name, mutates_args=...)`, with the lazy dynamo import above."""
    def deco(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        lazy_dynamo_import(op)
        return op
    return deco


def lazy_dynamo_import(op) -> None:
    """Let `op`'s kernels skip torch's dynamo-disabling wrapper while dynamo is not imported."""
    fns = getattr(op, "_backend_fns", None)
    if not isinstance(fns, dict):  # another torch: keep its behaviour
        return
    for device_type, guarded in list(fns.items()):
        plain = getattr(guarded, "__wrapped__", None)
        if plain is None:
            continue

        def call(*args, _guarded=guarded, _plain=plain, **kwargs):
            return (_guarded if dynamo_imported() else _plain)(*args, **kwargs)
        fns[device_type] = call


def dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules
