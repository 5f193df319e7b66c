"""Dense fp32 oracles the engine is tested against: a straight-line forward of the looped
models (`reference`), the SHARED-layout semantics (`reference_shared`) and a contiguous-KV
greedy decoder (`contiguous_kv`). Slow on purpose; never used to serve."""
