"""The PostgreSQL driver's SQL, each statement once and named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lease.rules import CIRCUIT_COLUMNS

_CIRCUIT = ", ".join(CIRCUIT_COLUMNS)

# A job in its key's line (as SQLite's driver states it), and the classid of the keys'
# advisory locks ("ke"; the two-int form, a key space apart from the one-int
# form of the migrations' lock).
LINE = ("{a}.ordering_key IS NOT NULL AND ({a}.status IN ('pending', 'leased')"
         " OR ({a}.status = 'dead' AND {a}.reason <> 'cancelled'))")
KEY_LOCK = 0x6B65


# ------------------------------------------------------------------ statements

# The quarantine of lease.worker.QUARANTINE: the same three moves in the same
# order (a missed deadline is the reason even when the budget is spent too),
# each on rows picked with SKIP LOCKED: a claimer never waits for another.
QUARANTINE = (
    ("deadline", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status IN ('pending', 'leased') AND deadline <= %(now)s
    AND (status = 'pending' OR lease_until <= %(now)s)
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'deadline', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
    ("exhausted", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status = 'leased' AND lease_until <= %(now)s AND attempts >= max_attempts
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'exhausted', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
    ("exhausted", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status = 'pending' AND attempts >= max_attempts
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'exhausted', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
)

# The claim's record of itself (lease.rules, "the dispatchers at work"),
# written by the statement that leases, so that it costs a claim no round
# trip of its own: ``{claimed}``, what the claim leased. A claim that leased
# nothing writes only when the row's last claim is a beat old.
WORKER_ROW = """INSERT INTO lease.workers (owner, last_claim_ms, last_claimed)
SELECT %(owner)s, %(now)s, {claimed}
ON CONFLICT (owner) DO UPDATE SET last_claim_ms = excluded.last_claim_ms,
  last_claimed = excluded.last_claimed
WHERE excluded.last_claimed > 0 OR lease.workers.last_claim_ms IS NULL
  OR lease.workers.last_claim_ms <= excluded.last_claim_ms - %(beat)s"""

# lease.worker.PICK, locked in a CTE: the planner cannot update more rows
# than the limit; a new lease as lease.worker.lease_ticket makes it. On SQLite
# the quarantine and the pick run under one write lock, so no row at its
# budget or past its deadline is left for the pick. Here the quarantine skips
# a row another transaction holds (a stale finish, an extension), and that
# one may commit before the pick, a statement with a snapshot of its own: the
# pick says the rule itself, and such a row waits for the next claim's
# quarantine instead of a lease as attempt max + 1 or one ending at once.
# The same statement records the claim on its owner's row (WORKER_ROW).
# The due jobs and the leases run out are read apart, each by its own index
# (jobs_own_due, jobs_leased_until), each locked as it is read: one index of
# both put every live lease (the oldest seqs) before the first due job, and
# each claim read them all, a heap fetch each, to pass over them. The batch
# is the first of both in the claim's order (each part holds at least its
# share of it); a row locked and not taken (a run-out lease behind a batch
# of due jobs) is another claim's at this one's commit.
PICK_AND_LEASE = f"""WITH due AS (SELECT seq, priority FROM lease.jobs
  WHERE status = 'pending' AND held = 0 AND endpoint IS NULL AND available_at <= %(now)s
    AND attempts < max_attempts AND deadline > %(now)s
  ORDER BY priority DESC, seq LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED),
run_out AS (SELECT seq, priority FROM lease.jobs
  WHERE status = 'leased' AND lease_until <= %(now)s AND held = 0 AND endpoint IS NULL
    AND attempts < max_attempts AND deadline > %(now)s
  ORDER BY priority DESC, seq LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED),
picked AS MATERIALIZED (SELECT seq FROM (SELECT * FROM due UNION ALL SELECT * FROM run_out)
  AS ready ORDER BY priority DESC, seq LIMIT %(limit)s),
leased AS (UPDATE lease.jobs j SET status = 'leased', attempts = j.attempts + 1,
  token = j.token + 1, owner = %(owner)s,
  lease_until = LEAST(%(now)s + %(lease_ms)s, j.deadline), reason = NULL
FROM picked WHERE j.seq = picked.seq
RETURNING j.seq, j.id, j.qty, j.token, j.attempts, j.lease_until, j.body, j.digest, j.trace,
  j.priority),
worker AS ({WORKER_ROW.format(claimed="(SELECT count(*) FROM leased)")})
SELECT * FROM leased"""

# The keys' locks, in one order (by their hash, so two writers of the same
# keys never deadlock), before any row is locked: of an intake's keys, and of
# the keys of the jobs an operator's change or a finish names.
LOCK_KEYS = f"""SELECT count(pg_advisory_xact_lock({KEY_LOCK}, h)) FROM
  (SELECT DISTINCT hashtext(k) AS h FROM unnest(%s::text[]) AS k ORDER BY h) s"""
LOCK_KEYS_OF = f"""SELECT count(pg_advisory_xact_lock({KEY_LOCK}, h)) FROM
  (SELECT DISTINCT hashtext(ordering_key) AS h FROM lease.jobs
   WHERE id = ANY(%s::text[]) AND ordering_key IS NOT NULL ORDER BY h) s"""

# The SQLite driver's PROMOTE for many keys: each line with no marked job gets its first.
PROMOTE = f"""UPDATE lease.jobs j SET held = 0
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (SELECT f.seq FROM lease.jobs f WHERE f.ordering_key = k.key
  AND f.held = 1 AND {LINE.format(a='f')} ORDER BY f.seq LIMIT 1) f
WHERE j.seq = f.seq AND NOT EXISTS (SELECT 1 FROM lease.jobs c
  WHERE c.ordering_key = k.key AND c.held = 0 AND {LINE.format(a='c')})"""

# The SQLite driver's DEMOTE for many keys (the marked jobs are locked by then).
DEMOTE = f"""UPDATE lease.jobs j SET held = 1
FROM unnest(%(keys)s::text[]) AS k(key)
WHERE j.ordering_key = k.key AND j.held = 0 AND {LINE.format(a='j')} AND j.status <> 'leased'
  AND EXISTS (SELECT 1 FROM lease.jobs f WHERE f.ordering_key = k.key AND f.held = 1
    AND {LINE.format(a='f')} AND f.seq < j.seq)"""

# The marked job of each key's line, locked: a claim leasing it commits first.
FIRSTS = f"""SELECT ordering_key, seq, id, status FROM lease.jobs j
WHERE j.ordering_key = ANY(%s::text[]) AND j.held = 0 AND {LINE.format(a='j')}
ORDER BY seq FOR UPDATE"""

# The fence: each UPDATE below changes a row only if it is still leased by this
# very ticket, now; its row count says whether it did.
_STILL_LEASED = """j.status = 'leased' AND j.qty = u.qty AND j.owner = u.owner
  AND j.token = u.token AND j.attempts = u.attempt AND j.lease_until = u.lease_until
  AND j.lease_until > %(now)s AND j.deadline > %(now)s"""

EXTEND_IF_STILL_LEASED = f"""UPDATE lease.jobs j SET lease_until = %(new_until)s
FROM (VALUES (%(seq)s::bigint, %(qty)s::bigint, %(owner)s::text, %(token)s::bigint,
  %(attempt)s::bigint, %(lease_until)s::bigint))
  AS u(seq, qty, owner, token, attempt, lease_until)
WHERE j.seq = u.seq AND {_STILL_LEASED}"""

# A finish's rows are found by seq, one primary-key look-up each: the fence is
# judged in a look-up the planner cannot flatten (LIMIT 1), so no plan can
# drive the UPDATE from the leased rows' partial index instead. Such a plan,
# chosen by statistics that saw few leases, compared every live lease with
# every item (a finish of 64 beside 400 leases took 9 ms). The rows are locked
# by the finish already (its FOR UPDATE by id); the marker is checked again
# on the row the UPDATE writes.
# A done job's delivering attempt is written on its row by the same UPDATE
# (one new row version, not two: on PostgreSQL every UPDATE of a job writes
# an entry in each of its indexes). Its done_after is the newest attempts row
# before this finish wrote any: every earlier attempt of the job is older (its
# row is locked), every later one newer; an attempts row of the same job
# earlier in the same finish moves it on (RECORD_DONE).
FINISH_IF_STILL_LEASED = f"""WITH fenced AS MATERIALIZED (SELECT u.* FROM unnest(%(seq)s::bigint[],
  %(status)s::text[], %(reason)s::text[], %(available_at)s::bigint[], %(qty)s::bigint[],
  %(owner)s::text[], %(token)s::bigint[], %(attempt)s::bigint[], %(lease_until)s::bigint[],
  %(started_ms)s::bigint[], %(latency_ms)s::bigint[], %(http_status)s::bigint[])
  AS u(seq, status, reason, available_at, qty, owner, token, attempt, lease_until,
       started_ms, latency_ms, http_status)
  CROSS JOIN LATERAL (SELECT * FROM lease.jobs j WHERE j.seq = u.seq LIMIT 1) j
  WHERE {_STILL_LEASED}),
newest AS (SELECT COALESCE(max(seq), 0) AS seq FROM lease.attempts)
UPDATE lease.jobs j SET status = u.status, reason = u.reason,
  available_at = u.available_at, owner = NULL, lease_until = NULL,
  done_by = CASE WHEN u.status = 'done' THEN u.owner ELSE j.done_by END,
  done_started_ms = CASE WHEN u.status = 'done' THEN u.started_ms ELSE j.done_started_ms END,
  done_latency_ms = CASE WHEN u.status = 'done' THEN u.latency_ms ELSE j.done_latency_ms END,
  done_http_status = CASE WHEN u.status = 'done' THEN u.http_status
    ELSE j.done_http_status END,
  done_after = CASE WHEN u.status = 'done' THEN newest.seq ELSE j.done_after END
FROM fenced u, newest
WHERE j.seq = u.seq AND j.owner = u.owner AND j.token = u.token AND j.attempts = u.attempt
  AND j.lease_until = u.lease_until
RETURNING j.seq"""

# A done job's done_after, moved on to the attempts row written just before its
# delivering attempt in the same finish (an attempt of the same job, rare).
RECORD_DONE = """UPDATE lease.jobs j SET done_after = u.after
FROM unnest(%s::bigint[], %s::bigint[]) AS u(seq, after)
WHERE j.seq = u.seq"""

RECORD_ATTEMPTS = """INSERT INTO lease.attempts (id, token, attempt, owner, started_ms,
  ended_ms, outcome, result, reason, http_status, error, latency_ms)
SELECT id, token, attempt, owner, started_ms, ended_ms, outcome, result, reason, http_status,
  error, latency_ms
FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::bigint[], %s::bigint[],
  %s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::bigint[])
  WITH ORDINALITY AS u(id, token, attempt, owner, started_ms, ended_ms, outcome, result,
  reason, http_status, error, latency_ms, ord)
ORDER BY ord
RETURNING seq"""

TALLY = """INSERT INTO lease.tallies (name, n) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET n = lease.tallies.n + excluded.n"""

# Identity values follow the SELECT's order: seq is the order of intake.
# Every job of one intake keeps the same trace context (lease.tracing).
INSERT_NEW = """INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,
  available_at, deadline, owner, lease_until, reason, body, digest, ordering_key, held,
  endpoint, message, event_type, trace, priority)
SELECT id, qty, 'pending', 0, %s, 0, %s, %s, NULL, NULL, NULL, body, digest, key,
  CASE WHEN key IS NULL THEN 0 ELSE 1 END, endpoint, message, event_type, %s::text, priority
FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[],
  %s::text[], %s::text[], %s::smallint[]) WITH ORDINALITY
  AS u(id, qty, body, digest, key, endpoint, message, event_type, priority, ord)
ORDER BY ord
ON CONFLICT (id) DO NOTHING
RETURNING id"""

AUDIT_REDRIVES = """INSERT INTO lease.redrives (id, token, at_ms, note, actor)
SELECT id, token, %s, %s, %s::text FROM unnest(%s::text[], %s::bigint[])
  WITH ORDINALITY AS u(id, token, ord)
ORDER BY ord"""

RELEASE = """UPDATE lease.jobs SET status = 'pending', attempts = 0, available_at = %s,
  deadline = %s, owner = NULL, lease_until = NULL, reason = NULL,
  held = CASE WHEN ordering_key IS NOT NULL AND reason = 'cancelled' THEN 1 ELSE held END
WHERE seq = ANY(%s::bigint[]) AND status = 'dead'"""

AUDIT_CANCELS = """INSERT INTO lease.cancels (id, token, at_ms, note, was, actor)
SELECT id, token, %s, %s, was, %s::text FROM unnest(%s::text[], %s::bigint[], %s::text[])
  WITH ORDINALITY AS u(id, token, was, ord)
ORDER BY ord"""

CANCEL = """UPDATE lease.jobs SET status = 'dead', reason = 'cancelled', available_at = %s,
  owner = NULL, lease_until = NULL WHERE seq = ANY(%s::bigint[])"""

# Done jobs by finish time (seq breaks ties, as SQLite's index does by rowid);
# a row another writer holds is left for the next call.
PRUNABLE = """SELECT seq, id FROM lease.jobs WHERE status = 'done' AND available_at < %s
ORDER BY available_at, seq LIMIT %s FOR UPDATE SKIP LOCKED"""

# A key filter: a job's own key, or a delivery's line of that key.
KEY_OR_LINES = """(ordering_key = %(key)s::text
  OR (endpoint IS NOT NULL AND ordering_key = %(key)s::text || ' ' || endpoint))"""

DEAD = """SELECT d.*, (SELECT COALESCE(a.error, 'HTTP ' || a.http_status)
  FROM lease.attempts a WHERE a.id = d.id ORDER BY a.seq DESC LIMIT 1) AS last_error
FROM (SELECT * FROM lease.jobs WHERE status = 'dead'
  AND (%(reason)s::text IS NULL OR reason = %(reason)s::text)
  AND (%(endpoint)s::text IS NULL OR {endpoint})
  AND (%(key)s::text IS NULL OR {key})
  ORDER BY seq LIMIT %(limit)s::bigint) d
ORDER BY d.seq"""

LIST_JOBS = """SELECT d.*, CASE WHEN d.status = 'dead' THEN
  (SELECT COALESCE(a.error, 'HTTP ' || a.http_status) FROM lease.attempts a WHERE a.id = d.id
   ORDER BY a.seq DESC LIMIT 1) END AS last_error
FROM (SELECT * FROM lease.jobs WHERE {where} ORDER BY seq LIMIT %s) d ORDER BY d.seq"""

HISTORY_ATTEMPTS = """SELECT token, attempt, owner, started_ms, ended_ms, outcome, result,
  reason, http_status, error, latency_ms FROM (
  SELECT seq AS at, 0 AS tie, token, attempt, owner, started_ms, ended_ms, outcome, result,
    reason, http_status, error, latency_ms FROM lease.attempts WHERE id = %(id)s
  UNION ALL
  SELECT done_after, 1, token, attempts, done_by, done_started_ms, available_at, 'ok',
    'done', NULL, done_http_status, NULL, done_latency_ms FROM lease.jobs
  WHERE id = %(id)s AND status = 'done' AND done_by IS NOT NULL) merged
ORDER BY at, tie"""
# (the delivering attempt, kept on a done job's row, after the attempts row it
# followed: the order of writing, as the SQLite driver reads a file)

# What a finish reads of a row: the marker and the budget, never a payload.
MARKED = "seq, id, qty, status, attempts, max_attempts, token, deadline, owner, lease_until"

# Idle: no job a claim may take now or later without an operator.
IDLE = ("SELECT NOT EXISTS (SELECT 1 FROM lease.jobs WHERE status IN ('pending', 'leased')"
        " AND held = 0)")

# A key is blocked when the first of its line is dead (not cancelled): the jobs
# behind it wait until it is redriven or cancelled.
_DEAD_FIRST = ("h.ordering_key IS NOT NULL AND h.held = 0 AND h.status = 'dead'"
               " AND h.reason <> 'cancelled'")
BLOCKED_KEYS = f"SELECT count(*) FROM lease.jobs h WHERE {_DEAD_FIRST}"
BLOCKED_JOBS = f"""SELECT count(*) FROM lease.jobs h
JOIN lease.jobs w ON w.ordering_key = h.ordering_key AND w.held = 1 AND w.status = 'pending'
  AND w.ordering_key IS NOT NULL AND (w.status IN ('pending', 'leased')
    OR (w.status = 'dead' AND w.reason <> 'cancelled'))
WHERE {_DEAD_FIRST}"""
BLOCKED_HEADS = f"""SELECT h.ordering_key AS key{{endpoint}}, h.id, h.reason,
  (SELECT count(*) FROM lease.jobs w
  WHERE w.ordering_key = h.ordering_key AND w.held = 1 AND w.status = 'pending') AS waiting
FROM lease.jobs h WHERE {_DEAD_FIRST} ORDER BY h.ordering_key LIMIT %(limit)s"""
# (a delivery's key is its line: the head's endpoint tells them apart)

# list_jobs's conditions, by the name lease.rules.list_filters gives each
# The last attempt's: its error, and its HTTP status (a done job's delivering
# attempt is on its own row: done_http_status, kept first).
_LAST_ATTEMPT = ("(SELECT a.{column} FROM lease.attempts a WHERE a.id = jobs.id"
                 " ORDER BY a.seq DESC LIMIT 1)")
_LAST_STATUS = f"COALESCE(done_http_status, {_LAST_ATTEMPT.format(column='http_status')})"
FILTERS = {"status": "status = %s", "reason": "reason = %s",
           "id_prefix": "substr(id, 1, %s) = %s", "after_seq": "seq > %s",
           "key": "ordering_key = %s", "endpoint": "endpoint = %s",
           "error": f"strpos({_LAST_ATTEMPT.format(column='error')}, %s) > 0",
           "http_status": f"{_LAST_STATUS} BETWEEN %s AND %s",
           "from": "available_at >= %s", "to": "available_at < %s"}


# ------------------------------------------------------------------ endpoints

# What an intake reads of the endpoints: who subscribes to what, each row
# locked FOR KEY SHARE (in name order) for the intake's transaction. That lock
# conflicts with no claim (FOR NO KEY UPDATE), no finish and no other intake:
# only with FOR UPDATE, which a removal takes (its deliveries are never
# written to an endpoint removed meanwhile) and a claim clearing an
# endpoint's has_work takes (with SKIP LOCKED: it leaves an endpoint an
# intake may be writing to in the rotation). Taken before any key's lock.
ENDPOINTS_FOR_INTAKE = """SELECT name, types FROM lease.endpoints
ORDER BY name FOR KEY SHARE"""

# An intake looks its ids up by key (CONTENTS, MESSAGES), whatever the
# table's statistics say. They may be of an emptier table: no row an intake
# writes is known to them until the next ANALYZE, and each chunk's lookups
# follow the chunks it inserted before. A prepared statement's generic plan
# does not know the array's length either, and keeps the plan it was made
# with. A plan that scans the table and compares each row with every id of
# the lookup costs rows x ids: a fan-out of 1,000 messages to 50 endpoints
# on a new queue took 10 s where 1 s does. So a lookup of more than
# BY_KEY_FROM ids is planned for its own array (not prepared), and the first
# one turns sequential scans off for the rest of the intake, which puts the
# setting back at its end (enqueue_in runs inside the service's transaction).
BY_KEY_FROM = 64
BY_KEY_ONLY = ("SELECT current_setting('enable_seqscan'),"
               " set_config('enable_seqscan', 'off', true)")
SEQSCAN_AGAIN = "SELECT set_config('enable_seqscan', %s, true)"

# A message's kept deliveries, the first one first: the content an intake of
# the same id is compared with.
MESSAGES = """SELECT DISTINCT ON (message) message, qty, digest, ordering_key, endpoint, event_type
FROM lease.jobs WHERE message = ANY(%s::text[]) ORDER BY message, seq"""

# The jobs of these ids, by id: an own job's content, or a delivery id taken.
CONTENTS = """SELECT id, qty, digest, ordering_key, event_type, endpoint
FROM lease.jobs WHERE id = ANY(%s::text[])"""

# The endpoints that got deliveries (an intake's, a redrive's, a recovery's)
# join the rotation: only the rows at 0 are written (and so locked), in name
# order; an endpoint in the rotation already is not touched.
HAS_WORK = """UPDATE lease.endpoints e SET has_work = 1
FROM (SELECT name FROM lease.endpoints WHERE name = ANY(%s::text[]) AND has_work = 0
  ORDER BY name FOR NO KEY UPDATE) u
WHERE e.name = u.name AND e.has_work = 0"""
# The endpoints of these jobs (a redrive's), read before any lock.
ENDPOINTS_OF_IDS = """SELECT DISTINCT endpoint FROM lease.jobs
WHERE id = ANY(%s::text[]) AND endpoint IS NOT NULL ORDER BY endpoint"""
LOCK_KEY_SHARE = """SELECT name FROM lease.endpoints WHERE name = ANY(%s::text[])
ORDER BY name FOR KEY SHARE"""

# ------------------------------------------------------------------ the claim
# A claim of deliveries takes the endpoints with work from the rotation (the
# least recently served first, passing over the disabled, the paused and the
# cooling-open ones in the scan of endpoints_rotation), each row locked FOR
# NO KEY UPDATE SKIP LOCKED: claims at once on many hosts serve disjoint
# endpoints, none waits for another, and each endpoint's cap, bucket and
# breaker are judged under its row's lock. Then per endpoint one index range
# of its live leases, when its allowance counts them (a cap, a probe), in a
# statement after the lock (one begun before it could miss the leases of a
# claim that committed in between), and one of its due deliveries, read and
# leased in one statement: a backlog an endpoint may not send now is never
# read. The readiness the pick states (a row the
# quarantine skipped, held by another transaction, may be at its budget or
# past its deadline) is checked on each row read, and again on a row's
# newest version when it changed before the lock.
DUE_LINE = "endpoint IS NOT NULL AND status = 'pending' AND held = 0"
_READY_NOW = "attempts < max_attempts AND deadline > %(now)s"
# The claim reads each endpoint's due deliveries in order, a few from the
# start of its index range. When the statistics give an endpoint a few due
# rows, the planner would rather fetch them all by bitmap and sort them: 64
# endpoints of 10 due rows each, 640 rows read for 64 (0.5 ms against 0.13
# in index order). No read of a claim of deliveries needs a bitmap: they are
# off for its transaction. Its statements run on their generic plans too:
# PostgreSQL kept planning TAKE_DUE anew at each run (its generic plan's
# estimate, with the endpoints and their shares unknown, looked dearer than
# the plans made for the values), 1.1 ms of a 64-delivery claim's 7.6 ms;
# the generic plan reads each endpoint's index ranges just the same.
ORDERED_READS = ("SELECT set_config('enable_bitmapscan', 'off', true),"
                 " set_config('plan_cache_mode', 'force_generic_plan', true)")
_ROTATION_COLUMNS = ("name, served_at, enabled, max_in_flight, rate, burst, tokens,"
                     f" refilled_ms, {_CIRCUIT}")
# A batch of the rotation, locked, and sent to its back in the same statement
# (each row rewritten by its ctid, which the lock holds still): the rows as
# they were, their old places in the rotation among them. A later batch of
# the same claim passes over the endpoints it has seen.
ROTATION = f"""WITH batch AS (SELECT ctid AS at, {_ROTATION_COLUMNS} FROM lease.endpoints
  WHERE has_work = 1 AND enabled AND (%(all)s OR name = ANY(%(names)s::text[]))
    AND (paused_until_ms IS NULL OR paused_until_ms <= %(now)s)
    AND (circuit <> 'open' OR open_until_ms <= %(now)s)
    AND (served_at, name) > (%(served)s, %(name)s) AND name <> ALL(%(seen)s::text[])
  ORDER BY served_at, name LIMIT %(limit)s
  FOR NO KEY UPDATE SKIP LOCKED)
UPDATE lease.endpoints e SET served_at = %(now)s FROM batch
WHERE e.ctid = batch.at
RETURNING {", ".join(f"batch.{c.strip()}" for c in _ROTATION_COLUMNS.split(","))}"""
# The live leases of the endpoints whose allowance counts them (jobs_in_flight's
# range of each, from its lease end now).
LIVE_OF = """SELECT endpoint, count(*) FROM lease.jobs
WHERE status = 'leased' AND endpoint = ANY(%(names)s::text[]) AND endpoint IS NOT NULL
  AND lease_until > %(now)s
GROUP BY endpoint"""
# An endpoint with nothing pending or leased leaves the rotation (until its
# next delivery: an intake, a redrive, a recovery puts it back). The claim
# holds the endpoint's row FOR NO KEY UPDATE already; it clears has_work only
# under FOR UPDATE, taken SKIP LOCKED, in a statement of its own:
# - an intake writing to the endpoint holds its row FOR KEY SHARE from its
#   start to its commit, which FOR UPDATE conflicts with: the row is skipped,
#   has_work stays 1, and that intake's deliveries are found by a later claim;
# - an intake that comes for the row after the claim took it FOR UPDATE waits
#   for the claim's commit, then (READ COMMITTED: a new snapshot for each
#   statement) its HAS_WORK sees has_work = 0 and writes 1;
# - an intake that committed before: NO_WORK, a statement begun after the
#   lock, sees its deliveries (its own snapshot), and leaves has_work alone.
# A redrive takes the same FOR KEY SHARE on its deliveries' endpoints first;
# a recovery holds its endpoint's row locked. So no delivery is written to an
# endpoint out of the rotation.
IDLE_ENDPOINTS = """SELECT name FROM unnest(%s::text[]) AS u(name)
WHERE NOT EXISTS (SELECT 1 FROM lease.jobs WHERE endpoint = u.name
  AND status IN ('pending', 'leased'))"""
LOCK_TO_CLEAR = """SELECT name FROM lease.endpoints WHERE name = ANY(%s::text[])
ORDER BY name FOR UPDATE SKIP LOCKED"""
NO_WORK = """UPDATE lease.endpoints e SET has_work = 0 WHERE e.name = ANY(%s::text[])
  AND NOT EXISTS (SELECT 1 FROM lease.jobs WHERE endpoint = e.name
    AND status IN ('pending', 'leased'))"""

# The breaker (lease.breaker): a probe leased makes the circuit half-open, the
# deliveries that came due while it was open counted as attempts it saved.
HALF_OPEN = f"""UPDATE lease.endpoints SET circuit = 'half-open', circuit_since_ms = %(now)s,
  saved = saved + (SELECT count(*) FROM lease.jobs
    WHERE endpoint = %(name)s AND {DUE_LINE} AND available_at <= %(now)s)
WHERE name = %(name)s AND circuit = 'open'"""
# An endpoint's circuit, as a finish judges it: read unlocked first, beside
# its deliveries (DELIVERIES_OF: a healthy endpoint's successes write nothing,
# and lock nothing), then locked in name order before the finish's keys and
# rows when its signals change it. Both read the columns of CIRCUIT_ROW.
CIRCUIT_ROW = ("name", "enabled", "disable_after_ms", *CIRCUIT_COLUMNS)
LOCK_CIRCUITS = f"""SELECT {', '.join(CIRCUIT_ROW)} FROM lease.endpoints
WHERE name = ANY(%s::text[]) ORDER BY name FOR NO KEY UPDATE"""
# a finish's deliveries, with their markers and their endpoints' breakers (a
# NULL name: the endpoint is gone): a finish that is stale already (its job no
# longer leased by its ticket) moves no breaker, and locks nothing
DELIVERIES_OF = f"""SELECT j.id, j.endpoint, j.status, j.token, j.owner,
  {', '.join('e.' + column for column in CIRCUIT_ROW)}
FROM lease.jobs j LEFT JOIN lease.endpoints e ON e.name = j.endpoint
WHERE j.id = ANY(%s::text[]) AND j.endpoint IS NOT NULL"""
WRITE_CIRCUIT = f"""UPDATE lease.endpoints SET
  {', '.join(f'{column} = %({column})s' for column in CIRCUIT_COLUMNS)}
WHERE name = %(name)s"""
# the circuit closed: the endpoint's waiting deliveries are due at once
RELEASE_WAITING = f"""UPDATE lease.jobs SET available_at = %(now)s
WHERE endpoint = %(name)s AND {DUE_LINE} AND available_at > %(now)s"""
AUTO_DISABLE = """UPDATE lease.endpoints SET enabled = false, disabled_why = %s
WHERE name = %s"""

# What one dispatcher serves is idle when nothing it may claim is left, now or
# later without an operator: its own jobs, or the deliveries of the enabled
# endpoints it serves.
IDLE_OWN = """SELECT NOT EXISTS (SELECT 1 FROM lease.jobs
    WHERE endpoint IS NULL AND status = 'pending' AND held = 0)
  AND NOT EXISTS (SELECT 1 FROM lease.jobs
    WHERE endpoint IS NULL AND status = 'leased' AND held = 0)"""
IDLE_SERVED = """SELECT NOT EXISTS (SELECT 1 FROM lease.endpoints e
  WHERE e.enabled AND (%(all)s OR e.name = ANY(%(names)s::text[]))
    AND EXISTS (SELECT 1 FROM lease.jobs j WHERE j.endpoint = e.name
      AND j.status IN ('pending', 'leased') AND j.held = 0))"""

# Recovery: an endpoint's deliveries finished (done or dead) since a time,
# locked in seq order, sent again with a fresh budget; a done one's
# delivering attempt goes to the attempts rows first, so its history keeps it.
RECOVERABLE = """SELECT seq, id, status, token, ordering_key, attempts, done_by,
  done_started_ms, done_latency_ms, done_http_status, available_at FROM lease.jobs
WHERE endpoint = %(name)s AND status IN ('done', 'dead') AND available_at >= %(since)s
ORDER BY seq LIMIT %(limit)s FOR UPDATE"""
RECOVER = """UPDATE lease.jobs SET status = 'pending', attempts = 0, available_at = %s,
  deadline = %s, owner = NULL, lease_until = NULL, reason = NULL, done_by = NULL,
  done_started_ms = NULL, done_latency_ms = NULL, done_http_status = NULL, done_after = NULL,
  held = CASE WHEN ordering_key IS NOT NULL THEN 1 ELSE 0 END
WHERE seq = ANY(%s::bigint[])"""

# The deliveries a round of a claim takes, leased in the statement that
# picks them (lease_ticket's lease), as the plain queue's PICK_AND_LEASE:
# each endpoint's ``lim`` first ones: its leases run out (still ready) by
# lease end, then its due deliveries, the higher priority first, then in the
# order they became due (jobs_in_flight's and jobs_endpoint_due's orders: one
# index scan each, stopped at ``lim``, which passes over the rows of a higher
# priority not due yet; a leased row is never held: DEMOTE passes over the
# leased ones). Each part locks its rows as its scan reads them,
# SKIP LOCKED: a row another transaction holds (a stale finish, an
# operator's change, another claim) is passed over, and one changed since the
# scan's snapshot is checked again by the part's conditions on its newest
# version (READ COMMITTED). A row locked and not taken (the endpoint's two
# parts held more than ``lim``) goes back to the other claims at this one's
# commit. The round records the claim on its owner's row (WORKER_ROW:
# ``before``, what the claim's earlier rounds leased).
TAKE_DUE = f"""WITH picked AS MATERIALIZED (SELECT d.seq
FROM unnest(%(names)s::text[], %(lims)s::bigint[]) AS u(name, lim)
CROSS JOIN LATERAL (SELECT x.seq FROM (
  SELECT * FROM (SELECT seq, 0 AS part, lease_until AS until, 0 AS priority,
      0::bigint AS available_at
    FROM lease.jobs WHERE endpoint = u.name AND status = 'leased'
      AND endpoint IS NOT NULL AND lease_until <= %(now)s AND {_READY_NOW}
    ORDER BY lease_until, seq LIMIT u.lim FOR UPDATE SKIP LOCKED) run_out
  UNION ALL
  SELECT * FROM (SELECT seq, 1, 0, priority, available_at FROM lease.jobs
    WHERE endpoint = u.name AND {DUE_LINE} AND available_at <= %(now)s AND {_READY_NOW}
    ORDER BY priority DESC, available_at, seq LIMIT u.lim FOR UPDATE SKIP LOCKED) due) x
  ORDER BY x.part, x.until, x.priority DESC, x.available_at, x.seq LIMIT u.lim) d),
leased AS (UPDATE lease.jobs j SET status = 'leased', attempts = j.attempts + 1,
  token = j.token + 1, owner = %(owner)s,
  lease_until = LEAST(%(now)s + %(lease_ms)s, j.deadline), reason = NULL
FROM picked WHERE j.seq = picked.seq
RETURNING j.seq, j.id, j.qty, j.token, j.attempts, j.lease_until, j.body, j.digest,
  j.endpoint, j.message, j.trace, j.priority),
worker AS ({WORKER_ROW.format(claimed="%(before)s + (SELECT count(*) FROM leased)")})
SELECT * FROM leased"""

SPEND_TOKENS = """UPDATE lease.endpoints e SET tokens = u.tokens, refilled_ms = u.refilled_ms
FROM unnest(%s::text[], %s::float8[], %s::bigint[]) AS u(name, tokens, refilled_ms)
WHERE e.name = u.name"""

ENDPOINT_COLUMNS = ("name, url, ack, ca_file, secrets, headers, types, max_in_flight, rate,"
                    " burst, insecure_http, enabled, disable_after_ms")
# What a read may show: never secrets, never headers (their names are taken
# from the JSON in Python, the values dropped there and then).
PUBLIC_COLUMNS = ("name, url, ack, ca_file, jsonb_array_length(secrets) AS secrets,"
                  " ARRAY(SELECT h->>0 FROM jsonb_array_elements(headers) AS h) AS headers,"
                  " types, max_in_flight, rate, burst, insecure_http, enabled,"
                  " disable_after_ms, disabled_why, created_ms, updated_ms,"
                  f" {_CIRCUIT}, saved")

ADD_ENDPOINT = """INSERT INTO lease.endpoints (name, url, ack, ca_file, secrets, headers, types,
  max_in_flight, rate, burst, insecure_http, enabled, disable_after_ms, tokens, refilled_ms,
  has_work, served_at, created_ms, updated_ms)
VALUES (%(name)s, %(url)s, %(ack)s, %(ca_file)s, %(secrets)s, %(headers)s, %(types)s,
  %(max_in_flight)s, %(rate)s, %(burst)s, %(insecure_http)s, %(enabled)s,
  %(disable_after_ms)s, %(tokens)s, %(now)s, 0, 0, %(now)s, %(now)s)
ON CONFLICT (name) DO NOTHING"""

UPDATE_ENDPOINT = """UPDATE lease.endpoints SET url = %(url)s, ack = %(ack)s,
  ca_file = %(ca_file)s, secrets = %(secrets)s, headers = %(headers)s, types = %(types)s,
  max_in_flight = %(max_in_flight)s, rate = %(rate)s, burst = %(burst)s,
  insecure_http = %(insecure_http)s, enabled = %(enabled)s,
  disable_after_ms = %(disable_after_ms)s, tokens = %(tokens)s, refilled_ms = %(refilled_ms)s,
  disabled_why = CASE WHEN %(enabled)s THEN NULL ELSE disabled_why END, updated_ms = %(now)s
WHERE name = %(name)s"""

AUDIT_ENDPOINT = """INSERT INTO lease.endpoint_audit (endpoint, at_ms, action, fields, note, actor)
VALUES (%s, %s, %s, %s, %s, %s)"""

ENDPOINT_STATS = """SELECT e.name,
  count(j.seq) FILTER (WHERE j.status = 'pending') AS ready,
  count(j.seq) FILTER (WHERE j.status = 'leased') AS in_flight,
  count(j.seq) FILTER (WHERE j.status = 'done') AS done,
  count(j.seq) FILTER (WHERE j.status = 'dead') AS dead,
  max(j.available_at) FILTER (WHERE j.status = 'done') AS last_success_ms
FROM lease.endpoints e LEFT JOIN lease.jobs j ON j.endpoint = e.name
GROUP BY e.name ORDER BY e.name"""

# Each endpoint's dead deliveries, by reason.
ENDPOINT_DEAD = """SELECT endpoint, reason, count(*) FROM lease.jobs
WHERE endpoint IS NOT NULL AND status = 'dead' GROUP BY endpoint, reason
ORDER BY endpoint, reason"""

ENDPOINT_RETRIED = """SELECT j.endpoint, count(*) FROM lease.attempts a
JOIN lease.jobs j ON j.id = a.id
WHERE j.endpoint IS NOT NULL AND a.outcome = 'retry' GROUP BY j.endpoint"""

# Each endpoint's latest attempt with an error or a non-2xx answer.
ENDPOINT_LAST_ERROR = """SELECT DISTINCT ON (j.endpoint) j.endpoint, a.error, a.http_status,
  a.ended_ms
FROM lease.attempts a JOIN lease.jobs j ON j.id = a.id
WHERE j.endpoint IS NOT NULL
  AND (a.error IS NOT NULL OR (a.http_status IS NOT NULL AND a.http_status NOT BETWEEN 200 AND 299))
ORDER BY j.endpoint, a.seq DESC"""

ENDPOINT_AUDIT = """SELECT at_ms, endpoint, action, fields, note, actor FROM lease.endpoint_audit
WHERE %(name)s::text IS NULL OR endpoint = %(name)s::text ORDER BY seq"""


# ------------------------------------------------------------------ parameters


def unnest_columns(rows: list[tuple]) -> list[str | list]:
    """Rows as columns, for a statement over unnest(...), each as an array's
    text (``array_text``)."""
    return [array_text(column) for column in zip(*rows, strict=True)]


def array_text(values: Sequence[Any]) -> str | list:
    """A one-dimensional array as PostgreSQL's text for it, which the
    statement's cast (``%s::bigint[]``, ``%s::text[]``) reads: psycopg's
    dumper of a list tests every text element against a pattern, about
    100 µs for 64 elements, and a finish sends a dozen such columns. Every
    text element is quoted (only ``"`` and ``\\`` are escaped inside quotes),
    None is NULL. A column holding anything else (a bool, a float) goes as
    the list it is, to psycopg's dumper."""
    kinds = set(map(type, values))
    if kinds and kinds <= {int, type(None)}:  # a list's repr: digits, None and ", "
        return "{" + repr(list(values))[1:-1].replace("None", "NULL") + "}"
    if kinds == {str}:
        whole = "".join(values)
        if '"' not in whole and "\\" not in whole:
            return '{"' + '","'.join(values) + '"}'
    if not kinds <= {str, int, type(None)}:
        return list(values)
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
        elif type(value) is int:
            parts.append(str(value))
        else:
            parts.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(parts) + "}"
