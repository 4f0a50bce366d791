"""Files other engines load: compressed-tensors (vLLM, transformers), GGUF (llama.cpp), and inspect.

lowbit's own checkpoint format lives with the other model sources in `lowbit.files.native`.
"""
