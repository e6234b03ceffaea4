"""Model families as Relax nn modules (their KV cache's kernels are TVMScript, parsed as each model is exported)."""

from .. import tvmscript_frames

tvmscript_frames.install()
