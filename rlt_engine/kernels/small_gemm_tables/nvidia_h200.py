"""Small-GEMM dispatch table of the GPU named below (kernels/small_gemm_tables): written by
benchmarks/bench_small_gemm.py on that GPU (but see the end). Keys are
"NxK:m<bucket>:<dtype>"; rows are FIELDS, "us" and "cublas_us" the per-GEMM CUDA-graph
times (do_bench medians) the choice was made by; in the last run
decode in place ranked the configs of (--rank-in-place): 2048x2048;
the shapes checked in decode (--confirm-in-place): 2048x2048. Rows with "us" 0.0 were set
by hand from decode A/Bs in place (deeper rings than the tuner then allowed,
benchmarks/results/2026-12-04-tail-h200.md); a re-run of the tuner replaces them. The m32 rows
of the warp-specialised kernel (17-32 rows: Ouro's four GEMMs, Nanbeige's qkv, o_proj and
down) and Nanbeige's 1-16-row qkv, o_proj (but its m8 row) and down rows were tuned on an H100
SXM, which takes this table (the same kernels on the same 132 SMs), with --ws-only
--confirm-in-place; their times are the H100's (benchmarks/results/
2026-12-06-ws-to-64-rows-h100.md, 2026-12-06-nanbeige-m32-h100.md,
2026-12-06-nanbeige-qkv-ws-h100.md, 2026-12-06-nanbeige-gate-up-timeline-h100.md). So were
Ouro's qkv m16, o_proj m2, gate/up m2 and m16 and down m2-m16 rows (a re-tune whose rows the
in-place check kept bucket by bucket, 2026-12-06-ouro-retune-h100.md) and Nanbeige's 1-16-row
gate/up rows (set by hand from decode A/Bs with two programs an SM, us 0.0,
2026-12-06-gate-up-two-per-sm-h100.md) and its m32 gate/up row (--ws-only --confirm-in-place,
2026-12-07-split-k-swiglu-reverted-h100.md), and Ouro's 1-8-row gate/up rows, the 64-row
`halves` tile (--ws-only --confirm-in-place, 2026-12-07-halves-gate-up-h100.md)."""

TABLE: dict = {
    "device": "NVIDIA H200",
    "capability": "9.0",
    "sms": 132,
    "triton": "3.6.0",
    "torch": "2.11.0+cu130",
    "entries": {
        "6144x2048:m1:bfloat16": ("ws", 64, 256, 1, 4, 5, 8.01, 10.15),
        "6144x2048:m2:bfloat16": ("ws", 64, 256, 1, 4, 5, 7.95, 10.49),
        "6144x2048:m4:bfloat16": ("ws", 64, 256, 1, 4, 5, 8.08, 10.15),
        "6144x2048:m8:bfloat16": ("ws", 64, 256, 1, 4, 5, 7.81, 10.14),
        "6144x2048:m16:bfloat16": ("ws", 64, 256, 1, 4, 5, 10.26, 12.75),
        "6144x2048:m32:bfloat16": ("ws", 64, 128, 1, 4, 8, 10.9, 13.22),
        "6144x2048:m64:bfloat16": ("triton", 64, 128, 1, 4, 4, 9.93, 10.3),
        "2048x2048:m1:bfloat16": ("ws", 64, 256, 4, 4, 2, 4.28, 6.31),
        "2048x2048:m2:bfloat16": ("ws", 64, 256, 4, 4, 2, 5.04, 6.65),
        "2048x2048:m4:bfloat16": ("ws", 64, 256, 4, 4, 2, 4.39, 6.31),
        "2048x2048:m8:bfloat16": ("ws", 64, 256, 4, 4, 2, 4.39, 6.33),
        "2048x2048:m16:bfloat16": ("ws", 64, 256, 4, 4, 5, 4.59, 6.37),
        "2048x2048:m32:bfloat16": ("ws", 64, 128, 4, 4, 8, 6.2, 6.8),
        "2048x2048:m64:bfloat16": ("cublas", 64, 128, 4, 4, 4, 7.38, 6.49),
        "11264x2048:m1:bfloat16": ("ws", 64, 128, 1, 4, 6, 19.05, 22.76),
        "11264x2048:m2:bfloat16": ("ws", 64, 128, 1, 4, 6, 19.15, 22.76),
        "11264x2048:m4:bfloat16": ("ws", 64, 128, 1, 4, 6, 19.06, 22.85),
        "11264x2048:m8:bfloat16": ("ws", 64, 128, 1, 4, 6, 18.89, 22.86),
        "11264x2048:m16:bfloat16": ("ws", 128, 128, 1, 4, 6, 19.29, 23.1),
        "11264x2048:m32:bfloat16": ("ws", 128, 128, 1, 4, 5, 20.01, 23.37),
        "11264x2048:m64:bfloat16": ("triton", 128, 128, 1, 4, 4, 17.49, 19.65),
        "2048x5632:m1:bfloat16": ("ws", 64, 128, 4, 4, 8, 0.0, 11.84),
        "2048x5632:m2:bfloat16": ("ws", 64, 128, 4, 4, 8, 10.3, 13.61),
        "2048x5632:m4:bfloat16": ("ws", 64, 128, 4, 4, 8, 10.31, 13.61),
        "2048x5632:m8:bfloat16": ("ws", 64, 128, 4, 4, 8, 10.37, 13.62),
        "2048x5632:m16:bfloat16": ("ws", 64, 128, 4, 4, 8, 10.71, 13.73),
        "2048x5632:m32:bfloat16": ("ws", 64, 128, 4, 4, 8, 11.88, 14.09),
        "2048x5632:m64:bfloat16": ("triton", 64, 128, 4, 4, 4, 11.35, 12.35),
        "49152x2048:m1:bfloat16": ("triton", 64, 128, 1, 4, 4, 52.86, 54.85),
        "49152x2048:m2:bfloat16": ("triton", 64, 128, 1, 4, 4, 53.03, 54.85),
        "49152x2048:m4:bfloat16": ("triton", 64, 128, 1, 4, 4, 53.21, 55.06),
        "49152x2048:m8:bfloat16": ("cublas", 64, 128, 1, 4, 4, 53.62, 55.18),
        "49152x2048:m16:bfloat16": ("cublas", 64, 128, 1, 4, 4, 54.16, 55.46),
        "49152x2048:m32:bfloat16": ("cublas", 64, 128, 1, 4, 4, 55.44, 56.14),
        "49152x2048:m64:bfloat16": ("cublas", 128, 128, 1, 4, 4, 59.62, 57.39),
        "8192x3072:m1:bfloat16": ("ws", 64, 256, 1, 4, 5, 19.48, 21.67),
        "8192x3072:m2:bfloat16": ("ws", 64, 256, 1, 4, 5, 19.59, 21.7),
        "8192x3072:m4:bfloat16": ("ws", 64, 256, 1, 4, 5, 19.73, 21.77),
        "8192x3072:m8:bfloat16": ("ws", 64, 256, 1, 4, 5, 19.65, 21.77),
        "8192x3072:m16:bfloat16": ("ws", 64, 256, 1, 4, 5, 19.69, 21.97),
        "8192x3072:m32:bfloat16": ("ws", 64, 128, 1, 4, 8, 19.95, 21.69),
        "8192x3072:m64:bfloat16": ("triton", 64, 128, 1, 4, 4, 16.49, 17.26),
        "3072x6144:m1:bfloat16": ("ws", 64, 256, 2, 4, 5, 16.56, 19.36),
        "3072x6144:m2:bfloat16": ("ws", 64, 256, 2, 4, 5, 16.7, 19.28),
        "3072x6144:m4:bfloat16": ("ws", 64, 256, 2, 4, 5, 16.67, 19.52),
        "3072x6144:m8:bfloat16": ("ws", 64, 256, 2, 4, 3, 13.28, 15.73),
        "3072x6144:m16:bfloat16": ("ws", 64, 256, 2, 4, 5, 16.59, 20.44),
        "3072x6144:m32:bfloat16": ("ws", 64, 128, 2, 4, 8, 17.3, 20.52),
        "3072x6144:m64:bfloat16": ("cublas", 64, 128, 2, 4, 4, 16.53, 16.53),
        "3072x10752:m1:bfloat16": ("ws", 64, 256, 2, 4, 5, 27.07, 29.26),
        "3072x10752:m2:bfloat16": ("ws", 64, 256, 2, 4, 5, 26.91, 29.38),
        "3072x10752:m4:bfloat16": ("ws", 64, 256, 2, 4, 5, 27.0, 29.55),
        "3072x10752:m8:bfloat16": ("ws", 64, 256, 2, 4, 5, 26.57, 29.74),
        "3072x10752:m16:bfloat16": ("ws", 64, 256, 2, 4, 5, 26.95, 30.53),
        "3072x10752:m32:bfloat16": ("ws", 64, 128, 2, 4, 4, 28.34, 30.94),
        "3072x10752:m64:bfloat16": ("cublas", 64, 128, 2, 4, 4, 25.86, 24.33),
        "166144x3072:m1:bfloat16": ("triton", 64, 128, 1, 4, 4, 228.38, 236.29),
        "166144x3072:m2:bfloat16": ("triton", 64, 128, 1, 4, 4, 228.86, 238.37),
        "166144x3072:m4:bfloat16": ("cublas", 64, 128, 1, 4, 4, 230.68, 237.5),
        "166144x3072:m8:bfloat16": ("triton", 64, 128, 1, 4, 4, 232.94, 240.75),
        "166144x3072:m16:bfloat16": ("cublas", 128, 128, 1, 4, 4, 235.82, 243.09),
        "166144x3072:m32:bfloat16": ("cublas", 128, 128, 1, 4, 4, 240.74, 245.04),
        "166144x3072:m64:bfloat16": ("cublas", 128, 64, 1, 8, 4, 250.67, 252.13),
        "21504x3072:m1:bfloat16": ("ws", 128, 128, 1, 4, 2, 0.0, 38.78),
        "21504x3072:m2:bfloat16": ("ws", 128, 128, 1, 4, 2, 0.0, 38.63),
        "21504x3072:m4:bfloat16": ("ws", 128, 128, 1, 4, 2, 0.0, 38.97),
        "21504x3072:m8:bfloat16": ("ws", 128, 128, 1, 4, 3, 0.0, 39.02),
        "21504x3072:m16:bfloat16": ("ws", 128, 128, 1, 4, 3, 0.0, 39.78),
        "21504x3072:m32:bfloat16": ("ws", 128, 128, 1, 4, 2, 52.65, 57.5),
        "21504x3072:m64:bfloat16": ("cublas", 128, 64, 1, 8, 4, 40.67, 38.54),
    },
}
