"""`torch.library.custom_op`, without its costs where nothing is compiled.

- No `torch._dynamo` import on an op's first eager call: torch wraps every custom op's kernel in
  `torch._disable_dynamo`, which imports `torch._dynamo` (and with it
  `torch.fx.experimental.symbolic_shapes` and sympy: ~2 s on the GPU machine) the first time the
  op runs, even in a process that never compiles anything (compilation levels 0 and 1). Dynamo
  can only be tracing a frame once it has been imported (`torch.compile` imports it), so until
  then the kernel is called as is; afterwards through torch's wrapper, as before.
- No dispatcher on an eager call: calling the op object (`attention(...)`) runs the function
  itself unless torch.compile is tracing or a dispatch mode (FakeTensorMode) is active, which
  see the op as before. The dispatcher's round
  trip costs ~8 us a call, and for an op that mutates an input (the attention op writes the KV
  cache) torch adds a Python ADInplaceOrView kernel that rebuilds the schema's argument list
  once per argument to bump version counters: ~140 us a call on the CI machine, paid by every
  layer of every step that runs eagerly (mixed prefill steps: no CUDA graph covers them). In
  inference no one reads those counters. `torch.ops.rankserve.NAME` still dispatches."""
from __future__ import annotations

import functools
import sys

import torch


def custom_op(name: str, *, mutates_args):
    """`@torch.library.custom_op(name, mutates_args=...)`, with the two savings above."""
    def deco(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        lazy_dynamo_import(op)
        op._eager_fn = fn
        op.__class__ = _eager_call_class(type(op))
        return op
    return deco


# a TorchDispatchMode is active (FakeTensorMode, a tracer): it must see the op, not its body
_modes_active = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


@functools.cache
def _eager_call_class(base: type) -> type:
    class EagerCallOp(base):
        def __call__(self, *args, **kwargs):
            # (dynamo folds is_compiling() to True while it traces)
            if torch.compiler.is_compiling() or _modes_active():
                return base.__call__(self, *args, **kwargs)
            return self._eager_fn(*args, **kwargs)
    return EagerCallOp


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
