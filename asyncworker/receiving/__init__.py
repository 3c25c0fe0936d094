"""The receiving side: what a sender's POST reaches.

- ``server``: ``asyncworker serve``, a deduplicating inbox over HTTP
  (``make_app``, ``serve``), answered after COMMIT.
- ``inbox``: the inbox file it writes (and ``asyncworker prune-inbox`` prunes).
- ``idempotent``: the same on your own SQLite file, as a library: your effect
  and the event's id in one transaction.
- ``requests``: what both receivers share: the body read within its cap and
  read time, the signature check, the error answer.

It depends on the synchronous core (``lease``) and the runtime's logs only;
the runtime (the dispatcher) never imports it.
"""
