"""rankserve: an LLM inference and serving runtime for HPC clusters."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy so `import rankserve` (and the API child process) never pulls torch or MPI
    if name == "LLM":
        from rankserve.runtime.llm import LLM
        return LLM
    if name == "SamplingParams":
        from rankserve.runtime.sampling_params import SamplingParams
        return SamplingParams
    if name == "LoRARequest":
        from rankserve.runtime.messages import LoRARequest
        return LoRARequest
    raise AttributeError(name)
