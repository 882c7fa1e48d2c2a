"""Triton kernels for the KIVI cache: ``kernels.quantize`` (fused quantize + pack) and
``kernels.decode_attention`` (fused decode attention over KVStream buffers). Import from those modules: the
package does not re-export their functions, whose names would shadow the modules.

Oracles: kivi.quant (quantization, layout) and kivi.attention (attention), via kernels.data.reference_decode.
"""
