"""The installed version of pdd, as the CLI, ``/version`` and ``system_fingerprint`` report it."""

from importlib.metadata import PackageNotFoundError, version


def pdd_version() -> str:
    """The installed package's version (``unknown`` when run from an uninstalled tree)."""
    try:
        return version("pdd")
    except PackageNotFoundError:
        return "unknown"
