"""rankserve: an LLM inference and serving runtime for HPC clusters."""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _unshadow() -> None:
    """`python -m ...` from a source checkout puts the checkout on sys.path, where its top-level
    folders (kernels/, models/, runtime/) import as top-level packages: `kernels` then shadows
    Hugging Face's package of that name, which transformers imports with its model configs. The
    package itself never imports them that way, so the checkout leaves sys.path."""
    root = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    if _os.path.isfile(_os.path.join(root, "kernels", "precompile.py")) and \
            _os.path.isfile(_os.path.join(root, "pyproject.toml")):
        _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != root]


_unshadow()


def __getattr__(name):
    # lazy so `import rankserve` (and the API child process) never pulls torch or MPI
    if name == "LLM":
        from rankserve.runtime.llm import LLM
        return LLM
    if name == "SamplingParams":
        from rankserve.runtime.sampling_params import SamplingParams
        return SamplingParams
    if name == "Logprob":
        from rankserve.runtime.outputs import Logprob
        return Logprob
    if name == "BeamSearchParams":
        from rankserve.runtime.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "LoRARequest":
        from rankserve.runtime.messages import LoRARequest
        return LoRARequest
    raise AttributeError(name)
