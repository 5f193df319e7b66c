"""Triton kernels. Import the functions from their modules, e.g.
`from rlt_engine.kernels.paged_attention import paged_attention, supported` (not re-exported
here: a function named like its module would shadow the module). Importing works without
triton installed; `supported()` then says why the kernels cannot run."""
