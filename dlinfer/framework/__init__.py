"""Adaptors that plug dlinfer into inference engines.

Nothing here is imported by `import dlinfer`. Importing `dlinfer.framework.lmdeploy_ext` patches
LMDeploy (see that package); importing this package alone does nothing.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)  # open to vendor packages (docs/vendors.md)
