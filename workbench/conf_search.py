"""Where config options are found: the user's `conf/` in the working folder first, then the
package's own groups. A profiled cluster or a model of one's own is named like a shipped one
(`cluster=here`); a name in both places is an error naming both files, since either choice
would silently shadow the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from workbench.config import CONF_DIR
from workbench.errors import ConfigError
from workbench.places import user_conf_dir


def folders() -> List[Path]:
    """The config roots, searched in this order."""
    user = user_conf_dir()
    return [user, CONF_DIR] if user.is_dir() and user.resolve() != CONF_DIR else [CONF_DIR]


def is_group(name: str) -> bool:
    return any((root / name).is_dir() for root in folders())


def option_files(group: str) -> Dict[str, Path]:
    """Each option of a group and the file that defines it; a name defined twice is an error."""
    found: Dict[str, Path] = {}
    for root in folders():
        for path in sorted((root / group).glob("*.yaml")) if (root / group).is_dir() else []:
            if path.stem in found:
                raise ConfigError(group, path.stem, f"defined twice: {found[path.stem]} and "
                                  f"{path}; rename or remove one")
            found[path.stem] = path
    return found


def options(group: str) -> List[str]:
    return sorted(option_files(group))


def searchpath_override() -> List[str]:
    """The Hydra override that adds the user's folder (none when it does not exist)."""
    roots = folders()
    if len(roots) == 1:
        return []
    return [f"hydra.searchpath=[file://{roots[0].resolve()}]"]


def check_all() -> None:
    """Raise if any option of the user's folder is also defined by the package (a default
    choice would shadow it without the user naming it)."""
    roots = folders()
    if len(roots) > 1:
        for group in sorted(p.name for p in roots[0].iterdir() if p.is_dir()):
            option_files(group)
