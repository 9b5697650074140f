"""dlinfer: coarse fused LLM-inference ops with pluggable accelerator vendors.

Importing dlinfer patches nothing. `import dlinfer.ops` gives the ops, `dlinfer.vendor` the vendor
selection, and `import dlinfer.framework.lmdeploy_ext` (an explicit step) adapts LMDeploy.
"""

from pkgutil import extend_path

# Open to other distributions: a vendor package installed beside dlinfer may add modules under
# dlinfer.vendor and dlinfer.framework.lmdeploy_ext (docs/vendors.md, "LMDeploy's own device types").
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
