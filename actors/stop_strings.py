"""A request's stop strings, found in its text as the text grows.

Only a match that ends in the newly detokenized text is new (an earlier one would
have stopped the request already), so each call searches the new text and the
tail before it where a match could have begun: the last `hold` characters, `hold`
being the longest stop string's length less one. Never the whole text, which
would cost O(output) a token. `held_chars` is what an unfinished output keeps back
from its reader: the `hold` characters that may still turn out to begin a stop
string, which is cut from the text; none where the text keeps its stop string
(it ends with the match, in text not yet read, as vLLM holds none back).

Where matches overlap, the one that ends first is the first in the text (none
ended before the new text), as if the tokens had come one character at a time:
`stop=["Hello", "ell"]` cuts "Hello" to "H" whether the tokens were "H", "el",
"lo" or five letters (the earliest start made the first "").
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        self.stops = stops
        self.keep = keep  # the text ends with the stop string (vLLM's include_stop_str_in_output)
        self.hold = max(map(len, stops)) - 1
        self._tail = ""  # the text's last `hold` characters
        self.matched: str | None = None  # the stop string found (`feed`)

    @property
    def held_chars(self) -> int:
        """The text's last characters an unfinished output does not show yet."""
        return 0 if self.keep else self.hold

    def feed(self, new_text: str) -> int | None:
        """Search the text as extended by `new_text`. On a match, the number of the
        text's last characters to drop: from the start of the match that ends
        first (kept, from its end); else None."""
        window = self._tail + new_text
        new_from = len(self._tail)
        found = ((window.find(s, max(0, new_from - len(s) + 1)), s) for s in self.stops)
        matches = [(i, i + len(s), s) for i, s in found if i >= 0]  # (start, end, the string) in the window
        self._tail = window[max(0, len(window) - self.hold) :]
        if not matches:
            return None
        start, end, self.matched = min(matches, key=lambda match: (match[1], match[0]))
        return len(window) - (end if self.keep else start)
