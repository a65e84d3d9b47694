"""Triton GPU kernels (layer 5). Each module holds the math and its source in a docstring, ``_name_kernel``, a host
wrapper that validates shapes/strides/dtypes (ValueError saying what to change) and a PyTorch ``*_ref`` beside it.

- ``rms_norm``: ``rms_norm``, ``fused_add_rms_norm`` (in place: residual += x; x = norm(residual))
- ``activation``: ``silu_and_mul`` ([gate | up] -> silu(gate) * up)
- ``rotary``: ``apply_rotary`` (neox, in place on q/k, optional fused Qwen3 q/k RMSNorm)
- ``rotary_kv``: ``rotary_store_kv`` ((q/k norm +) rotary + paged KV store in one launch)
- ``kv_cache``: ``store_kv`` (paged cache write through a slot mapping; slot < 0 = skip)
- ``kv_quant``: fp8 / int8 KV storage with per-head scales (quantise on store, convert + fold scales on load);
  ``kv_quant_ref`` its PyTorch side (no triton: the CPU attention path uses it)
- ``decode_attention``: ``paged_decode_attention`` (split-KV flash-decoding, GQA-packed, + reduce kernel; or
  per-row split counts chosen in the kernel, combined by the last split program)
- ``prefill_attention``: ``prefill_attention`` (varlen causal over block tables, cached prefixes)
- ``gemv``: ``gemv`` (one-row matmul, optional split-K; used per weight shape where it beat cuBLAS at start-up)
- ``argmax``: ``argmax_rows`` (the greedy token of each logits row, torch.argmax's index; two short launches)
- ``skinny_gemm``: ``skinny_gemm`` (few-row matmul, optional split-K; used per weight shape for decode steps of 2-64
  rows where it beat cuBLAS at start-up)

Kernels are pure functions over tensors; ``runner/triton_ops.py`` wires them into the runner's ``OpSet``.
"""
