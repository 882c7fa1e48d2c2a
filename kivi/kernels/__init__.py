"""GPU kernels for the KIVI cache: in Triton, ``kivi.kernels.quantize`` (fused quantize + pack, the slot cache's
flush), ``kivi.kernels.decode_attention`` (fused decode attention over buffers in kivi.quant's layout) and
``kivi.kernels.dense_decode`` (fp16 decode over ragged lengths); in CUDA C++, ``kivi.kernels.cuda_decode`` (the same
decode attention for the layouts it serves, source in ``csrc/``, built at first use). The caches call them through
kivi.backend; they read only kivi.config and kivi.quant. Import from those modules: the package does not re-export
their functions, whose names would shadow the modules.

Oracles: kivi.quant (quantization, layout) and kivi.attention (attention), via tools.kernel_data.reference_decode.

Compile variants: Triton compiles a kernel again for each new pattern of its integer arguments (equal to 1,
divisible by 16). Arguments that follow prompt lengths, batch, split counts or buffer capacities are marked
``do_not_specialize``, so a kernel compiles once per model shape and cache configuration, not again (seconds
each) whenever a new length comes along; strides that are multiples of the head size keep their alignment hints.
tests/kernels/test_compile_variants.py checks the compile keys.
"""
