"""The writer process behind ``TraceStore.submit`` (``writer_process.py`` starts and feeds it).

    python -m marft_bridge.store.writer_child    # stdin: frames from the app; stdout: one line per group

It opens the app's store (same URL, same ``RecordLimits``) and runs the store's group commit on
each group of episodes it is sent: parsing and validating their JSON with the record model, the
rows' JSON, the SQL, dead-lettering refused ones — all on this process's own GIL, none on the app's.

Protocol (all lengths little-endian u32): a config frame (length, then JSON ``{"url", "limits"}``;
on stdin, so a password in the URL is never on a command line), answered ``ready`` or
``error <why>``; then groups: a count, then that many frames (length, then an episode's JSON), each
answered ``ok <cpu seconds used so far>`` once the group is committed (or dead-lettered). At end of
input (the app closed the store, exited or died) what was read is written and the process exits:
a group already sent outlives the app.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from .writer_process import read_frame, read_group

def main() -> int:
    # The protocol owns the real stdout; anything else printed goes to stderr with the logs.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # Ctrl-C in the app's terminal is the app's to handle: the writer finishes what it was sent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stderr goes to the app's "marft_bridge.store" logger (writer_process._relay_logs): "LEVEL message".
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    inp = sys.stdin.buffer
    config = read_frame(inp)
    if config is None:
        return 0
    try:
        from ..limits import RecordLimits
        from .tracestore import TraceStore

        cfg = json.loads(config)
        store = TraceStore(cfg["url"], limits=RecordLimits.model_validate(cfg["limits"]), writer="thread")
    except Exception as e:  # noqa: BLE001 - reported to the app, which writes in a thread instead
        out.write(b"error " + f"{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
        return 1
    out.write(b"ready\n")
    more = True
    while more:
        items, more = read_group(inp)
        if items:
            store.write_queued(items)  # logs and dead-letters; never raises
        if more:
            out.write(f"ok {time.process_time():.6f}\n".encode())
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
