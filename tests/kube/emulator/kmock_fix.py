"""A strict-superset fix of kmock 0.8's path parser (installed on import of tests.kube.emulator)."""

from __future__ import annotations

from kmock._internal import parsing as _kmock_parsing

# --- kmock 0.8's path parser crashes on /api/v1/namespaces and misreads /api/v1/namespaces/<name> -----------


def _install_namespace_path_fix() -> None:
    original = _kmock_parsing.parse_path
    if getattr(original, "_orbit_namespaces_fix", False):
        return

    def parse_path(path: str) -> _kmock_parsing.ParsedPath:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
        ):
            return _kmock_parsing.ParsedPath(
                group="",
                version="v1",
                plural="namespaces",
                namespace=None,
                name=parts[3] if len(parts) > 3 else None,
                subresource=parts[4] if len(parts) > 4 else None,
            )
        return original(path)

    parse_path._orbit_namespaces_fix = True  # type: ignore[attr-defined]
    _kmock_parsing.parse_path = parse_path


_install_namespace_path_fix()
