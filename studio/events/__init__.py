"""Events, the one contract between the engine and everything else (docs/events.md).

`schema`: the fields of `dlm-studio.trace/1.3`, their validation and one constructor per event kind;
`metrics`: TPF, acceptance by draft slot and tok/s, computed from events (docs/metrics.md);
`trace`: the JSON Lines files that hold a run's header, events and footer.
The names most callers need are re-exported here: `from studio import events as ev; ev.forward(...)`.
"""
from studio.events.metrics import Acceptance, Tally, acceptance, summarize, tok_per_s
from studio.events.schema import (EVENT_FIELDS, FOOTER_FIELDS, HEADER_FIELDS, ROLES, SCHEMA, SOURCES, Event,
                                  accept, block, bonus, check_schema, edit, emit, forward, kv, make, propose, reject,
                                  plan, remask, resample, route, unmask, validate_event)
from studio.events.trace import Trace, TraceReader, TraceWriter, full_header, read_trace

__all__ = ["Acceptance", "Tally", "acceptance", "summarize", "tok_per_s", "EVENT_FIELDS", "FOOTER_FIELDS",
           "HEADER_FIELDS", "ROLES", "SCHEMA", "SOURCES", "Event", "accept", "block", "bonus", "check_schema",
           "edit", "emit", "forward", "kv", "make", "plan", "propose", "reject", "remask", "resample", "route", "unmask",
           "validate_event",
           "Trace", "TraceReader", "TraceWriter", "full_header", "read_trace"]
