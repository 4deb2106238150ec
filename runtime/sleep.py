"""Sleep mode (`--enable-sleep-mode`, vLLM's semantics): a rank gives the device memory of its
weights and KV cache back, e.g. to a trainer that shares the GPUs between rollouts, and takes it
again on wake-up.

- level 1: the weights are copied to pinned host memory, the KV cache (and the Mamba2 state
  slots of a hybrid model) is discarded;
- level 2: both are discarded (the caller loads new weights after waking, e.g. with
  update_weights_from_disk / update_weights_from_distributed);
- wake_up(tags): "weights" and/or "kv_cache" (both when None), so that weights can be woken and
  updated before the KV cache takes its memory back.

How the memory really goes back: every parameter's storage is freed (the Parameter objects stay,
holding an empty tensor), the KV-cache tensors and the CUDA graphs (with their private memory
pool) are dropped, and the caching allocator's free segments are returned to the driver
(`torch.cuda.empty_cache`). On wake-up the storages are allocated anew and each parameter is
re-pointed at its old place in its storage (shared and tied storages stay shared), the KV cache
is reallocated, and the CUDA graphs are captured again once both are back: their device
addresses changed. Keeping the addresses instead (so that graphs stay valid) needs an allocator
that unmaps physical memory under fixed virtual addresses (CUDA VMM, a compiled extension, as in
vLLM's CuMemAllocator); rankserve has no compiled extensions, and recapturing costs seconds at
wake-up (`rankserve bench sleep` reports it). torch.compile'd layers take parameters as inputs,
so they need nothing.

What stays on the device: the persistent input buffers, sampler scratch, the RoPE tables (a
module-level cache shared by all layers, at most tens of MiB) and the CUDA context / library
workspaces; with an 8B model that is well under 5 % of what the engine held.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from .kv_offload import HostBuffer, HostKVCache

log = logging.getLogger("rankserve.sleep")

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


def device_bytes(device: torch.device) -> int:
    """What the caching allocator holds on the device (0 on CPU)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def device_used(device: torch.device) -> int:
    """Memory in use on the whole device, by every process and the CUDA context (0 on CPU)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class _Storage:
    """One parameter storage while asleep: its size, the parameters that view it, and its host
    copy (level 1) or None (level 2)."""
    __slots__ = ("host", "nbytes", "refs")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.refs: list[tuple] = []  # (parameter, storage offset, shape, stride, dtype)
        self.host: torch.Tensor | None = None


class RunnerSleep:
    """Sleep state of one rank's model runner."""

    def __init__(self, runner):
        self.runner = runner
        self.asleep: set[str] = set()
        self.level = 0
        self.storages: list[_Storage] = []
        self.had_graphs = False
        self.backup: HostBuffer | None = None  # level 1's host copy, kept for the next level 1

    # ---- sleep ------------------------------------------------------------------------------
    def sleep(self, level: int) -> dict:
        if self.asleep:
            return {"freed_bytes": 0}
        r = self.runner
        t0 = time.perf_counter()
        before, used_before = device_bytes(r.device), device_used(r.device)
        self._drop_graphs()
        self._drop_kv_cache()
        if level == 2 and self.backup is not None:  # no host copy at level 2: an earlier level
            self.backup.release()  # 1 sleep's buffer goes too (level 2 is for host memory too)
            self.backup = None
        self.storages = _release_parameters(r.model, r.device, self._backup if level == 1 else None)
        self.asleep, self.level = set(TAGS), level
        _return_memory(r.device)
        after = device_bytes(r.device)
        log.info("asleep (level %d): %.2f GiB → %.2f GiB on %s in %.2f s", level, before / 2**30,
                 after / 2**30, r.device, time.perf_counter() - t0)
        return {"device_bytes_before": before, "device_bytes_after": after,
                "device_used_before": used_before, "device_used_after": device_used(r.device),
                "seconds": time.perf_counter() - t0}

    def _backup(self, nbytes: int) -> torch.Tensor:
        """Pinned host bytes for the weights' copy: one buffer, reused by later sleeps."""
        if self.backup is None or self.backup.tensor.numel() < nbytes:
            if self.backup is not None:
                self.backup.release()
            self.backup = HostBuffer(nbytes, self.runner.device.type == "cuda")
        return self.backup.tensor[:nbytes]

    def _drop_graphs(self) -> None:
        cm = self.runner.compiled_model
        self.had_graphs = self.had_graphs or bool(cm.graphs)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        cm.graphs.clear()
        cm.mixed_graphs.clear()  # (captured again with the decode graphs on wake-up)

    def _drop_kv_cache(self) -> None:
        r = self.runner
        host = getattr(r, "host_kv", None)
        if isinstance(host, HostKVCache):
            host.release_device()
        for a in r.model.attention_layers():
            a.k_cache = torch.empty(0, dtype=a.k_cache.dtype, device=r.device)
            a.v_cache = torch.empty(0, dtype=a.v_cache.dtype, device=r.device)
        for m in getattr(r.model, "mamba_layers", list)():  # recurrent states: remade on wake-up
            m.conv_state = torch.empty(0, dtype=m.conv_state.dtype, device=r.device)
            m.ssm_state = torch.empty(0, dtype=m.ssm_state.dtype, device=r.device)
        r.prev_sampled = None

    # ---- wake up ----------------------------------------------------------------------------
    def wake_up(self, tags: list[str] | None = None) -> dict:
        r = self.runner
        tags = set(TAGS if tags is None else tags) & self.asleep
        t0 = time.perf_counter()
        timings = {}
        if WEIGHTS in tags:
            _restore_parameters(self.storages, r.device)
            self.storages = []
            if self.level == 2 and getattr(r, "lora", None) is not None:
                r.lora.forget_slots()  # A folded into the weights came back as zeros
            self.asleep.discard(WEIGHTS)
            timings["weights"] = time.perf_counter() - t0
        if KV_CACHE in tags:
            t1 = time.perf_counter()
            r.allocate_kv_cache(r.num_blocks)
            host = getattr(r, "host_kv", None)
            if isinstance(host, HostKVCache):
                host.bind(r.model)
            self.asleep.discard(KV_CACHE)
            timings["kv_cache"] = time.perf_counter() - t1
        if tags and not self.asleep:
            self.level = 0
            if self.had_graphs:  # the weights' and the KV cache's addresses changed
                t1 = time.perf_counter()
                r.compiled_model.capture_cuda_graphs()
                timings["cuda_graphs"] = time.perf_counter() - t1
                self.had_graphs = False
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
        timings["total"] = time.perf_counter() - t0
        if tags:
            log.info("woke %s on %s: %s", "+".join(sorted(tags)), r.device,
                     ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
        return {"seconds": timings, "device_bytes": device_bytes(r.device),
                "device_used": device_used(r.device)}


def _return_memory(device: torch.device) -> None:
    frozen = gc.get_freeze_count()  # a serving process froze its start-up heap (freeze_gc_heap):
    if frozen:  # cycles in it that held the released storage are collected only when thawed
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _release_parameters(model: torch.nn.Module, device: torch.device, backup) -> list[_Storage]:
    """Free the storage of every parameter on `device`; with `backup(nbytes)` (a host buffer)
    copy them all into it first."""
    groups: dict[int, _Storage] = {}
    storages = {}
    seen: set[int] = set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is None or id(p) in seen or p.device != device or p.numel() == 0:
                continue
            seen.add(id(p))
            st = p.untyped_storage()
            g = groups.get(st.data_ptr())
            if g is None:
                g = groups[st.data_ptr()] = _Storage(st.nbytes())
                storages[st.data_ptr()] = st
            g.refs.append((p, p.storage_offset(), tuple(p.shape), tuple(p.stride()), p.dtype))
    for module in model.modules():  # buffers viewing a parameter's storage follow it (LoRA's
        for b in module._buffers.values():  # wide weight, of which `weight` is a view)
            g = None if b is None or id(b) in seen else groups.get(b.untyped_storage().data_ptr())
            if g is not None:
                seen.add(id(b))
                g.refs.append((b, b.storage_offset(), tuple(b.shape), tuple(b.stride()), b.dtype))
    if backup is not None:
        align = 256
        total = sum(-(-g.nbytes // align) * align for g in groups.values())
        host, off = backup(total), 0
        for key, g in groups.items():
            g.host = host[off:off + g.nbytes]
            g.host.copy_(_bytes_of(storages[key], device), non_blocking=True)
            off += -(-g.nbytes // align) * align
    storages.clear()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the host copies are complete before the storage goes
    for g in groups.values():
        for p, *_rest, dtype in g.refs:
            p.data = torch.empty(0, dtype=dtype, device=device)
    return list(groups.values())


def _restore_parameters(storages: list[_Storage], device: torch.device) -> None:
    """New storages (the host copy, or zeros after level 2) and every parameter re-pointed at
    its old place in its storage."""
    for g in storages:
        if g.host is not None:
            buf = torch.empty(g.nbytes, dtype=torch.uint8, device=device)
            buf.copy_(g.host, non_blocking=True)
        else:
            buf = torch.zeros(g.nbytes, dtype=torch.uint8, device=device)
        st = buf.untyped_storage()
        for p, offset, shape, stride, dtype in g.refs:
            p.data = torch.empty(0, dtype=dtype, device=device).set_(st, offset, shape, stride)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes_of(storage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
