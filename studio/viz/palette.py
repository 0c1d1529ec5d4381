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
    # canvas runs (masked diffusion): a cell not filled yet, a filled token replaced by an edit, a position
    # re-noised (showing a noise token, not MASK), and a cell after an early EOS (never output)
    MASKED = "masked"
    EDITED = "edited"
    NOISE = "noise"
    PADDING = "padding"

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
    State.MASKED: ("#F0F0F0", "░", "masked"),
    State.EDITED: (OKABE_ITO["yellow"], "✎", "edited (T2T)"),
    State.NOISE: ("#EBC9DC", "≈", "re-noised (noise token)"),   # a light reddish purple: faint by design
    State.PADDING: ("#DCDCDC", "⊘", "padding (after EOS)"),
}

# An unmasked token that is still held in an open block, not yet emitted (carried over a step).
HELD_GLYPH = "◇"
# States a filled, not yet emitted token is carried in from step to step (`Cell.held`), drawn lighter.
HOLDS = (State.UNMASKED, State.EDITED)

# Which ink reads best on each fill (WCAG contrast >= 4.5): white only on the dark blue, grey on the greys of
# cells with nothing final in them, a dark purple on the noise tint.
INK: dict[State, str] = {s: ("#FFFFFF" if s is State.UNMASKED else "#000000") for s in State}
INK.update({State.MASKED: "#666666", State.PADDING: "#555555", State.NOISE: "#6A3D5A"})

# Precedence when several events touch one position in one step (highest wins). MASKED and NOISE come
# from a remask (to the MASK id, or to noise): a guess proposed at the same step shows over a MASK, the noise
# the canvas holds after the step shows over a guess; PADDING is never an event's (see grid.py).
PRIORITY: dict[State, int] = {
    State.EMPTY: 0, State.MASKED: 1, State.PADDING: 2, State.COMMITTED: 3, State.PROPOSED: 4, State.NOISE: 5,
    State.UNMASKED: 6, State.EDITED: 7, State.ACCEPTED: 8, State.BONUS: 9, State.REJECTED: 10, State.RESAMPLED: 11,
}

# How the per-token coloured *text* marks provenance besides colour (HTML/CSS text-decoration).
DECORATION: dict[State, str] = {
    State.PROPOSED: "underline dashed", State.ACCEPTED: "underline solid", State.REJECTED: "line-through",
    State.RESAMPLED: "underline wavy", State.BONUS: "underline double", State.UNMASKED: "underline dotted",
    State.COMMITTED: "none", State.EMPTY: "none", State.EDITED: "underline overline", State.MASKED: "none",
    State.NOISE: "none", State.PADDING: "line-through",
}

# Rich style strings (terminals; the TUI reuses them). Background = state colour, ink for contrast.
RICH_STYLE: dict[State, str] = {
    s: ("dim" if s is State.EMPTY else f"{'bold ' if s not in (State.COMMITTED,) else ''}"
        f"{INK[s]} on {PALETTE[s][0]}")
    for s in State
}
# A canvas is mostly cells with nothing final in them: no background, so the filled ones stand out (the noise token
# shows faintly, in the noise colour).
RICH_STYLE.update({State.MASKED: "#8A8A8A", State.PADDING: "dim", State.NOISE: "dim italic #CC79A7"})
# Foreground-only variants (for coloured text on the terminal's own background).
RICH_FG: dict[State, str] = {
    State.EMPTY: "dim", State.COMMITTED: "default",
    **{s: PALETTE[s][0] for s in State if s not in (State.EMPTY, State.COMMITTED)},
}
RICH_FG[State.UNMASKED] = "#3A9BDC"  # Okabe–Ito blue is too dark on black terminals; a lighter tint
RICH_FG.update({State.MASKED: "#8A8A8A", State.PADDING: "dim", State.NOISE: "#CC79A7"})

# Generated text coloured by provenance (how each token was produced), with a non-colour cue too.
RICH_TEXT: dict[State, str] = {
    State.COMMITTED: "default", State.ACCEPTED: f"bold {RICH_FG[State.ACCEPTED]}",
    State.RESAMPLED: f"italic {RICH_FG[State.RESAMPLED]}", State.BONUS: f"bold italic {RICH_FG[State.BONUS]}",
    State.UNMASKED: f"underline {RICH_FG[State.UNMASKED]}", State.PROPOSED: RICH_FG[State.PROPOSED],
    State.REJECTED: f"strike {RICH_FG[State.REJECTED]}", State.EMPTY: "dim",
    State.EDITED: f"italic underline {RICH_FG[State.EDITED]}", State.MASKED: "dim", State.NOISE: "dim italic",
    State.PADDING: "dim strike",
}
TEXT_CUE: dict[State, str] = {
    State.COMMITTED: "plain: target token", State.ACCEPTED: "bold: accepted draft",
    State.RESAMPLED: "italic: correction", State.BONUS: "bold italic: bonus", State.UNMASKED: "underline: diffusion",
    State.EDITED: "italic underline: edited",
}

# Colours for *runs* in comparison figures (categorical, same Okabe–Ito set, black last).
RUN_COLORS: tuple[str, ...] = (
    OKABE_ITO["blue"], OKABE_ITO["orange"], OKABE_ITO["bluish_green"], OKABE_ITO["vermillion"],
    OKABE_ITO["reddish_purple"], OKABE_ITO["sky_blue"], OKABE_ITO["yellow"], OKABE_ITO["black"],
)


def color(state: State) -> str:
    return PALETTE[state][0]


def fill(state: State, held: bool = False) -> str:
    """A cell's background: its state's colour, lighter for a token held in an open block (not yet emitted)."""
    return tint(PALETTE[state][0], 0.55) if held and state in HOLDS else PALETTE[state][0]


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


# What a canvas run's grid shows (its legend): the states its events give, a proposal being the model's guess.
CANVAS_STATES = (State.MASKED, State.PROPOSED, State.UNMASKED, State.EDITED, State.NOISE, State.PADDING,
                 State.COMMITTED)
CANVAS_LABELS = {State.PROPOSED: "guess", State.UNMASKED: "filled", State.NOISE: "noise (re-noised)",
                 State.COMMITTED: "committed"}
# What every other run's grid shows.
DRAFT_STATES = (State.PROPOSED, State.ACCEPTED, State.REJECTED, State.RESAMPLED, State.BONUS, State.UNMASKED,
                State.COMMITTED)


def legend_items(canvas: bool | None = False) -> list[tuple[State, str, str]]:
    """(state, glyph, label) of the states a run shows: a drafting run's, a canvas run's (`canvas`, with the held
    glyph), or both, shorter (None: runs of both kinds side by side)."""
    drafting = [(s, PALETTE[s][1], PALETTE[s][2]) for s in DRAFT_STATES]
    if canvas is False:
        return drafting
    items = [(s, PALETTE[s][1], CANVAS_LABELS.get(s, PALETTE[s][2])) for s in CANVAS_STATES]
    items.insert(3, (State.UNMASKED, HELD_GLYPH, "held (not output yet)"))
    if canvas:
        return items
    both = drafting + [i for i in items if i[0] not in DRAFT_STATES]
    return [(s, g, lab.split(" (")[0]) for s, g, lab in both]   # short labels: it must fit one line too


def legend_text(canvas: bool | None = False) -> str:
    """One line for a terminal footer: '○ proposed  ✓ accepted  ...' (a canvas run: '░ masked  ○ guess …')."""
    return "  ".join(f"{g} {lab}" for _, g, lab in legend_items(canvas))


def legend_kind(canvases: list[bool]) -> bool | None:
    """The `canvas` argument of a legend for runs that are canvas runs or not: True, False, or None for both."""
    kinds = set(canvases)
    return None if len(kinds) > 1 else bool(kinds and kinds.pop())


# What each forward role (`forward.role` in the events, docs/events.md) does, for legends and tooltips.
FORWARD_ROLES: dict[str, str] = {
    "prefill": "the prompt into the KV cache (in chunks for long prompts)",
    "extend": "ar: one token after the last",
    "cold": "isd, r-isd: the next token, and MASK rows drafting the chain after it (none when drafts do not pay)",
    "verify": "checks the drafts against the target model; drafts the next chain too",
    "jacobi": "jacobi: refines the whole window at once",
    "draft": "block diffusion: one denoising pass over the open block",
    "commit": "block diffusion: writes a finished block's KV",
    "target": "simsd: the target model completes a block",
}

