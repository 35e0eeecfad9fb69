"""Stop sequences over streamed text, with no I/O (OpenAI `stop`, Ollama `options.stop`; issue 10).

A request ends as soon as one of its stop strings has been generated: at the first position of
the generated text where a stop string ends (of two ending there, the longer), as a client
reading character by character would see it, whatever the segmentation. The stop string itself
is never emitted, not even partly in a stream. Text arrives in segments (the
detokenizer's `last_segment` per token), and a stop string may span segments, so the filter holds
back the longest tail of the text that is a proper prefix of some stop string, and releases it
once it can no longer become one::

    stops ["\\n\\nThe end"]     feed("was happy.\\n")   -> "was happy."    held "\\n"
                               feed("\\nThe")          -> ""              held "\\n\\nThe"
                               feed(" cat")            -> "\\n\\nThe cat"  held ""
                               feed("\\n\\nThe end.")    -> ""              stopped (".": never emitted)

Invariant: no stop string occurs in `text` + held, and no stop string starts inside `text`
(a start in `text` would make its tail a prefix of that stop, and it would be held). So every
stop string that ends inside the next segment lies whole in held + segment.
"""

from __future__ import annotations

from typing import Sequence


class StopFilter:
    """Cut streamed text before the first stop string (module docstring).

    Args:
        stops: the stop strings (non-empty; duplicates are harmless).
    Attributes:
        text: everything released so far. stopped: a stop string was found; later feeds give "".
        stop: the stop string that matched, or None.
    Raises:
        ValueError: an empty stop string (it would match at once).
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("A stop sequence must not be empty.")
        self.stops = tuple(dict.fromkeys(stops))
        self.text = ""
        self.stopped = False
        self.stop = None
        self._held = ""

    def feed(self, segment: str) -> str:
        """Add the next generated text; return what may be released now ("" once stopped)."""
        if self.stopped or not segment:
            return ""
        buf = self._held + segment
        first = None  # (end, start, stop) of the stop completed first; at the same end, the longest
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or (i + len(s), i) < first[:2]):
                first = (i + len(s), i, s)
        if first is not None:
            self.stopped, self.stop, self._held = True, first[2], ""
            out = buf[:first[1]]
        else:
            keep = self._longest_prefix_tail(buf)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out

    def finish(self) -> str:
        """The generation ended without a stop: release what was held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        self.text += out
        return out

    @property
    def held(self) -> str:
        """Text withheld because it may begin a stop string."""
        return self._held

    def _longest_prefix_tail(self, buf: str) -> int:
        """The length of the longest tail of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


__all__ = ["StopFilter"]
