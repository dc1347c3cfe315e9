-- name: AlertInsert :batchone
-- Budget alerts (SPEC §8.3), idempotent on alert_id: a redelivered or
-- republished alert inserts nothing and returns no row.
INSERT INTO budget_alerts (alert_id, fired_at, org_id, team_id, scope_kind, scope_id, threshold_percent,
                           spend_micros, cap_micros, soft_micros, budget_duration, window_start, region,
                           instance_id, request_id)
VALUES (@alert_id, @fired_at, @org_id, @team_id, @scope_kind, @scope_id, @threshold_percent,
        @spend_micros, @cap_micros, @soft_micros, @budget_duration, @window_start, @region,
        @instance_id, @request_id)
ON CONFLICT (alert_id) DO NOTHING
RETURNING alert_id;

-- name: AlertList :many
-- Newest first, keyset-paginated on (fired_at, alert_id).
SELECT * FROM budget_alerts
WHERE (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
  AND (sqlc.narg(scope_kind)::text IS NULL OR scope_kind = sqlc.narg(scope_kind))
  AND (sqlc.narg(scope_id)::text IS NULL OR scope_id = sqlc.narg(scope_id))
  AND (sqlc.narg(since)::timestamptz IS NULL OR fired_at >= sqlc.narg(since))
  AND (sqlc.narg(after_at)::timestamptz IS NULL
       OR (fired_at, alert_id) < (sqlc.narg(after_at)::timestamptz, @after_id::text))
ORDER BY fired_at DESC, alert_id DESC
LIMIT @lim;
