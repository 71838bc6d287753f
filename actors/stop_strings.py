"""A request's stop strings, found in its text as the text grows.

Only a match that ends in the newly detokenized text is new (an earlier one would
have stopped the request already), so each call searches the new text and the
tail before it where a match could have begun: the last `hold` characters, `hold`
being the longest stop string's length less one. Never the whole text, which
would cost O(output) a token. `hold` is also what an unfinished output keeps back
from its reader, since those characters may still turn out to begin a stop string.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max(map(len, stops)) - 1
        self._tail = ""  # the text's last `hold` characters

    def feed(self, new_text: str) -> int | None:
        """Search the text as extended by `new_text`. On a match, the number of the
        text's last characters to drop (the earliest match and all after it); else
        None."""
        window = self._tail + new_text
        new_from = len(self._tail)
        found = (window.find(s, max(0, new_from - len(s) + 1)) for s in self.stops)
        stop_at = min((i for i in found if i >= 0), default=None)
        self._tail = window[max(0, len(window) - self.hold) :]
        return None if stop_at is None else len(window) - stop_at
