"""radixkv benchmarks: `python -m bench --quick | --full [--only core,rpc,copy,workload,storage]`.

Every figure is measured against a baseline taken in the same run, on the same machine,
interleaved with it, and printed as one line `name: value unit (baseline value unit, ratio x)`.
The run writes `docs/benchmarks.md` (and plots in `docs/img/`). Sections:

- `core`: the pure cache in-process (match, insert, load-back, eviction) vs tree size and
  vs a naive list-of-ints radix tree written here (`naive.py`).
- `rpc`: a real daemon subprocess; Match, Insert, LoadBack+ack vs Echo, unix socket and TCP.
- `copy`: the shared-memory data path and the copy engine vs a plain torch copy.
- `workload`: simulated engines (`radixkv.sim`) against a daemon; tokens served per tier.
- `storage`: Prefetch through the daemon (file, Redis) vs raw reads of the same bytes.
- `events`: KV events on vs off (two daemons), with the events published per second
  during the timed Match calls.
- `routing`: the `radixkv.routing` index at 1M block entries across 16 workers (update
  rate, query time).
"""
