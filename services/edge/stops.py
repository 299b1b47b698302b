"""Stop sequences applied at the edge (pure): text in, text out up to the first stop.

Engines may or may not honour ``stop`` themselves (the sim does not; vLLM does); the edge
applies it to every stream so the API behaves the same over any backend. While streaming,
the last ``longest stop - 1`` characters are held back: they could be the start of a stop
sequence that the next chunk completes, and text past a stop must never reach the client.
"""

from __future__ import annotations


class StopMatcher:
    """Cuts a stream of text at the first occurrence of any stop sequence."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit after ``text`` arrived ("" once stopped)."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._buf += text
        cut = min((i for s in self._stops if (i := self._buf.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self._buf = self._buf[:cut], ""
            self.stopped = True
            return out
        keep = len(self._buf) - self._hold
        if keep <= 0:
            return ""
        out, self._buf = self._buf[:keep], self._buf[keep:]
        return out

    def flush(self) -> str:
        """The held-back text at the end of the stream."""
        out, self._buf = self._buf, ""
        return "" if self.stopped else out
