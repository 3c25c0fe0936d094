"""Shared by several test modules."""

from __future__ import annotations

from lease.worker import Conflict


class Model:
    """The contract, restated plainly."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.audits: list[dict] = []
        self.seq = 0

    def enqueue(self, job_id: str, qty: int, now: int, ttl: int, max_attempts: int) -> bool:
        if job_id in self.jobs:
            if self.jobs[job_id]["qty"] != qty:
                raise Conflict(job_id)
            return False
        self.seq += 1
        self.jobs[job_id] = {
            "seq": self.seq, "id": job_id, "qty": qty, "status": "pending", "attempts": 0,
            "max_attempts": max_attempts, "token": 0, "available_at": now,
            "deadline": now + ttl, "owner": None, "lease_until": None, "reason": None}
        return True

    def _claimable(self, job: dict, now: int) -> bool:
        return job["status"] == "pending" or (
            job["status"] == "leased" and job["lease_until"] <= now)

    def claim_order(self, job: dict) -> tuple[int, int]:
        """The order a claim takes ready jobs in: the contract's, by seq."""
        return (0, job["seq"])

    def claim(self, owner: str, now: int, lease: int) -> dict | None:
        for job in self.jobs.values():
            if self._claimable(job, now):
                if job["deadline"] <= now:
                    job.update(status="dead", reason="deadline", owner=None, lease_until=None)
                elif job["attempts"] >= job["max_attempts"]:
                    job.update(status="dead", reason="exhausted", owner=None, lease_until=None)
        for job in sorted(self.jobs.values(), key=self.claim_order):
            ready = (job["status"] == "pending" and job["available_at"] <= now) or (
                job["status"] == "leased" and job["lease_until"] <= now)
            if ready:
                job["attempts"] += 1
                job["token"] += 1
                job.update(status="leased", owner=owner,
                           lease_until=min(now + lease, job["deadline"]), reason=None)
                return {"id": job["id"], "qty": job["qty"], "owner": owner,
                        "token": job["token"], "attempt": job["attempts"],
                        "lease_until": job["lease_until"]}
        return None

    def _live(self, ticket: dict, now: int) -> dict | None:
        job = self.jobs.get(ticket["id"])
        if job is None or job["status"] != "leased":
            return None
        marker = (job["qty"], job["owner"], job["token"], job["attempts"], job["lease_until"])
        if marker != (ticket["qty"], ticket["owner"], ticket["token"], ticket["attempt"],
                      ticket["lease_until"]):
            return None
        if now >= job["lease_until"] or now >= job["deadline"]:
            return None
        return job

    def finish(self, ticket: dict, outcome: str, now: int, delay: int) -> object:
        job = self._live(ticket, now)
        if job is None:
            return False
        available_at = now
        if outcome == "ok":
            status, reason = "done", None
        elif outcome == "permanent":
            status, reason = "dead", "permanent"
        elif job["attempts"] >= job["max_attempts"]:
            status, reason = "dead", "exhausted"
        elif now + delay >= job["deadline"]:
            status, reason = "dead", "deadline"
        else:
            status, reason, available_at = "pending", "retry", now + delay
        job.update(status=status, reason=reason, available_at=available_at, owner=None,
                   lease_until=None)
        return status

    def extend(self, ticket: dict, now: int, lease: int) -> object:
        job = self._live(ticket, now)
        if job is None:
            return False
        job["lease_until"] = max(job["lease_until"], min(now + lease, job["deadline"]))
        return {**ticket, "lease_until": job["lease_until"]}

    def redrive(self, job_id: str, now: int, ttl: int, note: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job["status"] != "dead":
            raise ValueError(job_id)
        self.audits.append({"seq": len(self.audits) + 1, "id": job_id, "token": job["token"],
                            "at_ms": now, "note": note})
        job.update(status="pending", attempts=0, available_at=now, deadline=now + ttl,
                   owner=None, lease_until=None, reason=None)
        return True

