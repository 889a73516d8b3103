"""Where a captured invoke's time goes: our own code's share of a sampled profile, and the cost of
validating one captured episode, beside a plain invoke. The same app as capture_overhead.py.

    py-spy record -f raw -r 250 -o cap.raw -- .venv/bin/python benchmarks/capture_profile.py
    .venv/bin/python benchmarks/capture_profile.py --share cap.raw
    .venv/bin/python benchmarks/capture_profile.py --validation

The first runs the captured app ``--invokes`` times (episodes discarded) under py-spy (not a
dependency: ``pip install py-spy``); the second reads py-spy's raw stacks and prints the share of
samples in marft_bridge frames (their own time and the standard library they call; time in
LangChain/LangGraph called from our wrappers is not ours) and the functions above 0.1%. The third
times, against a plain invoke, what ``TraceStore.submit`` costs the app's thread per captured
episode (its JSON copy, ``writer_process.json_snapshot``, as ``submit_record`` makes it for capture and
``submit`` for any dict, which also walks it for keys that are not text) and what the writer process does with it
(one validation of that JSON by the record model, and the rows' JSON), off the app's GIL.
"""

from __future__ import annotations

import argparse
import collections
import time

from capture_overhead import DiscardStore, build_app


def ours(frames: list[str]) -> str | None:
    """The marft_bridge function a sample's time belongs to: the innermost package frame, if ours."""
    for f in reversed(frames[1:]):
        loc = f[f.rfind("(") + 1:].rstrip(")")
        if loc.startswith("marft_bridge/"):
            return f[:f.rfind(" (")]
        if "/" in loc:  # another package's frame (stdlib frames carry a bare file name)
            return None
    return None


def share(path: str) -> None:
    total, by = 0, collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if "importlib" in stack:  # imports, not invokes
                continue
            total += int(n)
            fn = ours(stack.split(";"))
            if fn is not None:
                by[fn] += int(n)
    print(f"marft_bridge code: {sum(by.values()) / total:.1%} of {total} samples")
    for fn, n in by.most_common():
        if n / total < 0.001:
            break
        print(f"  {n / total:6.2%} {fn}")


class Keep(DiscardStore):
    def __init__(self) -> None:
        self.last = None

    def submit(self, episode) -> None:
        self.last = episode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--invokes", type=int, default=6000, help="captured invokes to run (default 6000)")
    ap.add_argument("--share", metavar="RAW", help="print our share of a py-spy raw profile and exit")
    ap.add_argument("--validation", action="store_true", help="time one episode's validation against a plain invoke")
    args = ap.parse_args()
    if args.share:
        share(args.share)
        return

    import marft_bridge as mb
    from marft_bridge.schema import Episode
    from marft_bridge.store.rows import episode_rows
    from marft_bridge.store.writer_process import json_snapshot

    inputs = {"question": "what is 2 + 2?"}
    kept = Keep()
    app = mb.instrument(build_app(), store=kept)
    for _ in range(args.invokes if not args.validation else 1):
        app.invoke(inputs)
    mb.uninstrument(app)
    if not args.validation:
        return
    plain = build_app()
    n = 1000
    t0 = time.process_time()
    for _ in range(n):
        plain.invoke(inputs)
    per_invoke = (time.process_time() - t0) / n
    data = json_snapshot(kept.last, True)

    def per(fn) -> float:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - t0) / n

    ep = Episode.model_validate_json(data)
    costs = {"app's thread: JSON copy (submit_record)": per(lambda: json_snapshot(kept.last, True)),
             "the same with the key walk (submit)": per(lambda: json_snapshot(kept.last)),
             "writer process: validation of the JSON": per(lambda: Episode.model_validate_json(data)),
             "writer process: the rows' JSON": per(lambda: episode_rows(ep))}
    print(f"plain invoke {per_invoke * 1e3:.3f} ms CPU; its captured episode ({len(kept.last['actions'])} actions, "
          f"{len(data):,} bytes of JSON):")
    for what, c in costs.items():
        print(f"  {what:40s} {c * 1e6:6.0f} us = {c / per_invoke:.1%} of a plain invoke")


if __name__ == "__main__":
    main()
