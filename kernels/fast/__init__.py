"""The fast CPU tier: the speed work behind ``kernels/ops.py``'s interface, one module per concept.

``ops.py``          ``FastOps``: the tier's entry point (weights prepared, a step planned, each call routed)
``tuning.py``       ``FastTuning``: every switch and threshold, and the constants compiled into kernels
``compile.py``      serial and threaded compilations, specialised copies, copies that never raise
``elementwise.py``  RMSNorm, rotary, SiLU·up, e^x, log-sum-exp, the streaming read
``kv_write.py``     KV writes (float, int8, fp8, key bounds) and block copies
``attention.py``    the step's attention plan, split-K, the BLAS prompt path, which kernel takes what
``attention_loop.py``       the loop attention kernel (any cache, block-sparse decode)
``attention_registers.py``  the register attention kernel (a float32 pool)
``prompt_attention.py``     long prompts' attention, scores in a chunk-sized scratch
``linear.py``       which engine multiplies a linear layer; the skinny kernel
``panel_gemm.py``   weights in panels, multiplied in registers
``quant_panels.py`` quantized weights in panels (bfloat16, int8, GGUF's blocks); a row's loops in registers
``quant_blocks.py`` GGUF's Q4_1 / Q8_0 blocks in registers: their scales, a widened pair of k, a single row
``quant_widen.py``  quantized panels widened to float32: runs on the stack for the tiles, or whole for BLAS
``quant_a8.py``     GGUF panels times x rounded to int8 ("q4_1_a8", "q8_0_a8"): the bounce buffer, the products
``int8_dot.py``     bytes times bytes into int32 sums, with this CPU's instructions (VNNI, AVX2, plain LLVM)
``packed_gemm.py``  oneMKL's packed sgemm, loaded with ctypes
``linear_paths.py`` which engine each kind of step takes, ``LinearPaths``
``persistent_decode.py``  every layer of a decode step in one parallel region
``huge_pages.py``   a region of 2 MB pages for the panels
``simd.py``, ``fast_math.py``, ``atomics.py``, ``borrowed.py``: the intrinsics underneath
``thread_pools.py`` BLAS's and Numba's thread pools, settled before anything runs
"""
