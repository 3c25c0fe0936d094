"""The operator's web page: ``asyncworker ui QUEUE``, or mounted in an aiohttp app.

Overview, jobs, a job's evidence record, the dead letters with bulk redrive
and cancel, and the endpoints (each with its circuit breaker, deliveries,
dead letters, audit rows and recovery), rendered on the server (no script at all), each also as
JSON (``?format=json``). Safe by default: read-only unless changes are
allowed, loopback only unless a token is required, every change a same-site
POST with a CSRF token. ``docs/operator-ui.md`` says what each figure means.

- ``pages``: the application and its pages (``ui_app``)
- ``bulk``: the pure parts of a bulk change (the matched set's fingerprint,
  the result's wording)
- ``recovery``: an endpoint's recovery since a time (the form, the dry run's
  fingerprint, the confirmation of exactly that set)
- ``safety``: the token, the session, CSRF and the security headers
- ``serve``: the launch the ``ui`` command calls (``serve_ui``)
- ``exporter``: ``asyncworker metrics QUEUE``, the queue's metrics served alone
  (the page serves them at ``/metrics`` too: ``asyncworker.queue_metrics``)

What the page does as the command line does (a queue opened for an operator,
the flags' files, the receiver's figures, the dead reasons) is in
``asyncworker.operations``; the page never imports the command line.
"""

from __future__ import annotations

from asyncworker.ui.pages import ui_app
from asyncworker.ui.serve import serve_ui

__all__ = ["serve_ui", "ui_app"]
