"""Pallas TPU kernels the target's decoding layers and prefills run on TPUs: the fused
attention half and MLP of a decoding layer (`fused`) and splash attention (`splash`). Imports
nothing else of the package; `models.target` chooses them."""
