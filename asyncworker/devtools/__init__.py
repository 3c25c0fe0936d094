"""Tools for developing and measuring the dispatcher, not for running it: the
PostgreSQL launcher (``postgres_server``) the benchmarks and the test suite
start their servers with. The runtime never imports this package."""
