"""flyserve.terminal.printable: what a terminal would obey (ESC, C1, DEL, bidi and zero-width characters) and
what rich would read as markup is shown as text instead, replaced rather than dropped, and bounded."""

from __future__ import annotations

import pytest
from rich.console import Console

from flyserve.terminal.printable import FIELD_LIMIT, printable, printable_block, printable_text

OSC52 = "\x1b]52;c;ZXZpbA==\x07"  # write "evil" to the clipboard
CLEAR = "\x1b[2J\x1b[H"
TITLE = "\x1b]0;pwned\x1b\\"
DCS = "\x1bP+q544e\x1b\\"
C1 = "\x9b2J\x9d0;t\x9c\x90x\x9c"  # CSI, OSC, ST, DCS as single C1 characters
FORMAT = (
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200b\u200c\u200d\u200e\u200f\ufeff\u2028\u2029"
)
C0 = "".join(chr(c) for c in range(0x20)) + "\x7f"
RAW = [*C0, *(chr(c) for c in range(0x80, 0xA0)), *FORMAT]


def _raw_in(text: str) -> list[str]:
    return [f"U+{ord(c):04X}" for c in set(text) if c in RAW]


@pytest.mark.parametrize(
    "hostile", [OSC52, CLEAR, TITLE, DCS, C1, FORMAT, C0, "\udcff", "\ue000", "\U000e0001"]
)
def test_every_terminal_control_is_replaced_by_a_visible_escape(hostile: str) -> None:
    out = printable(f"a{hostile}b", None)
    assert _raw_in(out) == [] and out.isprintable()
    assert out.startswith("a") and out.endswith("b") and "\\" in out
    assert len(out) > len(hostile)  # replaced, not dropped


def test_the_escape_names_the_character() -> None:
    assert printable("x\x1b]52;c;QQ==\x07y") == "x\\x1b]52;c;QQ==\\x07y"
    assert printable("\u202eabc") == "\\u202eabc"
    assert printable("\x9b31m") == "\\x9b31m"
    assert printable("line\nforged: ok\tend") == "line\\x0aforged: ok\\x09end"
    assert printable("plain text, ümlaut, 中文, emoji 🙂") == "plain text, ümlaut, 中文, emoji 🙂"


def test_a_field_is_bounded_and_says_how_much_was_cut() -> None:
    out = printable("x" * 10_000)
    assert out.startswith("x" * FIELD_LIMIT) and out.endswith("...(+9744 chars)")
    assert len(printable("\x1b" * 10_000, 40)) < 60
    assert printable(12345) == "12345" and printable(None) == "None"


def test_a_block_keeps_its_lines_and_tabs_and_bounds_each_line() -> None:
    out = printable_block(f"one{OSC52}\n\ttwo{CLEAR}\nthree", line_limit=None)
    assert out == "one\\x1b]52;c;ZXZpbA==\\x07\n\ttwo\\x1b[2J\\x1b[H\nthree"
    long = printable_block("a" * 10_000 + "\nb", line_limit=100)
    assert long.split("\n")[1] == "b" and len(long.split("\n")[0]) < 120


def test_rich_markup_and_emoji_codes_print_literally() -> None:
    c = Console(record=True, width=200, color_system="truecolor", force_terminal=True)
    c.print(printable_text("[red]x[/red] [link=https://evil.example]click[/link] :warning:" + OSC52))
    shown = c.export_text(styles=True)
    assert "[red]x[/red] [link=https://evil.example]click[/link] :warning:" in shown
    assert "\x1b]8;" not in shown and "\x1b]52" not in shown  # no hyperlink, no clipboard write
    assert "\\x1b]52;c;ZXZpbA==\\x07" in shown
