"""`detgate bench gateway --profile`: where one recorded request's time goes in the gateway.

The gateway runs under cProfile (`python -m detgate.bench.gateway_profile --out FILE`: the
profile is written when the server stops on SIGTERM) while the benchmark's load runs against
it; `summary` turns the stats into Markdown, per request: the time of each stage's entry
points (inclusive), and self time grouped by stage (which adds up to the whole). A
coroutine's time is counted only while it runs, not while it waits, so these are CPU-bound
figures; cProfile's own cost inflates them all by a similar factor, so read the shares.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import signal
import sys

# Self time by the file it is spent in: the first matching fragment names the stage.
SELF_STAGES = (
    ("validation", ("pydantic", "gateway/protocol.py", "worker_limits.py")),
    ("tenant/limit checks, body read, save (services.py)", (
        "gateway/limits.py", "gateway/rates.py", "gateway/auth.py", "gateway/guard.py",
        "gateway/services.py")),
    ("Lua record write (Redis client)", ("redis/", "gateway/store.py", "gateway/recorder.py",
                                         "gateway/batching.py", "gateway/accounting.py")),
    ("spool", ("gateway/spool.py",)),
    ("JSON and shaping", ("orjson", "gateway/responses.py", "contract/record.py",
                          "gateway/answer.py")),
    ("lease (routing, queue, interrupts)", ("gateway/forward.py", "gateway/router.py",
                                            "gateway/admission.py", "gateway/interrupts.py",
                                            "gateway/disconnect.py")),
    ("middleware, routing, ASGI", ("starlette/", "fastapi/", "gateway/app.py",
                                   "gateway/front.py", "routes/inference.py")),
    ("metrics", ("prometheus_client", "gateway/metrics.py")),
    ("upstream HTTP client", ("aiohttp", "yarl", "multidict", "gateway/upstream.py")),
    ("HTTP server", ("uvicorn", "httptools", "gateway/edge.py")),
    ("event loop", ("asyncio", "uvloop", "contextlib", "selectors")),
)

# Entry points per stage (inclusive time; a stage may list several, nested ones included).
ENTRIES = (
    ("validation", "protocol.py", "parse"),
    ("validation", "worker_limits.py", "check_fits"),
    ("tenant/limit checks", "services.py", "admit"),
    ("tenant/limit checks", "auth.py", "tenant"),
    ("tenant/limit checks", "guard.py", "__call__"),
    ("tenant/limit checks", "guard.py", "refusal"),
    ("Lua record write", "services.py", "save"),
    ("Lua record write", "recorder.py", "save"),
    ("Lua record write", "store.py", "run_durably"),
    ("Lua record write", "batching.py", "run"),
    ("Lua record write", "batching.py", "_send_queued"),
    ("Lua record write", "batching.py", "_round_trip"),
    ("Lua record write", "store.py", "run"),
    ("spool", "recorder.py", "ensure_up"),
    ("spool", "recorder.py", "can_record"),
    ("JSON and shaping", "responses.py", "parse_answer"),
    ("JSON and shaping", "responses.py", "record_choices"),
    ("JSON and shaping", "responses.py", "shape_answer"),
    ("JSON and shaping", "record.py", "as_dict"),
    ("JSON and shaping", "answer.py", "record_document"),
    ("JSON and shaping", "answer.py", "client_answer"),
    ("lease", "forward.py", "send"),
    ("lease", "router.py", "take"),
    ("lease", "forward.py", "_post"),
    ("upstream", "upstream.py", "post"),
    ("middleware", "app.py", "__call__"),
    ("middleware", "front.py", "__call__"),
    ("middleware", "starlette/routing.py", "__call__"),
    ("middleware", "starlette/middleware/errors.py", "__call__"),
    ("handler", "routes/inference.py", "_handle"),
    ("handler", "front.py", "_serve"),
    ("metrics", "metrics.py", "observe_request"),
    ("metrics", "metrics.py", "observe_upstream"),
    ("metrics", "metrics.py", "count_tenant"),
)


def _stage(path: str) -> str:
    for stage, fragments in SELF_STAGES:
        if any(f in path for f in fragments):
            return stage
    return "other"


def _name(key: tuple) -> str:
    path, line, func = key
    short = "/".join(path.split("/")[-2:]) if path != "~" else ""
    return f"{short}:{line}({func})" if short else func


def summary(stats_path: str, requests: int, title: str) -> str:
    """Markdown: per-request microseconds by stage, entry points, and the top functions."""
    st = pstats.Stats(stats_path).stats  # key -> (cc, nc, tt, ct, callers)
    per = 1e6 / max(requests, 1)
    total = sum(v[2] for v in st.values()) * per
    by_stage: dict[str, float] = {}
    for key, (_, _, tt, _, _) in st.items():
        stage = _stage(key[0] if key[0] != "~" else key[2])
        by_stage[stage] = by_stage.get(stage, 0.0) + tt * per
    lines = [f"# {title}", "", f"{requests} recorded requests; profiled time "
             f"{total:.0f} us per request (cProfile inflates every figure; compare shares). "
             "The event loop's share includes its idle wait in epoll (uvloop's run, in C).",
             "", "## Self time by stage", "", "| stage | us / request | share |",
             "|---|---|---|"]
    for stage, us in sorted(by_stage.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {stage} | {us:.1f} | {us / total:.1%} |")
    lines += ["", "## Entry points (inclusive time)", "",
              "| stage | function | calls / request | us / request |", "|---|---|---|---|"]
    for stage, fragment, func in ENTRIES:
        for key, (_, nc, _, ct, _) in st.items():
            if key[2] == func and key[0].endswith(fragment):
                lines.append(f"| {stage} | {_name(key)} | {nc / requests:.2f} | "
                             f"{ct * per:.1f} |")
    lines += ["", "## Top 30 functions by self time", "",
              "| function | stage | calls / request | self us / request | cum us / request |",
              "|---|---|---|---|---|"]
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:30]
    for key, (_, nc, tt, ct, _) in top:
        stage = _stage(key[0] if key[0] != "~" else key[2])
        lines.append(f"| `{_name(key)}` | {stage} | {nc / requests:.2f} | {tt * per:.1f} | "
                     f"{ct * per:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="where the cProfile stats go")
    args = p.parse_args(argv)
    from detgate.gateway import serve
    # uvicorn stops on SIGTERM, then raises it again under the handler found before it: this
    # one lets the stats be written instead of the process ending at once.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        serve.main(args)
    finally:
        profiler.disable()
        profiler.dump_stats(args.out)


if __name__ == "__main__":
    main()
