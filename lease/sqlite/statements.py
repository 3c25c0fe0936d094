"""The SQLite driver's SQL, each statement once and named.

A product file is a contract file migrated forward, so the quarantine, the
pick and the marker are the contract's statements on the contract's columns,
narrowed where the product has more (ordered keys, payloads in ``bodies``).
"""

from __future__ import annotations

from lease.rules import CIRCUIT_COLUMNS
from lease.worker import MARKED, PICK_NAMES

# A job in its key's line: still to be delivered, or dead and blocking the
# jobs behind it. The partial index below has this very predicate (SQLite uses
# a partial index only for a query that states its terms).
LINE = ("ordering_key IS NOT NULL AND (status IN ('pending', 'leased')"
         " OR (status = 'dead' AND reason <> 'cancelled'))")


def in_line(alias: str) -> str:
    return LINE.replace("ordering_key", f"{alias}.ordering_key").replace(
        "status", f"{alias}.status").replace("reason", f"{alias}.reason")


# The first of a key's line, if the line has none marked (its first was
# delivered or cancelled, or the line is new): two index probes on the key.
PROMOTE = f"""UPDATE jobs SET held = 0
WHERE seq = (SELECT f.seq FROM jobs f WHERE f.ordering_key = :key AND f.held = 1
    AND {in_line("f")} ORDER BY f.seq LIMIT 1)
  AND NOT EXISTS (SELECT 1 FROM jobs c WHERE c.ordering_key = :key AND c.held = 0
    AND {in_line("c")})"""

# A redriven job that was cancelled goes back to its place: the line's marked
# job, when it is later and not on the wire, waits again behind it.
DEMOTE = f"""UPDATE jobs SET held = 1
WHERE ordering_key = :key AND held = 0 AND {LINE} AND status <> 'leased'
  AND EXISTS (SELECT 1 FROM jobs f WHERE f.ordering_key = :key AND f.held = 1
    AND {in_line("f")} AND f.seq < jobs.seq)"""

# The marked job of each key's line (the only one a claim may take).
FIRSTS = f"""SELECT ordering_key, seq, id, status FROM jobs
WHERE ordering_key = ? AND held = 0 AND {LINE}"""

# lease.worker.PICK less the held jobs, through the index of what may be taken;
# only what a lease (lease.worker.lease_ticket) and its Leased need: every column
# read costs, and a done job's evidence is no claim's business. A picked
# job's body is one probe of its table, made for the rows returned only (the
# index gives the order: no join to sort again).
OWN_READY = "endpoint IS NULL AND status IN ('pending', 'leased') AND held = 0"
DUE_LINE = "endpoint IS NOT NULL AND status = 'pending' AND held = 0"
_DUE = ("((status = 'pending' AND available_at <= :now)"
        " OR (status = 'leased' AND lease_until <= :now))")
PICK_READY_NAMES = (*PICK_NAMES, "digest", "body", "trace")
PICK_READY = f"""
SELECT {', '.join(PICK_NAMES)}, digest,
  (SELECT b.body FROM bodies b WHERE b.seq = jobs.seq) AS body, trace
FROM jobs INDEXED BY jobs_own
WHERE {OWN_READY} AND {_DUE}
ORDER BY seq LIMIT :limit
"""

# ------------------------------------------------------------------ endpoints
# A claim of deliveries takes the endpoints with work from the rotation (the
# least recently served first, passing over the disabled, the paused and the
# open ones in the index's own scan), then each one's due rows by one index
# range: its leases run out first, then its pending deliveries in the order
# they became due. A backlog an endpoint may not send now is never read.
ROTATION = f"""SELECT name, served_at, enabled, max_in_flight, rate, burst, tokens, refilled_ms,
  {', '.join(CIRCUIT_COLUMNS)} FROM endpoints INDEXED BY endpoints_rotation
WHERE has_work = 1 AND enabled = 1 {{only}}
  AND (paused_until_ms IS NULL OR paused_until_ms <= :now)
  AND (circuit <> 'open' OR open_until_ms <= :now)
  AND (served_at, name) > (:served, :name)
ORDER BY served_at, name LIMIT :limit"""
LEASES_OF = """SELECT seq, lease_until FROM jobs INDEXED BY jobs_in_flight
WHERE endpoint = ? AND status = 'leased' ORDER BY lease_until"""
DUE_OF = f"""SELECT seq FROM jobs INDEXED BY jobs_endpoint_due
WHERE endpoint = ? AND {DUE_LINE} AND available_at <= ? ORDER BY available_at, seq
LIMIT ? OFFSET ?"""
PICK_FAIR_NAMES = (*PICK_READY_NAMES, "endpoint", "message")
PICK_FAIR = f"""
SELECT {', '.join(PICK_NAMES)}, digest,
  (SELECT b.body FROM bodies b WHERE b.seq = jobs.seq) AS body, trace, endpoint, message
FROM jobs WHERE seq IN ({{marks}})
"""
ROTATE = "UPDATE endpoints SET served_at = ? WHERE name = ?"
# An endpoint with nothing pending or leased leaves the rotation (until its
# next delivery: an intake, a redrive, a recovery puts it back).
NO_WORK = """UPDATE endpoints SET has_work = 0 WHERE name = :name
  AND NOT EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_by_endpoint
    WHERE endpoint = :name AND status IN ('pending', 'leased'))"""
HAS_WORK = "UPDATE endpoints SET has_work = 1 WHERE name = ? AND has_work = 0"
# The breaker (lease.breaker): an endpoint's circuit, read and written whole.
CIRCUIT_OF = f"""SELECT name, enabled, disable_after_ms, {', '.join(CIRCUIT_COLUMNS)}
FROM endpoints WHERE name IN ({{marks}})"""
WRITE_CIRCUIT = (f"UPDATE endpoints SET {', '.join(f'{c} = ?' for c in CIRCUIT_COLUMNS)}"
                 " WHERE name = ?")
# a probe leased: the circuit half-open, and the deliveries that came due while
# it was open counted as attempts the breaker saved
HALF_OPEN = f"""UPDATE endpoints SET circuit = 'half-open', circuit_since_ms = :now,
  saved = saved + (SELECT COUNT(*) FROM jobs INDEXED BY jobs_endpoint_due
    WHERE endpoint = :name AND {DUE_LINE} AND available_at <= :now)
WHERE name = :name AND circuit = 'open'"""
# the circuit closed: the endpoint's waiting deliveries are due at once
RELEASE_WAITING = f"""UPDATE jobs SET available_at = :now
WHERE endpoint = :name AND {DUE_LINE} AND available_at > :now"""
AUTO_DISABLE = "UPDATE endpoints SET enabled = 0, disabled_why = ? WHERE name = ?"
# Recovery: an endpoint's deliveries finished (done or dead) since a time, sent
# again with a fresh budget; a done one's delivering attempt moves to the
# attempts rows first, so its history keeps it.
RECOVERABLE = """SELECT seq, id, status, token, ordering_key, attempts, done_by, done_started_ms,
  done_latency_ms, done_http_status, available_at FROM jobs INDEXED BY jobs_by_endpoint
WHERE endpoint = :name AND status IN ('done', 'dead') AND available_at >= :since
ORDER BY seq LIMIT :limit"""
RECOVER = ("UPDATE jobs SET status = 'pending', attempts = 0, available_at = ?, deadline = ?,"
    " owner = NULL, lease_until = NULL, reason = NULL, done_by = NULL, done_started_ms = NULL,"
    " done_latency_ms = NULL, done_http_status = NULL, done_after = NULL,"
    " held = CASE WHEN ordering_key IS NOT NULL THEN 1 ELSE 0 END WHERE seq = ?")
SPEND_TOKENS = "UPDATE endpoints SET tokens = ?, refilled_ms = ? WHERE name = ?"
SUBSCRIBERS = "SELECT name, types FROM endpoints ORDER BY name"
MESSAGE_CONTENT = ("SELECT qty, digest, ordering_key, event_type, endpoint FROM jobs"
                   " INDEXED BY jobs_by_message WHERE message = ? LIMIT 1")
INSERT_DELIVERY = ("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
    " available_at, deadline, owner, lease_until, reason, digest, ordering_key, held,"
    " endpoint, message, event_type, trace)"
    " VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?, ?, ?, ?)")
ENDPOINT_COLUMNS = ("name", "url", "ack", "ca_file", "secrets", "headers", "types",
                    "max_in_flight", "rate", "burst", "insecure_http", "enabled",
                    "disable_after_ms", "disabled_why", "created_ms", "updated_ms",
                    *CIRCUIT_COLUMNS, "saved")
ENDPOINT_ROWS = f"SELECT {', '.join(ENDPOINT_COLUMNS)} FROM endpoints ORDER BY name"
ENDPOINT_ROW = f"SELECT {', '.join(ENDPOINT_COLUMNS)} FROM endpoints WHERE name = ?"
INSERT_ENDPOINT = ("INSERT INTO endpoints (name, url, ack, ca_file, secrets, headers, types,"
    " max_in_flight, rate, burst, insecure_http, enabled, disable_after_ms, tokens, refilled_ms,"
    " has_work, served_at, created_ms, updated_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
    " ?, ?, 0, 0, ?, ?)")
# An operator's update; enabling by hand clears an automatic disable's reason.
UPDATE_ENDPOINT = ("UPDATE endpoints SET url = ?, ack = ?, ca_file = ?, secrets = ?,"
    " headers = ?, types = ?, max_in_flight = ?, rate = ?, burst = ?, insecure_http = ?,"
    " enabled = ?, disable_after_ms = ?,"
    " disabled_why = CASE WHEN ? = 1 THEN NULL ELSE disabled_why END,"
    " updated_ms = ? WHERE name = ?")
# A new rate starts with a full bucket, as a new endpoint does.
RESET_BUCKET = "UPDATE endpoints SET tokens = ?, refilled_ms = ? WHERE name = ?"
DELETE_ENDPOINT = "DELETE FROM endpoints WHERE name = ?"
AUDIT_ENDPOINT = ("INSERT INTO endpoint_audit (endpoint, at_ms, action, fields, note, actor)"
                  " VALUES (?, ?, ?, ?, ?, ?)")
LIVE_DELIVERIES = ("SELECT id, status FROM jobs INDEXED BY jobs_by_endpoint"
                   " WHERE endpoint = ? AND status IN ('pending', 'leased') ORDER BY seq")


# Whether any key has a line at all: one probe of jobs_line. With none, no
# finish has a next job to promote, and the finished rows need no second read.
ANY_LINE = f"SELECT EXISTS (SELECT 1 FROM jobs WHERE {LINE})"


# What a finish reads of a row: the marker and the budget, never a payload.

# The extension: a marked row read whole, and its new end.
MARKED_BY_ID = f"SELECT {MARKED} FROM jobs WHERE id = ?"
EXTEND = "UPDATE jobs SET lease_until = ? WHERE seq = ?"

# A claim's UPDATE of a row: these set alike on each, and per row these values.
LEASE_FIXED = "status = 'leased', reason = NULL"
LEASE_NAMES = ("attempts", "token", "owner", "lease_until")

# A finish's UPDATE of a row: these set alike on each, and per row these values.
FINISH_FIXED = "owner = NULL, lease_until = NULL"
FINISH_NAMES = ("status", "reason", "available_at")

# The intake, the evidence, the operator and retention.
CONTENT_OF = "SELECT qty, digest, ordering_key, event_type, endpoint FROM jobs WHERE id = ?"
INSERT_JOB = ("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
    " deadline, owner, lease_until, reason, digest, ordering_key, held, event_type, trace)"
    " VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?, ?)")
INSERT_BODY = "INSERT INTO bodies (seq, body) VALUES (last_insert_rowid(), ?)"
RECORD_ATTEMPTS = ("INSERT INTO attempts (seq, id, token, attempt, owner, started_ms, ended_ms,"
    " outcome, result, reason, http_status, error, latency_ms)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
ATTEMPTS_HIGH = ("SELECT MAX(COALESCE((SELECT MAX(seq) FROM attempts), 0),"
    " COALESCE((SELECT n FROM tallies WHERE name = 'attempts_seq'), 0))")
TALLY = ("INSERT INTO tallies (name, n) VALUES (?, ?)"
    " ON CONFLICT (name) DO UPDATE SET n = n + excluded.n")
AUDIT_REDRIVES = "INSERT INTO redrives (id, token, at_ms, note, actor) VALUES (?, ?, ?, ?, ?)"
RELEASE = ("UPDATE jobs SET status = 'pending', attempts = 0, available_at = ?,"
    " deadline = ?, owner = NULL, lease_until = NULL, reason = NULL,"
    " held = CASE WHEN ordering_key IS NOT NULL AND reason = 'cancelled'"
    " THEN 1 ELSE held END WHERE seq = ?")
AUDIT_CANCELS = ("INSERT INTO cancels (id, token, at_ms, note, was, actor)"
    " VALUES (?, ?, ?, ?, ?, ?)")
CANCEL = ("UPDATE jobs SET status = 'dead', reason = 'cancelled', available_at = ?,"
    " owner = NULL, lease_until = NULL WHERE seq = ?")
PRUNABLE = ("SELECT seq, id FROM jobs WHERE status = 'done' AND available_at < ?"
    " ORDER BY available_at LIMIT ?")
KEEP_ATTEMPTS_HIGH = ("INSERT INTO tallies (name, n) VALUES ('attempts_seq', ?)"
    " ON CONFLICT (name) DO UPDATE SET n = MAX(n, excluded.n)")
PRUNE_ATTEMPTS = "DELETE FROM attempts WHERE id = ?"
PRUNE_REDRIVES = "DELETE FROM redrives WHERE id = ?"
PRUNE_CANCELS = "DELETE FROM cancels WHERE id = ?"
PRUNE_BODIES = "DELETE FROM bodies WHERE seq = ?"
PRUNE_JOBS = "DELETE FROM jobs WHERE seq = ?"
