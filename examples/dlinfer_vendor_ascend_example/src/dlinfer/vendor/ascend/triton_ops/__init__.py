"""Stand-in (layout demonstration) for the vendor's Triton-Ascend kernels."""
