-- Chain head, audit log and outbox: the parts every mutation shares.

-- name: ChainHeadLock :one
SELECT audit_seq, audit_hash, outbox_seq FROM chain_head WHERE id = 1 FOR UPDATE;

-- name: ChainHeadGet :one
SELECT audit_seq, audit_hash, outbox_seq FROM chain_head WHERE id = 1;

-- name: ChainHeadSet :exec
UPDATE chain_head SET audit_seq = @audit_seq, audit_hash = @audit_hash, outbox_seq = @outbox_seq
WHERE id = 1;

-- name: AuditInsert :exec
INSERT INTO audit_log (seq, at, actor, token_id, action, object_type, object_id, org_id, team_id,
                       request_id, before_json, after_json, prev_hash, hash)
VALUES (@seq, @at, @actor, @token_id, @action, @object_type, @object_id, @org_id, @team_id,
        @request_id, @before_json, @after_json, @prev_hash, @hash);

-- name: AuditList :many
SELECT * FROM audit_log
WHERE seq > @after_seq
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
  AND (sqlc.narg(object_type)::text IS NULL OR object_type = sqlc.narg(object_type))
  AND (sqlc.narg(object_id)::text IS NULL OR object_id = sqlc.narg(object_id))
  AND (sqlc.narg(action)::text IS NULL OR action = sqlc.narg(action))
  AND (sqlc.narg(start_at)::timestamptz IS NULL OR at >= sqlc.narg(start_at))
  AND (sqlc.narg(end_at)::timestamptz IS NULL OR at < sqlc.narg(end_at))
ORDER BY seq
LIMIT @lim;

-- name: AuditScan :many
SELECT * FROM audit_log WHERE seq > @after_seq ORDER BY seq LIMIT @lim;

-- name: AuditScanTenant :many
-- One tenant's records in (at, seq) order after a keyset cursor (the
-- audit_log_org_time_idx index), each with the hash of the record just
-- before it in the chain, whoever's that is (pred_hash is NULL when that
-- record is missing), for the tenant's view of VerifyAuditChain.
SELECT sqlc.embed(a), p.hash AS pred_hash
FROM audit_log a
LEFT JOIN audit_log p ON p.seq = a.seq - 1
WHERE a.org_id = @org_id
  AND (sqlc.narg(team_id)::text IS NULL OR a.team_id = sqlc.narg(team_id))
  AND (a.at, a.seq) > (@after_at::timestamptz, @after_seq::bigint)
ORDER BY a.at, a.seq
LIMIT @lim;

-- name: AuditCountByOrg :one
SELECT count(*) FROM audit_log WHERE org_id = @org_id;

-- name: AuditCountForObject :one
SELECT count(*) FROM audit_log WHERE object_type = @object_type AND object_id = @object_id;

-- name: OutboxInsert :exec
INSERT INTO outbox (seq, at, kind, org_id, object_type, object_id, payload)
VALUES (@seq, @at, @kind, @org_id, @object_type, @object_id, @payload);

-- name: OutboxListAfter :many
SELECT * FROM outbox WHERE seq > @after_seq ORDER BY seq LIMIT @lim;
