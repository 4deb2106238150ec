import sys, time, json
from rankserve.runtime.startup_clock import process_age
from rankserve.models.loader import load_hf_config
from rankserve.runtime.bench.common import resolve_model, model_stats
import torch  # noqa
a0 = process_age()
c = load_hf_config(resolve_model(sys.argv[1])[0], sys.argv[2])
a1 = process_age()
model_stats(c)
a2 = process_age()
mods = [m for m in ("transformers", "sympy", "torch._dynamo", "triton") if m in sys.modules]
print(json.dumps(dict(imports=a0, config=a1 - a0, stats=a2 - a1, total=a2, mods=mods)))
