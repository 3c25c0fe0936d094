"""The PostgreSQL benchmark's smoke run: tiny sizes, the figures not judged
(the benchmark itself runs by hand: ``asyncworker bench --store ...``)."""

from __future__ import annotations

import io

import pytest

from asyncworker.bench.postgres import PEERS, run_postgres_bench
from asyncworker.devtools.postgres_server import Server, free_port
from lease.worker import StoreError


@pytest.mark.timeout(600)
def test_the_postgres_bench_quick_prints_its_table_and_targets(postgres_server: Server):
    out = io.StringIO()
    rows = run_postgres_bench(postgres_server.url, quick=True, peers=True, out=out)
    text = out.getvalue()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| scenario") and len(table) == len(rows) + 1
    for label in ("PostgreSQL durable commit", "2 dispatcher processes, in-process send",
                  "2 dispatcher processes vs receiver", "claim latency, 1,000 vs",
                  "bulk redrive, 2,000 dead jobs",
                  "ours: enqueue", *(f"peer {peer}" for peer in PEERS)):
        assert any(label in line for line in table), label
    assert "targets:" in text and "claim latency at 1M finished rows" in text
    measured = [r for r in rows if "rate" in r]
    assert all(r["rate"] > 0 for r in measured)


def test_the_postgres_bench_refuses_a_store_it_cannot_use():
    with pytest.raises(ValueError, match="postgresql:// URL or 'postgres'"):
        run_postgres_bench("mysql://localhost/db", quick=True)
    with pytest.raises(StoreError, match="cannot connect to postgresql://bench@127.0.0.1") as e:
        run_postgres_bench(f"postgresql://bench:hunter2@127.0.0.1:{free_port()}/x", quick=True)
    assert "hunter2" not in str(e.value) and "\n" not in str(e.value)
