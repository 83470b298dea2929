"""The private members of mlx-lm that mlx-mtp uses, checked at import: each caller
declares the members it uses with their parameters, and an mlx-lm that lacks one or
changed it is refused in one line (instead of a traceback mid-generation)."""

import inspect
from typing import Optional, Sequence, Tuple

import mlx_lm

from .errors import MTPError


def parameters(fn) -> str:
    """``fn``'s parameters as a def spells them (``*`` before keyword-only ones),
    annotations left out."""
    spelled, starred = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not starred:
            spelled.append("*")
        starred = starred or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={p.default!r}"
        spelled.append(f"{stars}{p.name}{default}")
    return ", ".join(spelled)


def check_private(
    module,
    declared: Sequence[Tuple[str, str]],
    where: str,
    needs: str,
    package: str = "mlx-lm",
    version: Optional[str] = None,
) -> None:
    """Refuse, in one `MTPError` line, a ``module`` that lacks one of ``declared``
    (dotted names within it, with their parameters) or has it with other
    parameters; ``where`` is the module's dotted name, ``needs`` what needs it
    ("mlx-mtp serve needs mlx-lm 0.32.x"), ``package`` and ``version`` the
    installed release it comes from (mlx-lm's by default)."""
    for name, expected in declared:
        member = module
        for part in name.split("."):
            member = getattr(member, part, None)
        try:
            found = parameters(member) if callable(member) else None
        except (TypeError, ValueError):  # no signature to read
            found = None
        if found == expected:
            continue
        change = (
            "is gone"
            if found is None
            else f"has changed (its parameters are ({found}), not ({expected}))"
        )
        if version is None:
            version = getattr(mlx_lm, "__version__", "?")
        raise MTPError(
            f"{needs}: {where}.{name} {change} in the installed {package} {version}"
        )
