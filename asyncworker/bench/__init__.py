"""The benchmarks: ``asyncworker bench`` and the ``python -m`` runs beside it.

- ``measure``: what the others share (CPU and RSS, percentiles, where a
  receiver and its clients run, the bulk redrive both stores time, a
  figure's format, a PostgreSQL server and its databases); it imports none
  of them.
- ``sqlite``: the SQLite scenarios, each in a child process
  (``python -m asyncworker.bench.sqlite SCENARIO JSON``).
- ``cpu``: CPU per job, paired against one receiver (``python -m asyncworker.bench.cpu``).
- ``postgres``: the PostgreSQL table (``asyncworker bench --store ...``).
- ``endpoints``: the targets of endpoints as data, on both stores
  (``asyncworker bench --endpoints``).
- ``store_cpu``: the SQLite store's CPU per job, one source tree against
  another (``python -m asyncworker.bench.store_cpu A_TREE B_TREE``).
- ``command``: ``asyncworker bench``'s whole table, on top of the others.

The runtime never imports this package, and nothing here imports the tests.
"""
