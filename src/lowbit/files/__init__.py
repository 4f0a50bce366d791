"""Every file users keep, read and written, in one place.

- lowbit's own checkpoint (`native`) and the transformers loader of it (`hf_quantizer`,
  registered by ``import lowbit``);
- compressed-tensors for vLLM and transformers (`compressed_tensors` writes,
  `compressed_read` reads, `compressed_experts` lays mixture-of-experts experts out per
  expert as the engines' MoE loaders read them), GGUF for llama.cpp (`gguf_export` + `gguf_kquants` write,
  `gguf_read` checks files and keeps their verified float conversions), `inspect` of all;
- the export registry (`targets`: what each target holds, judged from `specs`), which
  Linears the engines fuse (`fused`), and the sealed-folder helper (`sealed`) every
  checksummed folder lowbit writes goes through.

The package sits between `lowbit.nn` and `lowbit.models`: it knows quantized layers and
number formats, never how a model was loaded or made; `lowbit.models` loads native
checkpoints, compressed-tensors folders and GGUF files through it.
"""
