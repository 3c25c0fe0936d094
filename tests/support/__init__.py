"""Helpers the tests share: servers, child programs, clocks, queues."""
