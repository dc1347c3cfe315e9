-- Alert webhooks and their delivery outbox (docs/alerts.md).

-- name: WebhookInsert :exec
INSERT INTO alert_webhooks (id, org_id, url, description, secret_ciphertext, created_at, created_by)
VALUES (@id, @org_id, @url, @description, @secret_ciphertext, @created_at, @created_by);

-- name: WebhookGet :one
SELECT * FROM alert_webhooks
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: WebhookList :many
SELECT * FROM alert_webhooks
WHERE id > @after_id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
ORDER BY id
LIMIT @lim;

-- name: WebhookGetForUpdate :one
SELECT * FROM alert_webhooks
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
FOR UPDATE;

-- name: WebhookRotate :exec
UPDATE alert_webhooks SET secret_ciphertext = @secret_ciphertext, previous_secret_ciphertext = sqlc.narg(previous_secret_ciphertext),
    previous_valid_until = sqlc.narg(previous_valid_until), secret_rotated_at = @rotated_at
WHERE id = @id;

-- name: WebhookCountForOrg :one
SELECT count(*)::bigint FROM alert_webhooks WHERE org_id = @org_id;

-- name: WebhookDelete :exec
DELETE FROM alert_webhooks WHERE id = @id;

-- name: DeliveryEnqueue :exec
-- One delivery per newly recorded alert and each webhook of its org, in
-- the transaction that records the alerts.
INSERT INTO alert_deliveries (delivery_id, alert_id, webhook_id, org_id, state, attempts, next_attempt_at, created_at)
SELECT 'dlv_' || md5(a.alert_id || '|' || w.id), a.alert_id, w.id, a.org_id, 'pending', 0, @now::timestamptz, @now::timestamptz
FROM budget_alerts a JOIN alert_webhooks w ON w.org_id = a.org_id
WHERE a.alert_id = ANY(@alert_ids::text[])
ON CONFLICT (alert_id, webhook_id) DO NOTHING;

-- name: DeliveryClaim :many
-- Due deliveries, locked so that concurrent workers (every replica) take
-- different rows; the caller pushes next_attempt_at out by its lease in
-- the same transaction.
SELECT d.delivery_id FROM alert_deliveries d
WHERE d.state = 'pending' AND d.next_attempt_at <= @now
ORDER BY d.next_attempt_at
LIMIT @lim
FOR UPDATE SKIP LOCKED;

-- name: DeliveryLease :exec
UPDATE alert_deliveries SET next_attempt_at = @lease_until WHERE delivery_id = ANY(@ids::text[]);

-- name: DeliveryGetWork :one
SELECT d.delivery_id, d.attempts, w.url, w.secret_ciphertext, w.previous_secret_ciphertext, w.previous_valid_until, a.*
FROM alert_deliveries d
JOIN alert_webhooks w ON w.id = d.webhook_id
JOIN budget_alerts a ON a.alert_id = d.alert_id
WHERE d.delivery_id = @delivery_id;

-- name: DeliveryDone :exec
UPDATE alert_deliveries SET state = 'delivered', attempts = attempts + 1, delivered_at = @now, last_error = ''
WHERE delivery_id = @delivery_id AND state = 'pending';

-- name: DeliveryFailed :exec
UPDATE alert_deliveries SET attempts = attempts + 1, last_error = @last_error, next_attempt_at = @next_attempt_at,
    state = CASE WHEN attempts + 1 >= @max_attempts::integer THEN 'dead' ELSE 'pending' END
WHERE delivery_id = @delivery_id AND state = 'pending';

-- name: DeliveryGet :one
SELECT * FROM alert_deliveries
WHERE delivery_id = @delivery_id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: DeliveryRetry :exec
UPDATE alert_deliveries SET state = 'pending', attempts = 0, next_attempt_at = @now, last_error = ''
WHERE delivery_id = @delivery_id AND state = 'dead';

-- name: DeliveryList :many
-- Newest first, keyset on (created_at, delivery_id).
SELECT * FROM alert_deliveries
WHERE (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(webhook_id)::text IS NULL OR webhook_id = sqlc.narg(webhook_id))
  AND (sqlc.narg(state)::text IS NULL OR state = sqlc.narg(state))
  AND (sqlc.narg(after_at)::timestamptz IS NULL
       OR (created_at, delivery_id) < (sqlc.narg(after_at)::timestamptz, @after_id::text))
ORDER BY created_at DESC, delivery_id DESC
LIMIT @lim;
