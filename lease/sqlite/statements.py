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
# index gives the order: no join to sort again). The higher priority first,
# then seq (intake order): the index leads with priority, so the scan stops
# after the batch as before; a job not yet due (a retry's backoff, a delayed
# intake) is passed over in the scan, as it always was.
OWN_READY = "endpoint IS NULL AND status IN ('pending', 'leased') AND held = 0"
DUE_LINE = "endpoint IS NOT NULL AND status = 'pending' AND held = 0"
# A delivery that neither jobs_endpoint_due nor jobs_in_flight holds: held
# behind its line's first, done or dead (jobs_endpoint_rest). A read by that
# index repeats these terms word for word: SQLite uses a partial index only
# for a WHERE that contains its own.
REST_LINE = "endpoint IS NOT NULL AND status <> 'leased' AND (status <> 'pending' OR held <> 0)"
# An endpoint's leases (jobs_in_flight's terms).
IN_FLIGHT = "status = 'leased' AND endpoint IS NOT NULL"
_DUE = ("((status = 'pending' AND available_at <= :now)"
        " OR (status = 'leased' AND lease_until <= :now))")
# the payload last (batch.read), the priority for the claim's order (batch.claim_order)
PICK_READY_NAMES = (*PICK_NAMES, "digest", "trace", "priority", "body")
PICK_READY = f"""
SELECT {', '.join(PICK_NAMES)}, digest, trace, priority,
  (SELECT b.body FROM bodies b WHERE b.seq = jobs.seq) AS body
FROM jobs INDEXED BY jobs_own
WHERE {OWN_READY} AND {_DUE}
ORDER BY priority DESC, seq LIMIT :limit
"""

# ------------------------------------------------------------------ endpoints
# A claim of deliveries costs the same few statements whatever the number of
# endpoints: one takes a batch of endpoints with work from the rotation (the
# least recently served first, passing over the disabled, the paused and the
# open ones in the index's own scan) with each one's live leases counted and
# its leases run out beside it; one a round reads the due rows of every
# endpoint of the batch, each by one index range of its own (its pending
# deliveries in the order they became due); one writes every endpoint
# examined back. A backlog an endpoint may not send now is never read.
_LEASED = ("jobs.endpoint = endpoints.name AND jobs.status = 'leased'"
           " AND jobs.endpoint IS NOT NULL")
# Of the breaker's columns only the two that say whether the circuit is plainly
# closed: the rest is read (CIRCUIT_OF) for the few endpoints whose is not.
ROTATION_NAMES = ("name", "served_at", "enabled", "max_in_flight", "rate", "burst", "tokens",
                  "refilled_ms", "circuit", "paused_until_ms", "live", "run_out")
ROTATION = f"""SELECT {', '.join(ROTATION_NAMES[:-2])},
  (SELECT COUNT(*) FROM jobs INDEXED BY jobs_in_flight
    WHERE {_LEASED} AND jobs.lease_until > :now) AS live,
  (SELECT group_concat(jobs.lease_until || ' ' || jobs.seq) FROM jobs INDEXED BY jobs_in_flight
    WHERE {_LEASED} AND jobs.lease_until <= :now) AS run_out
FROM endpoints INDEXED BY endpoints_rotation
WHERE has_work = 1 AND enabled = 1 {{only}}
  AND (paused_until_ms IS NULL OR paused_until_ms <= :now)
  AND (circuit <> 'open' OR open_until_ms <= :now)
  AND (served_at, name) > (:served, :name)
ORDER BY served_at, name LIMIT :limit"""
# The seqs of each endpoint's due rows, the higher priority first, then in
# the order they became due (jobs_endpoint_due's order: one index scan that
# passes over the rows of a higher priority not due yet), LIMIT ?2
# OFFSET ?3, for the names in VALUES (a NULL name: padding, no row); ?1 is the
# store's time. The aggregate takes its subquery's rows in their order (SQLite
# runs the subquery as a coroutine the aggregate steps through), as the batch
# reads of lease.sqlite.batch do.
DUE_EACH = f"""SELECT e.column1, (SELECT group_concat(d.seq) FROM (
    SELECT seq FROM jobs INDEXED BY jobs_endpoint_due
    WHERE endpoint = e.column1 AND {DUE_LINE} AND available_at <= ?1
    ORDER BY priority DESC, available_at, seq LIMIT ?2 OFFSET ?3) AS d)
FROM (VALUES {{names}}) AS e"""
# The same when each endpoint's share is one row (a claim spread over as many
# endpoints as its limit): the row itself, with no aggregate to build.
DUE_FIRST_EACH = f"""SELECT e.column1, (SELECT seq FROM jobs INDEXED BY jobs_endpoint_due
    WHERE endpoint = e.column1 AND {DUE_LINE} AND available_at <= ?1
    ORDER BY priority DESC, available_at, seq LIMIT ?2 OFFSET ?3)
FROM (VALUES {{names}}) AS e"""
# The deliveries picked, the payload last (lease.sqlite.batch reads it beside the JSON).
PICK_FAIR_NAMES = (*PICK_NAMES, "digest", "endpoint", "message", "trace", "priority", "body")
PICK_FAIR = f"""
SELECT {', '.join(PICK_NAMES)}, digest, endpoint, message, trace, priority,
  (SELECT b.body FROM bodies b WHERE b.seq = jobs.seq) AS body
FROM jobs WHERE seq IN ({{marks}})
"""
# Every endpoint a claim examined to the back of the rotation, in one
# statement (a NULL name: padding).
ROTATE_ALL = "UPDATE endpoints SET served_at = ? WHERE name IN ({marks})"
# The few with more to write, in one more: out of the rotation when it has
# nothing pending or leased (until its next delivery: an intake, a redrive, a
# recovery puts it back), looked for only where the claim found none
# ({idle}); a rate endpoint that leased, its bucket's level after its leases
# ({tokens}, NULL: untouched); the probe leased ({probe}): its circuit
# half-open, and the deliveries that came due while it was open counted as
# attempts the breaker saved. ?1 is the store's time.
_PROBED = "{probe} AND endpoints.circuit = 'open'"
_ROTATED_SET = f"""served_at = ?1,
  tokens = coalesce({{tokens}}, endpoints.tokens),
  refilled_ms = CASE WHEN {{tokens}} IS NULL THEN endpoints.refilled_ms ELSE ?1 END,
  has_work = CASE WHEN {{idle}} AND NOT EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_endpoint_due
      WHERE jobs.endpoint = endpoints.name AND {DUE_LINE})
    AND NOT EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_in_flight
      WHERE jobs.endpoint = endpoints.name AND {IN_FLIGHT})
    AND NOT EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_endpoint_rest
      WHERE jobs.endpoint = endpoints.name AND {REST_LINE} AND status = 'pending')
    THEN 0 ELSE endpoints.has_work END,
  circuit = CASE WHEN {_PROBED} THEN 'half-open' ELSE endpoints.circuit END,
  circuit_since_ms = CASE WHEN {_PROBED} THEN ?1 ELSE endpoints.circuit_since_ms END,
  saved = CASE WHEN {_PROBED} THEN endpoints.saved + (SELECT COUNT(*)
      FROM jobs INDEXED BY jobs_endpoint_due
      WHERE jobs.endpoint = endpoints.name AND {DUE_LINE} AND jobs.available_at <= ?1)
    ELSE endpoints.saved END"""
# (name, tokens, probe, idle) rows in VALUES (SQLite 3.33's UPDATE ... FROM), a NULL name: padding
ROTATED_EACH = ("UPDATE endpoints SET " + _ROTATED_SET.format(
    tokens="t.column2", probe="t.column3", idle="t.column4")
                + " FROM (VALUES {rows}) AS t WHERE endpoints.name = t.column1")
# the same, one row a step (older SQLite): ?2 tokens, ?3 probe, ?4 idle, ?5 name
ROTATED_ONE = ("UPDATE endpoints SET " + _ROTATED_SET.format(tokens="?2", probe="?3", idle="?4")
               + " WHERE name = ?5")
HAS_WORK = "UPDATE endpoints SET has_work = 1 WHERE name = ? AND has_work = 0"
# The breaker (lease.breaker): an endpoint's circuit, read and written whole.
CIRCUIT_OF = f"""SELECT name, enabled, disable_after_ms, {', '.join(CIRCUIT_COLUMNS)}
FROM endpoints WHERE name IN ({{marks}})"""
WRITE_CIRCUIT = (f"UPDATE endpoints SET {', '.join(f'{c} = ?' for c in CIRCUIT_COLUMNS)}"
                 " WHERE name = ?")
# the circuit closed: the endpoint's waiting deliveries are due at once
RELEASE_WAITING = f"""UPDATE jobs SET available_at = :now
WHERE endpoint = :name AND {DUE_LINE} AND available_at > :now"""
AUTO_DISABLE = "UPDATE endpoints SET enabled = 0, disabled_why = ? WHERE name = ?"
# Recovery: an endpoint's deliveries finished (done or dead) since a time, sent
# again with a fresh budget; a done one's delivering attempt moves to the
# attempts rows first, so its history keeps it.
RECOVERABLE = f"""SELECT seq, id, status, token, ordering_key, attempts, done_by, done_started_ms,
  done_latency_ms, done_http_status, available_at FROM jobs INDEXED BY jobs_endpoint_rest
WHERE endpoint = :name AND {REST_LINE} AND status IN ('done', 'dead') AND available_at >= :since
ORDER BY seq LIMIT :limit"""
RECOVER = ("UPDATE jobs SET status = 'pending', attempts = 0, available_at = ?, deadline = ?,"
    " owner = NULL, lease_until = NULL, reason = NULL, done_by = NULL, done_started_ms = NULL,"
    " done_latency_ms = NULL, done_http_status = NULL, done_after = NULL,"
    " held = CASE WHEN ordering_key IS NOT NULL THEN 1 ELSE 0 END WHERE seq = ?")
SUBSCRIBERS = "SELECT name, types FROM endpoints ORDER BY name"
MESSAGE_CONTENT = ("SELECT qty, digest, ordering_key, event_type, endpoint FROM jobs"
                   " INDEXED BY jobs_by_message WHERE message = ? LIMIT 1")
INSERT_DELIVERY = ("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
    " available_at, deadline, owner, lease_until, reason, digest, ordering_key, held,"
    " endpoint, message, event_type, trace, priority)"
    " VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?, ?, ?, ?, ?)")
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
# An endpoint's deliveries still to be sent: its pending (due, or held behind
# a line) and its leased, each from the index that holds them.
LIVE_DELIVERIES = f"""SELECT id, status FROM (
  SELECT seq, id, status FROM jobs INDEXED BY jobs_endpoint_due WHERE endpoint = ?1 AND {DUE_LINE}
  UNION ALL SELECT seq, id, status FROM jobs INDEXED BY jobs_in_flight
    WHERE endpoint = ?1 AND {IN_FLIGHT}
  UNION ALL SELECT seq, id, status FROM jobs INDEXED BY jobs_endpoint_rest
    WHERE endpoint = ?1 AND {REST_LINE} AND status = 'pending')
ORDER BY seq"""


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
    " deadline, owner, lease_until, reason, digest, ordering_key, held, event_type, trace,"
    " priority) VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?, ?, ?)")
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
