"""A loaded artifact on a device: the Relax VM, its weights and one sequence's paged KV cache."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime import ShapeTuple

from ..artifact import Artifact
from ..cpu_check import check_runs_here
from ..errors import MobilecError


class Session:
    """Runs prefill/decode for one sequence. Not thread-safe."""

    def __init__(self, artifact: Artifact, device: tvm.runtime.Device | None = None):
        self.artifact = artifact
        self.device = device or tvm.cpu()
        check_runs_here(artifact.path, artifact.config)  # before loading: a missing instruction kills the process
        try:
            lib = tvm.runtime.load_module(str(artifact.library))
        except Exception as err:  # TVM reports a bad .so as a generic error
            raise MobilecError(f"cannot load {artifact.library}: {str(err).splitlines()[0]}; recompile the artifact") from None
        self.vm = relax.VirtualMachine(lib, self.device)
        self.params = tvm_ffi.convert([tvm.runtime.tensor(a, self.device) for a in artifact.load_params()])
        cfg = artifact.config
        self.context_window = int(cfg["context_window"])
        self.prefill_chunk = int(cfg["prefill_chunk"])
        self.page_size = int(cfg["page_size"])
        self._embed = self.vm["embed"]
        self._prefill = self.vm["prefill"]
        self._prefill_logits = self.vm["prefill_logits"]
        self._prefill_hidden_states = self.vm["prefill_hidden_states"]
        self._decode = self.vm["decode"]
        self._begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
        self._end = tvm.get_global_func("vm.builtin.kv_state_end_forward")
        self.kv_cache = None
        self.length = 0
        self.reset()

    def reset(self) -> None:
        """Forget the sequence: a fresh KV cache sized to the artifact's context window."""
        self.kv_cache = self.vm["create_tir_paged_kv_cache"](
            ShapeTuple([1]),
            ShapeTuple([self.context_window]),
            ShapeTuple([self.prefill_chunk]),
            ShapeTuple([self.page_size]),
            ShapeTuple([0]),
        )
        tvm.get_global_func("vm.builtin.kv_state_add_sequence")(self.kv_cache, 0)
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

    def _forward(self, func, token_ids: np.ndarray):
        n = len(token_ids)
        self.check_room(n)
        embed = self._embed(tvm.runtime.tensor(np.asarray(token_ids, dtype="int32"), self.device), self.params)
        self._begin(self.kv_cache, ShapeTuple([0]), ShapeTuple([n]))
        logits, self.kv_cache = func(embed, self.kv_cache, self.params)
        self._end(self.kv_cache)
        self.length += n
        return logits

    def prefill(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens (in chunks); the logits [vocab] after the last one."""
        self.check_room(len(token_ids))
        logits = None
        for start in range(0, len(token_ids), self.prefill_chunk):
            logits = self._forward(self._prefill, token_ids[start : start + self.prefill_chunk])
        return logits.numpy().reshape(-1)

    def prefill_all_logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens; the logits [n, vocab] after each one (perplexity, tests)."""
        self.check_room(len(token_ids))
        chunks = [
            self._forward(self._prefill_logits, token_ids[start : start + self.prefill_chunk]).numpy()[0]
            for start in range(0, len(token_ids), self.prefill_chunk)
        ]
        return np.concatenate(chunks, axis=0)

    def prefill_hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Append the tokens (one chunk); every decoder block's output [num_layers, n, hidden]."""
        if len(token_ids) > self.prefill_chunk:
            raise MobilecError(f"at most {self.prefill_chunk} tokens per call, got {len(token_ids)}")
        return self._forward(self._prefill_hidden_states, token_ids).numpy()

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; the logits [vocab] after it."""
        return self._forward(self._decode, [token_id]).numpy().reshape(-1)
