"""kernels: the hardware, in tiers behind one interface (installed as minipaged.kernels).

    ops.py            KernelOps: what the model and the engine may ask of any tier, with every call's shapes
    simple.py         the plain tier: one readable function per operation (tutorial 4 reads it)
    fast/             the fast CPU tier: registers, panels, oneMKL, one persistent decode kernel
    cuda.py           the CUDA tier: CuPy launchers of the .cu sources (or the CPU harness running them)
    layout.py         the KV cache layout and the attention metadata, defined once
    kv_quant.py       the compressed KV cache's formats (int8, fp8)
    weight_formats.py weights in fewer bytes (bfloat16, int8, GGUF's Q4_1 / Q8_0 blocks) and their spec
    reference.py      NumPy specs of every kernel: the oracle of every tier
    block_copy.py     Numba CUDA block copies; cuda_harness.py runs the .cu sources on a CPU
"""
