"""`python -m dlinfer quantize SRC DST`: quantised checkpoints that LMDeploy 0.18 loads unchanged,
made on a CPU from a local HF folder and a local calibration text (docs/quantize.md).

One file per step: `source` (check and load SRC), `calib` (calibration and tuning token samples),
`walk` (run the decoder layer by layer and record the inputs of its linears), `awq`
(activation-aware scale search and 4-bit group quantisation), `awq_clip` (AWQ's weight-clipping
search), `distil` (the tuning of the group scales and norms that ends AWQ), `pack` (LMDeploy's AWQ
"gemm" int32 layout), `smooth_quant` (SmoothQuant smoothing and int8 per-channel weights),
`kv_scales` (static int8 KV cache scales), `writer` (the DST folder), `cli` (the command).
Nothing here imports the framework layer; torch and transformers are imported inside the
functions that need them.
"""
