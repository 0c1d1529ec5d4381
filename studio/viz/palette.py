"""One colour-blind-safe palette for every surface (plotly figures, HTML, Rich terminals, the TUI).

Colours are the Okabe–Ito set (safe for the common colour-vision deficiencies); every state also has
a glyph, so colour is never the only cue (greyscale printouts, NO_COLOR terminals, monochrome
vision). Import-light: no plotly, no rich.
"""
from __future__ import annotations

from enum import Enum


class State(str, Enum):
    """The state of one output position at one forward step (see `studio.viz.grid`)."""
    EMPTY = "empty"
    PROPOSED = "proposed"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    RESAMPLED = "resampled"
    BONUS = "bonus"
    UNMASKED = "unmasked"
    COMMITTED = "committed"

    def __str__(self) -> str:  # so f"{state}" prints "accepted", not "State.ACCEPTED"
        return self.value


# Okabe & Ito (2008), "Color Universal Design".
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
}

# State -> (hex colour, glyph, label). Glyphs are single-width in ordinary terminals.
PALETTE: dict[State, tuple[str, str, str]] = {
    State.EMPTY: ("#FFFFFF", "·", "empty"),
    State.PROPOSED: (OKABE_ITO["sky_blue"], "○", "proposed (draft)"),
    State.ACCEPTED: (OKABE_ITO["bluish_green"], "✓", "accepted"),
    State.REJECTED: (OKABE_ITO["vermillion"], "✗", "rejected"),
    State.RESAMPLED: (OKABE_ITO["orange"], "↻", "resampled (correction)"),
    State.BONUS: (OKABE_ITO["reddish_purple"], "★", "bonus"),
    State.UNMASKED: (OKABE_ITO["blue"], "◆", "unmasked (diffusion)"),
    State.COMMITTED: ("#BDBDBD", "■", "committed (emitted)"),
}

# An unmasked token that is still held in an open block, not yet emitted (carried over a step).
HELD_GLYPH = "◇"

# Which ink reads best on each fill (WCAG contrast): white only on the dark blue.
INK: dict[State, str] = {s: ("#FFFFFF" if s is State.UNMASKED else "#000000") for s in State}

# Precedence when several events touch one position in one step (highest wins).
PRIORITY: dict[State, int] = {
    State.EMPTY: 0, State.COMMITTED: 1, State.PROPOSED: 2, State.UNMASKED: 3, State.ACCEPTED: 4,
    State.BONUS: 5, State.REJECTED: 6, State.RESAMPLED: 7,
}

# How the per-token coloured *text* marks provenance besides colour (HTML/CSS text-decoration).
DECORATION: dict[State, str] = {
    State.PROPOSED: "underline dashed", State.ACCEPTED: "underline solid", State.REJECTED: "line-through",
    State.RESAMPLED: "underline wavy", State.BONUS: "underline double", State.UNMASKED: "underline dotted",
    State.COMMITTED: "none", State.EMPTY: "none",
}

# Rich style strings (terminals; the TUI reuses them). Background = state colour, ink for contrast.
RICH_STYLE: dict[State, str] = {
    s: ("dim" if s is State.EMPTY else f"{'bold ' if s not in (State.COMMITTED,) else ''}"
        f"{INK[s]} on {PALETTE[s][0]}")
    for s in State
}
# Foreground-only variants (for coloured text on the terminal's own background).
RICH_FG: dict[State, str] = {
    State.EMPTY: "dim", State.COMMITTED: "default",
    **{s: PALETTE[s][0] for s in State if s not in (State.EMPTY, State.COMMITTED)},
}
RICH_FG[State.UNMASKED] = "#3A9BDC"  # Okabe–Ito blue is too dark on black terminals; a lighter tint

# Generated text coloured by provenance (how each token was produced), with a non-colour cue too.
RICH_TEXT: dict[State, str] = {
    State.COMMITTED: "default", State.ACCEPTED: f"bold {RICH_FG[State.ACCEPTED]}",
    State.RESAMPLED: f"italic {RICH_FG[State.RESAMPLED]}", State.BONUS: f"bold italic {RICH_FG[State.BONUS]}",
    State.UNMASKED: f"underline {RICH_FG[State.UNMASKED]}", State.PROPOSED: RICH_FG[State.PROPOSED],
    State.REJECTED: f"strike {RICH_FG[State.REJECTED]}", State.EMPTY: "dim",
}
TEXT_CUE: dict[State, str] = {
    State.COMMITTED: "plain: target token", State.ACCEPTED: "bold: accepted draft",
    State.RESAMPLED: "italic: correction", State.BONUS: "bold italic: bonus", State.UNMASKED: "underline: diffusion",
}

# Colours for *runs* in comparison figures (categorical, same Okabe–Ito set, black last).
RUN_COLORS: tuple[str, ...] = (
    OKABE_ITO["blue"], OKABE_ITO["orange"], OKABE_ITO["bluish_green"], OKABE_ITO["vermillion"],
    OKABE_ITO["reddish_purple"], OKABE_ITO["sky_blue"], OKABE_ITO["yellow"], OKABE_ITO["black"],
)


def color(state: State) -> str:
    return PALETTE[state][0]


def glyph(state: State, held: bool = False) -> str:
    return HELD_GLYPH if held and state is State.UNMASKED else PALETTE[state][1]


def label(state: State) -> str:
    return PALETTE[state][2]


def tint(hex_color: str, amount: float) -> str:
    """Mix `hex_color` with white: amount 0 = the colour, 1 = white (light backgrounds behind text)."""
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02X}" for c in mix)


def legend_text() -> str:
    """One line, e.g. for a terminal footer: '○ proposed  ✓ accepted  ...'."""
    return "  ".join(f"{PALETTE[s][1]} {PALETTE[s][2]}" for s in State if s is not State.EMPTY)


# What each forward role (`forward.role` in the events, docs/events.md) does, for legends and tooltips.
FORWARD_ROLES: dict[str, str] = {
    "prefill": "the prompt into the KV cache (in chunks for long prompts)",
    "extend": "ar: one token after the last",
    "cold": "isd: MASK rows draft a chain (nothing to verify yet)",
    "verify": "checks the drafts against the target model; drafts the next chain too",
    "jacobi": "jacobi: refines the whole window at once",
    "draft": "block diffusion: one denoising pass over the open block",
    "commit": "block diffusion: writes a finished block's KV",
    "target": "simsd: the target model completes a block",
}


def roles_legend(roles=None) -> str:
    """'verify: checks the drafts …', one line per role given (default: every role)."""
    return "\n".join(f"{r}: {FORWARD_ROLES[r]}" for r in (roles or FORWARD_ROLES) if r in FORWARD_ROLES)
