"""The Pallas Triton lowering: the forward and backward for any CUDA GPU."""
