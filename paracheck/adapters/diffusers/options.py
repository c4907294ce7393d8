"""diffusers' context-parallel options: the `--cp-options` names and values (`ContextParallelConfig` fields), and the
modes a variant runs with. Torch-free."""

from __future__ import annotations

from paracheck.domain.case import options_text  # noqa: F401  (the text form, shared by every library's options)
from paracheck.domain.layout import Layout


def cp_options_for(variant: str, layout: Layout) -> tuple:
    """Uneven lengths run with the library's "anything" modes on the CP kinds the layout has (where it
    has both, the library refuses, and says why)."""
    if variant != "uneven" or not layout.has_cp:
        return ()
    return tuple((name, True) for name, degree in (("ring_anything", layout.ring), ("ulysses_anything", layout.ulysses))
                 if degree > 1)


#: `--cp-options` names and the values each takes (the library's `ContextParallelConfig` fields).
CP_OPTIONS = {"ulysses_anything": (True, False), "ring_anything": (True, False),
              "rotate_method": ("allgather", "alltoall"), "convert_to_fp32": (True, False)}


def parse_cp_options(text: str) -> tuple:
    """`name=value,...` -> ((name, value), ...), sorted; ValueError naming the bad part and the rule."""
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        allowed = CP_OPTIONS.get(name)
        if not sep or allowed is None:
            raise ValueError(f"--cp-options {part!r}: write name=value with name one of {', '.join(CP_OPTIONS)}")
        parsed = {"true": True, "false": False}.get(value.lower(), value) if isinstance(allowed[0], bool) else value
        if parsed not in allowed:
            raise ValueError(f"--cp-options {part!r}: {name} takes {' or '.join(str(a) for a in allowed)}")
        options[name] = parsed
    return tuple(sorted(options.items()))
