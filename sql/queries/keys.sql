-- name: KeyInsert :exec
-- Virtual keys (SPEC §4). The token itself is never stored: token_hash is
-- HMAC-SHA256 under pepper pepper_version. Tenant filters below: org_id
-- and, for team-scoped callers, team_id (org-level keys, with no team, are
-- then invisible).
INSERT INTO keys (id, org_id, team_id, user_id, project, alias, token_hash, pepper_version,
                  display_prefix, last4, expires_at, tags, traffic_class, model_group_aliases,
                  enforced_params, allowed_routes, limits, blocked, metadata, rotation_count,
                  created_at, updated_at)
VALUES (@id, @org_id, sqlc.narg(team_id), sqlc.narg(user_id), @project, @alias, @token_hash,
        @pepper_version, @display_prefix, @last4, sqlc.narg(expires_at), @tags, @traffic_class,
        @model_group_aliases, @enforced_params, @allowed_routes, @limits, false, @metadata, 0,
        @created_at, @created_at);

-- name: KeyRefsExist :one
-- Explicit existence checks of a key's org, team and user (within the
-- org), and of the user's membership of the team for team keys, so
-- clients get an error naming the missing one rather than a foreign key
-- violation.
SELECT EXISTS (SELECT 1 FROM orgs o WHERE o.id = @org_id)::boolean AS org_ok,
       (sqlc.narg(team_id)::text IS NULL
        OR EXISTS (SELECT 1 FROM teams t WHERE t.org_id = @org_id AND t.id = sqlc.narg(team_id)))::boolean AS team_ok,
       (sqlc.narg(user_id)::text IS NULL
        OR EXISTS (SELECT 1 FROM users u WHERE u.org_id = @org_id AND u.id = sqlc.narg(user_id)))::boolean AS user_ok,
       -- The owner of a team key must be a member of that team.
       (sqlc.narg(team_id)::text IS NULL OR sqlc.narg(user_id)::text IS NULL
        OR EXISTS (SELECT 1 FROM team_members m
                   WHERE m.org_id = @org_id AND m.team_id = sqlc.narg(team_id) AND m.user_id = sqlc.narg(user_id)))::boolean AS member_ok;

-- name: KeyGet :one
SELECT * FROM keys
WHERE id = @id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id));

-- name: KeyGetForUpdate :one
SELECT * FROM keys
WHERE id = @id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
FOR UPDATE;

-- name: KeyList :many
SELECT * FROM keys
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
  AND (sqlc.narg(user_id)::text IS NULL OR user_id = sqlc.narg(user_id))
  AND starts_with(alias, @alias_prefix)
  AND (sqlc.narg(blocked)::boolean IS NULL OR blocked = sqlc.narg(blocked))
  AND (sqlc.narg(tag)::text IS NULL OR sqlc.narg(tag) = ANY (tags))
ORDER BY id
LIMIT @lim;

-- name: KeyUpdate :exec
UPDATE keys
SET user_id = sqlc.narg(user_id), project = @project, alias = @alias, expires_at = sqlc.narg(expires_at),
    tags = @tags, traffic_class = @traffic_class, model_group_aliases = @model_group_aliases,
    enforced_params = @enforced_params, allowed_routes = @allowed_routes, limits = @limits,
    metadata = @metadata, updated_at = @updated_at
WHERE id = @id;

-- name: KeySetBlocked :exec
UPDATE keys SET blocked = @blocked, updated_at = @updated_at WHERE id = @id;

-- name: KeyDelete :exec
DELETE FROM keys WHERE id = @id;

-- name: KeyOldHashesDelete :exec
-- Drops a key's old hashes: all of them (drop_all = true, a rotation without
-- grace), or only those whose grace has ended.
DELETE FROM key_old_hashes
WHERE key_id = @key_id AND (@drop_all::boolean OR valid_until <= @now);

-- name: KeyOldHashKeepCurrent :exec
-- Keeps the key's current hash valid until @valid_until (rotation with a
-- grace period). The hash is copied inside the database: it never travels.
INSERT INTO key_old_hashes (token_hash, key_id, pepper_version, valid_until, created_at)
SELECT k.token_hash, k.id, k.pepper_version, @valid_until, @created_at
FROM keys k WHERE k.id = @key_id;

-- name: KeyRotate :exec
UPDATE keys
SET token_hash = @token_hash, pepper_version = @pepper_version, display_prefix = @display_prefix,
    last4 = @last4, rotation_count = rotation_count + 1, rotated_at = @rotated_at, updated_at = @rotated_at
WHERE id = @id;

-- name: KeyAuthList :many
-- Every key with what authentication needs, its block state resolved
-- along the chain key → user → team → org.
SELECT k.id, k.org_id, k.team_id, k.user_id, k.token_hash, k.pepper_version, k.expires_at,
       k.blocked AS key_blocked,
       coalesce(u.blocked, false)::boolean AS user_blocked,
       coalesce(t.blocked, false)::boolean AS team_blocked,
       o.blocked AS org_blocked
FROM keys k
JOIN orgs o ON o.id = k.org_id
LEFT JOIN teams t ON t.id = k.team_id
LEFT JOIN users u ON u.id = k.user_id
ORDER BY k.id;

-- name: KeyOldHashList :many
SELECT token_hash, key_id, pepper_version, valid_until FROM key_old_hashes
ORDER BY key_id, valid_until;
