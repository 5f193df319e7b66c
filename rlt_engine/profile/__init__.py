"""`rlt profile`: a workload under torch.profiler, summarised by engine phase.

- `rlt_engine.profile.driver` (torch): runs the workload with phase markers wrapped around the
  engine's methods from outside, writes the Chrome trace and returns the summary.
- `rlt_engine.profile.trace` (torch-free): the summary, computed from the Chrome trace alone
  (phase wall times, GPU-busy shares, kernel launches, top kernels).
"""
