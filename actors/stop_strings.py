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
    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        self.stops = stops
        self.keep = keep  # the text ends with the stop string (vLLM's include_stop_str_in_output)
        self.hold = max(map(len, stops)) - 1
        self._tail = ""  # the text's last `hold` characters

    def feed(self, new_text: str) -> int | None:
        """Search the text as extended by `new_text`. On a match, the number of the
        text's last characters to drop (from the earliest match on; kept, from the
        end of the match that ends first); else None."""
        window = self._tail + new_text
        new_from = len(self._tail)
        found = ((window.find(s, max(0, new_from - len(s) + 1)), len(s)) for s in self.stops)
        matches = [(i, i + n) for i, n in found if i >= 0]  # (start, end) in the window
        self._tail = window[max(0, len(window) - self.hold) :]
        if not matches:
            return None
        # Cut before the earliest match; kept, end with the match that ends first.
        cut = min(end for _, end in matches) if self.keep else min(start for start, _ in matches)
        return len(window) - cut
