"""`bench migrate`: CUDA PyTorch code -> Ascend (torch_npu, MindSpeed); and the runtime device redirection."""
