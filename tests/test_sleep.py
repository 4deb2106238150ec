"""Sleep mode, weight updates and the host KV tier through the offline LLM (one process, CPU):
sleep → wake gives the same greedy tokens; sleep level 2 → new weights from disk or from a
trainer's process group gives the new model's tokens; requests while asleep and admin calls
while busy are refused; a prefix evicted from the device tier comes back from the host tier with
identical output. The server and multi-rank versions are in test_sleep_server.py."""
from __future__ import annotations

import glob
import random
import shutil
import subprocess
import sys

import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.engine_core import EngineBusyError, EngineSleepingError
from rankserve.runtime.messages import EngineCoreRequest

from conftest import STORIES_EMBEDDED

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 403, 407, 261, 378], [1, 5, 17, 300, 41, 99, 8], [1, 212, 7, 7, 400]]
SMALL = dict(num_gpu_blocks_override=64, max_model_len=256)  # a small KV cache: fast to reallocate


def greedy(llm, prompts=PROMPTS, sp=SP):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def perturbed_copy(src: str, dst) -> str:
    """A checkpoint of the same architecture with other weights."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(1)
    for f in glob.glob(f"{dst}/*.safetensors"):
        sd = load_file(f)
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v
                   for k, v in sd.items()}, f, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def ckpts(checkpoint, tmp_path_factory):
    """(A, B): two Llama checkpoints of one architecture, and their greedy tokens."""
    a = checkpoint("LlamaForCausalLM")
    b = perturbed_copy(a, tmp_path_factory.mktemp("llama_b") / "ckpt")
    want = {p: greedy(LLM(p, **SMALL)) for p in (a, b)}
    assert want[a] != want[b]
    return a, b, want


def test_sleep_wake_and_level2_weights_from_disk(ckpts):
    a, b, want = ckpts
    llm = LLM(a, enable_sleep_mode=True, **SMALL)
    assert greedy(llm) == want[a]
    assert llm.sleep(1)["level"] == 1 and llm.is_sleeping()
    with pytest.raises(EngineSleepingError, match="sleeping"):
        llm.generate("Once upon a time", SP)
    assert llm.sleep(1)["is_sleeping"]  # asleep already: nothing to do
    assert llm.wake_up()["is_sleeping"] is False
    assert greedy(llm) == want[a]

    # RL-style: drop everything, wake the weights, load new ones, then the KV cache
    llm.sleep(2)
    assert llm.wake_up(["weights"])["asleep"] == ["kv_cache"]
    assert llm.is_sleeping()
    with pytest.raises(EngineSleepingError):
        llm.generate("Once upon a time", SP)
    llm.update_weights_from_disk(b)
    llm.wake_up(["kv_cache"])
    assert greedy(llm) == want[b]

    # vLLM's level 2 flow: the weights the engine started with (A), reloaded in place
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(["kv_cache"])
    assert greedy(llm) == want[a]
    with pytest.raises(ValueError, match="'load_model'.*reload_weights"):
        llm.collective_rpc("load_model")

    # awake, and back to B without sleeping; the prefix cache was reset by each update
    llm.update_weights_from_disk(b)
    assert greedy(llm) == want[b]


def test_refusals(ckpts, checkpoint, tmp_path):
    a, b, want = ckpts
    llm = LLM(a, **SMALL)
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="holds a Qwen3ForCausalLM checkpoint"):
        llm.update_weights_from_disk(checkpoint("Qwen3ForCausalLM"))
    with pytest.raises(ValueError, match="not a directory"):
        llm.update_weights_from_disk("/no/such/dir")

    # a checkpoint that lacks some tensors is refused before any tensor is copied: the model
    # keeps serving its own weights, not a half-updated mix
    from safetensors.torch import load_file, save_file
    partial = tmp_path / "partial"
    shutil.copytree(b, partial)
    for f in glob.glob(f"{partial}/*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if ".layers.1." not in k}, f,
                  metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for"):
        llm.update_weights_from_disk(str(partial))
    assert greedy(llm) == want[a]
    # a tensor of another shape (the config agrees): refused before any tensor is copied too
    reshaped = tmp_path / "reshaped"
    shutil.copytree(b, reshaped)
    for f in glob.glob(f"{reshaped}/*.safetensors"):
        sd = load_file(f)
        sd[max(sd)] = sd[max(sd)][:1].contiguous()  # the last in file order
        save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights_from_disk(str(reshaped))
    assert greedy(llm) == want[a]
    for f in glob.glob(f"{partial}/*.safetensors"):  # truncated: a bad input (400), not a 500
        data = open(f, "rb").read()
        open(f, "wb").write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="cannot read"):
        llm.update_weights_from_disk(str(partial))

    llm = LLM(a, enable_sleep_mode=True, **SMALL)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="tags must be"):
        llm.wake_up(["weights", "gpu"])
    with pytest.raises(ValueError, match="level must be 1 or 2, got True"):
        llm.sleep(True)
    llm.sleep(2)  # one tag as a string is that tag (vLLM's wake_up("weights") wakes the weights)
    assert llm.wake_up("weights")["asleep"] == ["kv_cache"]
    llm.wake_up()
    # busy: refused (not waited for, not aborted) until the requests are gone
    llm.engine.add_request(EngineCoreRequest("busy", [1, 2, 3], SP))
    with pytest.raises(EngineBusyError, match="1 request"):
        llm.sleep(1)
    with pytest.raises(EngineBusyError):
        llm.update_weights_from_disk(b)
    llm.engine.abort_requests(["busy"])
    llm.sleep(2)
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.update_weights_from_disk(b)
    llm.wake_up()


TRAINER = r"""
import datetime, glob, os, sys
import torch
from safetensors.torch import load_file
addr, port, ws, ckpt, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
sd = {}
for f in sorted(glob.glob(ckpt + "/*.safetensors")):
    sd.update(load_file(f))
if mode == "rankserve":
    from rankserve.runtime.weight_update import trainer_group
    group = trainer_group(addr, port, ws, backend="gloo", timeout_s=120)
    send = lambda t: group.broadcast(t, 0)
    close = group.destroy
else:  # the trainer's side as RL frameworks build it: torch's own group helper
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    timeout = datetime.timedelta(seconds=120)
    store, _, _ = next(dist.rendezvous(f"tcp://{addr}:{port}", 0, ws, timeout=timeout))
    pg, _ = _new_process_group_helper(ws, 0, [], "gloo", dist.PrefixStore("weight_update_group", store),
                                      group_name="weight_update_group", timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(ws)}
    send = lambda t: dist.broadcast(t, src=0, group=pg)
    close = lambda: dist.destroy_process_group(pg)
for name in sorted(sd):
    send(sd[name].contiguous())
close()
print("sent", len(sd), flush=True)
os._exit(0)  # gloo threads may abort in interpreter teardown (a torch quirk, not the engine's)
"""


def start_trainer(ckpt: str, port: int, world_size: int, mode: str = "rankserve"):
    return subprocess.Popen([sys.executable, "-c", TRAINER, "127.0.0.1", str(port), str(world_size),
                             ckpt, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def checkpoint_manifest(ckpt: str) -> dict:
    """names, dtypes, shapes of a checkpoint's tensors in the order the trainer sends them."""
    from safetensors import safe_open
    meta = {}
    for f in sorted(glob.glob(ckpt + "/*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                meta[k] = (str(t.get_dtype()), t.get_shape())
    names = sorted(meta)
    dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return {"names": names, "dtypes": [dtype[meta[n][0]] for n in names],
            "shapes": [list(meta[n][1]) for n in names]}


@pytest.mark.parametrize("trainer_side", ["rankserve", "torch_helper"])
def test_weights_from_a_trainer_process_group(ckpts, trainer_side):
    from test_server import free_port
    a, b, want = ckpts
    llm = LLM(a, enable_sleep_mode=True, **SMALL)
    llm.sleep(2)
    llm.wake_up(["weights"])
    port = free_port()
    trainer = start_trainer(b, port, 2, trainer_side)
    try:
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
        assert llm.update_weights_from_distributed(**checkpoint_manifest(b))["num_tensors"] > 0
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "sent" in out, out
    finally:
        if trainer.poll() is None:
            trainer.kill()
    llm.destroy_weights_update_group()
    llm.wake_up()
    assert greedy(llm) == want[b]
    with pytest.raises(ValueError, match="no weight-update group"):
        llm.update_weights_from_distributed(["x"], ["float32"], [[1]])


def test_prefix_evicted_to_the_host_tier_comes_back_identical(monkeypatch):
    from rankserve.runtime.kv_offload import HostKVCache
    monkeypatch.setattr(HostKVCache, "STAGING_BYTES", 2 * 20480)  # 2 blocks a chunk: copies in chunks
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(64)]  # 4 full blocks of 16
    others = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=8, block_size=16,
                  max_model_len=128, **kw)
        outs = [llm.generate({"prompt_token_ids": p}, sp)[0] for p in [shared] + others + [shared]]
        return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs], llm.engine.scheduler.stats()

    plain, s0 = run()
    tiered, s1 = run(kv_offloading_size=0.01)  # (vLLM's name of --kv-offload-size)
    assert [t for t, _ in tiered] == [t for t, _ in plain]
    assert plain[-1][1] == 0  # the 8-block device tier lost the shared prefix
    assert tiered[-1][1] == 48  # ... the host tier had it: 3 blocks copied back (the last token
    assert s1.host_prefix_hits == 48 and s1.host_blocks_loaded == 3  # is always recomputed)
    assert s1.prefix_hits == 0 and s1.host_blocks_stored >= 4 and s1.host_blocks_total > 0
    assert s0.host_blocks_total == 0


def test_host_tier_survives_sleep_level_1_not_2():
    """Level 1 keeps the host tier (the weights do not change), with the blocks of the request
    that finished just before the sleep (freed, their copies not made by a later step yet);
    level 2 clears it."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=8, block_size=16, max_model_len=128,
              kv_offload_size=0.01, enable_sleep_mode=True)
    llm.generate({"prompt_token_ids": shared[::-1]}, sp)  # copied out in the next step's plan
    first = llm.generate({"prompt_token_ids": shared}, sp)[0].outputs[0].token_ids
    sleep_state = llm.engine.executor.rpc.sleep_state
    for level, cached in ((1, 48), (2, 0)):
        llm.sleep(level)
        # level 1 holds the weights' copy in (pinned) host memory; level 2 none (vLLM's level 2
        # is for minimal host memory): the copy kept from an earlier level 1 sleep goes too
        assert (sleep_state.backup is not None) == (level == 1)
        if level == 2:  # the weights were discarded: load them again
            llm.wake_up(["weights"])
            llm.update_weights_from_disk(str(STORIES_EMBEDDED))
        llm.wake_up()
        o = llm.generate({"prompt_token_ids": shared}, sp)[0]
        assert o.outputs[0].token_ids == first and o.num_cached_tokens == cached, level


def test_sleep_right_after_a_run_ahead_step():
    """Async scheduling: a request that stops on a token leaves the step scheduled ahead for it
    in flight after generate() returns; sleep finishes that step instead of refusing."""
    llm = LLM(str(STORIES_EMBEDDED), async_scheduling=True, enable_sleep_mode=True,
              num_gpu_blocks_override=64, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = llm.generate("Once upon a time", sp)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[want[5]])
    assert llm.generate("Once upon a time", stop)[0].outputs[0].finish_reason == "stop"
    assert llm.engine.in_flight  # the step scheduled ahead
    llm.sleep(1)
    llm.wake_up()
    assert llm.generate("Once upon a time", sp)[0].outputs[0].token_ids == want


class ThreadTrainer:
    """A trainer in a thread of this process (gloo): each `send(tensors)` broadcasts them in
    order while the engine receives; `result()` is None once they all went out, else the error."""

    def __init__(self, port: int):
        import queue
        import threading
        from rankserve.runtime.weight_update import trainer_group
        self.todo, self.done = queue.Queue(), queue.Queue()

        def run():
            group = trainer_group("127.0.0.1", port, 2, backend="gloo", timeout_s=20)
            while (tensors := self.todo.get()) is not None:
                try:
                    for t in tensors:
                        group.broadcast(t, 0)
                    self.done.put(None)
                except RuntimeError as e:
                    self.done.put(str(e))
            group.destroy()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 10):
        return self.done.get(timeout=timeout)


def test_trainer_weights_refused_by_name_or_shape_leave_the_model_and_trainer_whole():
    """A tensor of the wrong shape or one no parameter takes is refused (a 400 naming it)
    before any tensor is loaded, as is an update while requests run or the weights sleep, and
    every announced tensor is still received, so the trainer's
    broadcasts complete instead of waiting out the group's timeout. A tied model's
    `lm_head.weight` and a rotary `inv_freq` (in a trainer's state_dict()) are taken (skipped)."""
    from safetensors.torch import load_file
    from test_server import free_port
    llm = LLM(str(STORIES_EMBEDDED), enable_sleep_mode=True, async_scheduling=True, **SMALL)
    want = greedy(llm)
    sd = load_file(str(STORIES_EMBEDDED / "model.safetensors"))
    port = free_port()
    trainer = ThreadTrainer(port)
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
    embed = "model.embed_tokens.weight"
    sd["lm_head.weight"] = sd[embed]
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    names = sorted(sd)
    trainer.todo.put([sd[n] for n in names])
    llm.update_weights_from_distributed(names, ["float32"] * len(names), [list(sd[n].shape) for n in names])
    assert trainer.result() is None
    other = sd[embed] + 1.0  # weights that would change the output
    q = "model.layers.0.self_attn.q_proj.weight"
    for names, tensors, error in (
            ([embed, q], [other, torch.zeros(3, 3)], f"{q}: shape \\[3, 3\\]"),
            ([embed, "model.layers.0.mlp.bogus.weight"], [other, torch.zeros(3)], "no parameter takes")):
        trainer.todo.put(tensors)
        with pytest.raises(ValueError, match=error):
            llm.update_weights_from_distributed(names, ["float32"] * 2, [list(t.shape) for t in tensors])
        assert trainer.result() is None  # every broadcast went out
        assert greedy(llm) == want  # nothing was loaded
    # refused while requests run (409) or the weights sleep: received all the same
    llm.engine.add_request(EngineCoreRequest("busy", [1, 2, 3], SP))
    llm.engine.step()
    assert llm.engine.in_flight  # (async scheduling: a step of it still running)
    trainer.todo.put([other])
    with pytest.raises(EngineBusyError):
        llm.update_weights_from_distributed([embed], ["float32"], [list(other.shape)])
    assert trainer.result() is None
    llm.engine.abort_requests(["busy"])
    llm.sleep(1)
    trainer.todo.put([other])
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.update_weights_from_distributed([embed], ["float32"], [list(other.shape)])
    assert trainer.result() is None
    llm.wake_up()
    assert greedy(llm) == want
    trainer.todo.put(None)
    llm.destroy_weights_update_group()


def test_an_update_that_fails_part_way_still_resets_the_prefix_cache():
    """Dummy weights (no checkpoint to check shapes against): a bad tensor is found while
    loading, after earlier ones were loaded; the prefix cache is reset all the same, so no
    prefix computed with the old weights is reused with the new ones."""
    from safetensors.torch import load_file
    from test_server import free_port
    llm = LLM(str(STORIES_EMBEDDED), load_format="dummy", **SMALL)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    llm.generate(prompt, SP)
    assert llm.generate(prompt, SP)[0].num_cached_tokens > 0
    port = free_port()
    trainer = ThreadTrainer(port)
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
    embed = load_file(str(STORIES_EMBEDDED / "model.safetensors"))["model.embed_tokens.weight"]
    tensors = [embed, torch.zeros(3, 3)]
    trainer.todo.put(tensors)
    with pytest.raises(ValueError, match="q_proj.weight: has shape"):
        llm.update_weights_from_distributed(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
                                            ["float32"] * 2, [list(t.shape) for t in tensors])
    assert trainer.result() is None
    trainer.todo.put(None)
    llm.destroy_weights_update_group()
    assert llm.generate(prompt, SP)[0].num_cached_tokens == 0
