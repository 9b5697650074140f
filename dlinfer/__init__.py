"""dlinfer: coarse fused LLM-inference ops with pluggable accelerator vendors.

Importing dlinfer patches nothing. `import dlinfer.ops` gives the ops, `dlinfer.vendor` the vendor
selection, and `import dlinfer.framework.lmdeploy_ext` (an explicit step) adapts LMDeploy.
"""

__version__ = "0.1.0"
