"""Transforms applied to weights or activations before quantization (not number formats): the Walsh–Hadamard family."""
