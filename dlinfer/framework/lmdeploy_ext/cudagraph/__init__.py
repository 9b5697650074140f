"""Graph runners for LMDeploy's own device types, provided by vendor packages.

dlinfer ships no module here. LMDeploy 0.18's ascend backend imports
`dlinfer.framework.lmdeploy_ext.cudagraph.ascend_cudagraph` (`AscendGraphRunner`,
`get_ascend_compatible_size`); an Ascend vendor package installed beside dlinfer provides it as a
file `dlinfer/framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py` (and no `__init__.py` on that
path). See docs/vendors.md, "LMDeploy's own device types".
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
