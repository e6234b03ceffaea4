"""One sequence of a loaded artifact on a device: the Relax VM, its weights and the paged KV cache. The device is
this process or an RPC peer (remote.Device, the transport); the calls are the same for both."""

from __future__ import annotations

import time

import numpy as np
import tvm
from tvm import relax

from ..artifacts.artifact import Artifact
from ..errors import MobilecError
from . import npu
from .remote import Device, check_runs_on, local_device


def _in_host_memory(dev) -> bool:
    return dev.dlpack_device_type() == tvm.cpu().dlpack_device_type()


def host_copy(tensor) -> np.ndarray:
    """A numpy copy of a tensor. One in this process's memory is copied through a DLPack view: Tensor.numpy() took
    2-3x as long for SmolLM2's logits right after a decode step (0.17-0.31 vs 0.06-0.10 ms, 2 threads, Zen 3)."""
    if _in_host_memory(tensor.device):
        return np.from_dlpack(tensor).copy()
    return tensor.numpy()


def device_tensor(values: np.ndarray, dev):
    """`values` in a new tensor on `dev`. In this process's memory they are written through a DLPack view
    (tvm.runtime.tensor took 30 us for one token id, a decode step's input; the view 7 us)."""
    if _in_host_memory(dev):
        tensor = tvm.runtime.empty(values.shape, values.dtype, dev)
        np.from_dlpack(tensor)[...] = values
        return tensor
    return tvm.runtime.tensor(values, dev)


class LoadedArtifact:
    """An artifact loaded on a device: the Relax VM, its weights, the model's functions and the KV-cache builtins.
    Session (one sequence) and the serving engine (several sequences in one cache) both start from it.

    Everything the VM is handed is made on the device (shapes, the token tensor): RPC cannot send a Shape, and a
    remote tuple comes back as a handle, read with ffi.ArrayGetItem."""

    def __init__(self, artifact: Artifact, device: Device | None = None, progress: bool = False):
        self.artifact = artifact
        self.device = device or local_device()
        # before loading: a missing instruction kills the process
        self.cpu_check = check_runs_on(artifact, self.device)
        self.device.use_device_of(artifact)
        started = time.perf_counter()
        self.staged = self.device.stage(artifact, progress)  # an RPC peer gets the files it lacks
        staged_at = time.perf_counter()
        with self.device.errors("loading the library"):
            lib = self.device.load_library(artifact, self.staged)
        # the NPU kernels' functions, which the VM looks up as it starts (a hexagon-npu artifact here was built with
        # --host-target: check_runs_on refused one without)
        hexagon = artifact.config["target"]["tvm_target"]["kind"] == "hexagon"
        self.npu = npu.EmulatedNPU(artifact) if hexagon else None
        with self.device.errors("loading the weights"):
            self.vm = relax.VirtualMachine(lib, self.device.devices)
            self.params = self.device.load_params(self.staged, artifact)
            cfg = artifact.config
            self.context_window = int(cfg["context_window"])
            self.prefill_chunk = int(cfg["prefill_chunk"])
            self.page_size = int(cfg["page_size"])
            self._embed, self.decode_function = self.vm["embed"], self.vm["decode"]
            self.prefill_function, self.prefill_logits_function = self.vm["prefill"], self.vm["prefill_logits"]
            self._prefill_hidden_states = self.vm["prefill_hidden_states"]
            # one token of each of several sequences, where the artifact has it (integer-dot decode GEMVs)
            self.batch_decode_function = (self.vm["batch_decode"] if "batch_decode" in cfg.get("call_sites", {}).get(
                "functions", {}) else None)
            self._add_sequence = self.device.function("vm.builtin.kv_state_add_sequence")
            self.begin_forward = self.device.function("vm.builtin.kv_state_begin_forward")
            self.end_forward = self.device.function("vm.builtin.kv_state_end_forward")
            self._item = self.device.function("ffi.ArrayGetItem")
        self.stage_s, self.load_s = staged_at - started, time.perf_counter() - staged_at

    def create_kv_cache(self, max_sequences: int, max_total_tokens: int):
        """An empty paged KV cache for up to `max_sequences` sequences forwarded together and `max_total_tokens`
        tokens over all of them (no sliding window)."""
        shape = self.device.shape
        return self.vm["create_tir_paged_kv_cache"](
            *[shape(n) for n in (max_sequences, max_total_tokens, self.prefill_chunk, self.page_size, 0)])

    def embed(self, tokens):
        return self._embed(tokens, self.params)

    def forward(self, func, tokens, kv_cache, seq_ids, lengths):
        """Run model function `func` on `tokens` (device int32 ids) for the sequences `seq_ids` of `kv_cache`, each
        taking its `lengths` tokens in order (both device shapes); its outputs, on the device."""
        embedded = self.embed(tokens)
        self.begin_forward(kv_cache, seq_ids, lengths)
        out = func(embedded, kv_cache, self.params)
        self.end_forward(kv_cache)
        return out

    def first_output(self, out) -> np.ndarray:
        """The first output of a model function (its logits), on the host."""
        return host_copy(self._item(out, 0))


class Session(LoadedArtifact):
    """Runs prefill/decode for one sequence and returns the logits on the host. Not thread-safe."""

    def __init__(self, artifact: Artifact, device: Device | None = None, progress: bool = False):
        super().__init__(artifact, device, progress)
        shape = self.device.shape
        self.seq_ids, self.one_token = shape(0), shape(1)
        self._token = tvm.runtime.tensor(np.zeros(1, "int32"), self.device.dev)
        # written in place each decode step (Tensor.copyfrom took 11-50 us for the one id)
        self._token_view = np.from_dlpack(self._token) if _in_host_memory(self.device.dev) else None
        self.kv_cache = None
        self.length = 0
        self.fetch_s = 0.0  # seconds spent bringing logits to the host (bench reports it)
        self.reset()

    def reset(self) -> None:
        """Forget the sequence: a fresh KV cache sized to the artifact's context window."""
        self.kv_cache = self.create_kv_cache(1, self.context_window)
        self._add_sequence(self.kv_cache, 0)
        self.length = 0

    def check_room(self, n: int) -> None:
        """Refuse `n` more tokens when the sequence would outgrow the context window, by the whole count asked for
        (a long prompt is fed in chunks; the check is not per chunk)."""
        if self.length + n > self.context_window:
            asked = f"{self.length} tokens in the sequence + {n} more" if self.length else f"{n} tokens"
            raise MobilecError(
                f"{asked} exceed the artifact's context window of {self.context_window}; shorten the input or "
                f"recompile with a larger --context-window"
            )

    def token_tensor(self, token_id: int):
        """The one-token input on the device, rewritten in place (no allocation per decode step)."""
        if self._token_view is not None:
            self._token_view[0] = token_id
        else:
            self._token.copyfrom(np.array([token_id], "int32"))
        return self._token

    def _forward(self, func, tokens, n: int):
        self.check_room(n)
        lengths = self.one_token if n == 1 else self.device.shape(n)
        out = self.forward(func, tokens, self.kv_cache, self.seq_ids, lengths)
        self.length += n
        return out

    def logits(self, out) -> np.ndarray:
        """The first output of a model function (its logits), on the host."""
        start = time.perf_counter()
        values = self.first_output(out)
        self.fetch_s += time.perf_counter() - start
        return values

    def _chunks(self, func, token_ids) -> list:
        ids = np.asarray(token_ids, dtype="int32")
        self.check_room(len(ids))
        return [self._forward(func, device_tensor(ids[start : start + self.prefill_chunk], self.device.dev),
                              len(ids[start : start + self.prefill_chunk]))
                for start in range(0, len(ids), self.prefill_chunk)]

    def prefill(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens (in chunks); the logits [vocab] after the last one."""
        return self.logits(self._chunks(self.prefill_function, token_ids)[-1]).reshape(-1)

    def prefill_all_logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens; the logits [n, vocab] after each one (perplexity, tests)."""
        chunks = self._chunks(self.prefill_logits_function, token_ids)
        return np.concatenate([self.logits(out)[0] for out in chunks], axis=0)

    def prefill_hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens (one chunk); every decoder block's output [num_layers, n, hidden]."""
        if len(token_ids) > self.prefill_chunk:
            raise MobilecError(f"at most {self.prefill_chunk} tokens per call, got {len(token_ids)}")
        return self.logits(self._chunks(self._prefill_hidden_states, token_ids)[0])

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; the logits [vocab] after it."""
        return self.logits(self._forward(self.decode_function, self.token_tensor(token_id), 1)).reshape(-1)
