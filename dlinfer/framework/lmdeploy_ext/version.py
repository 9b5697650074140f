"""The one LMDeploy version gate of dlinfer's LMDeploy adaptor.

Every patch under `patches/` was written against LMDeploy 0.18.0 and reaches into its private
module layout (function names, module-level imports, class attributes). Another release may move
any of them, so the adaptor refuses to patch anything but the series listed here.
"""

from __future__ import annotations

SUPPORTED_SERIES: tuple[str, ...] = ("0.18",)
"""LMDeploy `major.minor` series the patches were written and tested against (0.18.0)."""


class UnsupportedLMDeployVersion(ImportError):
    """The installed LMDeploy is not one dlinfer's adaptor supports."""


def series_of(version: str) -> str:
    """'0.18.0' -> '0.18'; '0.18.1rc2' -> '0.18'."""
    parts = version.split(".")
    return ".".join(parts[:2])


def check_lmdeploy_version(version: str) -> None:
    """Raise UnsupportedLMDeployVersion unless `version` belongs to a supported series."""
    if series_of(version) not in SUPPORTED_SERIES:
        supported = ", ".join(f"{s}.x" for s in SUPPORTED_SERIES)
        raise UnsupportedLMDeployVersion(
            f"dlinfer.framework.lmdeploy_ext supports LMDeploy {supported}; found LMDeploy {version}. "
            f"Install a supported release, e.g. `pip install --no-deps lmdeploy==0.18.0`."
        )


def installed_lmdeploy_version() -> str:
    """The version string of the LMDeploy that `import lmdeploy` gives."""
    try:
        import lmdeploy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedLMDeployVersion(
            "dlinfer.framework.lmdeploy_ext needs LMDeploy 0.18.x, which is not installed "
            "(`pip install --no-deps lmdeploy==0.18.0`)."
        ) from e
    return str(getattr(lmdeploy, "__version__", "unknown"))
