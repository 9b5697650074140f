"""LMDeploy's graph mode (`eager_mode=False`) on dlinfer: `runner.py` (`DlinferGraphRunner`, the
graph runner the ops backend builds: decode steps compiled with dlinfer's torch.compile backend, one
graph per batch bucket) and `replay.py` (a compiled graph called again without Dynamo)."""
