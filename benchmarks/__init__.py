"""Benchmarks, run through `tandem bench NAME`. Each module exposes
`add_arguments(parser)` and `main(args)`, imports heavy libraries lazily, prints a
Markdown table whose last line is `NAME: <headline> (goal <goal>)`, and writes its
figures as JSON to `args.out`."""

BENCHMARKS = {
    "engine": "benchmarks.engine",
    "roofline": "benchmarks.roofline",
    "transfer": "benchmarks.transfer",
    "serve": "benchmarks.serve",
    "overload": "benchmarks.overload",
    "prefix": "benchmarks.prefix",
    "soak": "benchmarks.soak",
    "autoscale": "benchmarks.autoscale",
    "kernels": "benchmarks.kernels",
    "host": "benchmarks.host_step",
    "gc": "benchmarks.gc_pauses",
    "delivery": "benchmarks.delivery",
    "handshake": "benchmarks.handshake",
    "bursts": "benchmarks.bursts",
    "predictions": "benchmarks.predictions",
    "structured": "benchmarks.structured",
    "speculative": "benchmarks.speculative",
    "responses": "benchmarks.responses",
    "store-pages": "benchmarks.store_pages",
    "large-bodies": "benchmarks.large_bodies",
    "deferred": "benchmarks.deferred_queue",
}
