"""When a non-streamed upstream request stops counting as "queued ahead" in TTFT admission.

Admission counts a request as work ahead of later ones until its first token (``AdmissionController``). A stream
shows its first token; a whole answer does not: the upstream sends its headers and body together once the whole
generation is done (vLLM, SGLang, OpenAI), so its headers are its last token, not its first. Counting it as queued
until then made every non-streamed request in flight look like prefill work ahead for its whole life, and the
router refused streams it could serve in time.

So a non-streamed request leaves the queue when a stream admitted at the same moment would have had its first
token by the learnt pace (``seconds_per_work`` x the work ahead of it and its own, admission's own estimate), or
when its answer arrives, whichever comes first; with no pace learnt yet it leaves at once (admission refuses
nothing before it has a pace). It gives no TTFT sample: its first token was never seen.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from strataserve.router.admission import AdmissionController, Ticket


def _started(ctl: AdmissionController, ticket: Ticket) -> None:
    # slot_wait means "its TTFT says nothing of the prefill pace": first_token then takes no sample from it
    ticket.slot_wait = True
    ctl.first_token(ticket)


class PlainStart:
    """The admission side of one non-streamed request (a no-op for a trace without a ticket)."""

    def __init__(self, trace: Any) -> None:
        self.ctl: AdmissionController | None = getattr(trace, "admission", None)
        self.ticket: Ticket | None = getattr(trace, "ticket", None)
        self._timer: asyncio.TimerHandle | None = None
        ctl, ticket = self.ctl, self.ticket
        if ctl is None or ticket is None or ticket.started or ticket.done:
            return
        if ctl.seconds_per_work is None:
            _started(ctl, ticket)
            return
        due = ctl.seconds_per_work * (ticket.work_ahead + ticket.work)
        delay = max(0.0, ticket.admitted_at + due - time.perf_counter())
        self._timer = asyncio.get_running_loop().call_later(delay, _started, ctl, ticket)

    def answered(self) -> None:
        """The upstream's answer arrived: whatever of its work was queued is long done."""
        self.cancel()
        if self.ctl is not None and self.ticket is not None:
            _started(self.ctl, self.ticket)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
