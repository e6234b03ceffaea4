"""Hand-written TIR kernels for the cases dlight's rules cannot express (explicit vector instructions)."""

from .. import tvmscript_frames

tvmscript_frames.install()
