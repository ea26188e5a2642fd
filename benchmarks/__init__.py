"""The benchmarks of codegen, run from the checkout's root as modules:

    python -m benchmarks.bench_matmul     one GEMM vs the Python stream loop vs the op (GPU)
    python -m benchmarks.bench_layers     the Llama and GPT MLPs against eager torch (GPU)
    python -m benchmarks.bench_copy       weights streamed from pinned host memory (GPU)
    python -m benchmarks.mlp_offload      a Llama MLP with host weights vs its copy floor (GPU)
    python -m benchmarks.offload_llama    a 4-layer Llama offloaded by codegen.nn (GPU)
    python -m benchmarks.backward         forward + backward against torch autograd (GPU)
    python -m benchmarks.host_cost        where the op's host time goes (GPU)
    python -m benchmarks.bench_overlap    tensor-parallel overlap (GPUs; --dry-run without)
    python -m benchmarks.bench_build      build and load times in new processes (CPU)

Each takes ``--help`` without a GPU and writes its JSON to ``benchmarks/results/``
(``RESULTS.md`` has the tables). Shared timing and the hand-written PyTorch baselines are in
``benchmarks.common``; ``benchmarks.launch_floor`` is the launch-floor baseline (a C++ loop
over one cached cublasLtMatmul) that bench_matmul and host_cost measure. One-off
measurements that answered a single question are in ``benchmarks.probes``
(``probes/README.md``).
"""
