-- name: AdminTokenInsert :exec
INSERT INTO admin_tokens (id, name, token_hash, pepper_version, display_prefix, last4, scope, org_id,
                          team_id, role, expires_at, created_by, created_at)
VALUES (@id, @name, @token_hash, @pepper_version, @display_prefix, @last4, @scope,
        sqlc.narg(org_id), sqlc.narg(team_id), @role, sqlc.narg(expires_at), @created_by, @created_at);

-- name: AdminTokenGetByHash :one
SELECT * FROM admin_tokens WHERE token_hash = @token_hash;

-- name: AdminTokenGetForUpdate :one
SELECT * FROM admin_tokens
WHERE id = @id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
FOR UPDATE;

-- name: AdminTokenList :many
SELECT * FROM admin_tokens
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
  AND (@include_revoked::boolean OR revoked_at IS NULL)
ORDER BY id
LIMIT @lim;

-- name: AdminTokenRevoke :exec
UPDATE admin_tokens SET revoked_at = @revoked_at WHERE id = @id AND revoked_at IS NULL;

-- name: AdminTokenDeleteRevokedForOrg :exec
DELETE FROM admin_tokens WHERE org_id = @org_id AND revoked_at IS NOT NULL;

-- name: AdminTokenDeleteRevokedForTeam :exec
DELETE FROM admin_tokens WHERE team_id = @team_id AND revoked_at IS NOT NULL;
