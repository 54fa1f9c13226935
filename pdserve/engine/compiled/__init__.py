"""Faster runs of the same forward the eager model computes, for steps of few tokens:
decode CUDA graphs per batch-size bucket (:mod:`.cuda_graphs`, GPU) and the fused CPU
decode kernel (:mod:`.fused_decode`). The model runner builds each where it applies and
asks it, step by step, whether it can run; otherwise the eager model runs."""
