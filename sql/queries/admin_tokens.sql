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

-- name: AdminTokenChainByHash :many
-- The token with this hash followed by its issuers (created_by), nearest
-- first, so authentication can require every one of them to be live. The
-- walk stops at the bootstrap token (created_by 'bootstrap', no row), at
-- a missing issuer, or after 64 steps.
-- The first row matches the current hash or, after a rotation with grace,
-- the previous one (via_previous, with previous_valid_until for the
-- caller to check against its clock).
WITH RECURSIVE chain (id, name, scope, org_id, team_id, role, display_prefix, last4, expires_at,
                      revoked_at, created_by, created_at, via_previous, previous_valid_until, depth) AS (
    SELECT t.id, t.name, t.scope, t.org_id, t.team_id, t.role, t.display_prefix, t.last4, t.expires_at,
           t.revoked_at, t.created_by, t.created_at, t.token_hash <> @token_hash, t.previous_valid_until, 0
    FROM admin_tokens t WHERE t.token_hash = @token_hash OR t.previous_hash = @token_hash
  UNION ALL
    SELECT p.id, p.name, p.scope, p.org_id, p.team_id, p.role, p.display_prefix, p.last4, p.expires_at,
           p.revoked_at, p.created_by, p.created_at, false, p.previous_valid_until, c.depth + 1
    FROM admin_tokens p JOIN chain c ON p.id = c.created_by
    WHERE c.depth < 64
)
SELECT id, name, scope, org_id, team_id, role, display_prefix, last4, expires_at, revoked_at, created_by,
       created_at, via_previous::boolean AS via_previous, previous_valid_until, depth::integer AS depth
FROM chain ORDER BY depth;

-- name: AdminTokenRotate :exec
UPDATE admin_tokens SET previous_hash = sqlc.narg(previous_hash), previous_pepper_version = sqlc.narg(previous_pepper_version),
    previous_valid_until = sqlc.narg(previous_valid_until), token_hash = @token_hash, pepper_version = @pepper_version,
    display_prefix = @display_prefix, last4 = @last4, rotated_at = @rotated_at
WHERE id = @id;

-- name: AdminTokenSetExpiry :exec
UPDATE admin_tokens SET expires_at = sqlc.narg(expires_at) WHERE id = @id;

-- name: AdminTokenDelete :exec
DELETE FROM admin_tokens WHERE id = @id;

-- name: AdminTokenGetHash :one
SELECT token_hash, pepper_version FROM admin_tokens WHERE id = @id;
