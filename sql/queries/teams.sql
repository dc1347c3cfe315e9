-- name: TeamInsert :exec
INSERT INTO teams (id, org_id, name, limits, blocked, metadata, traffic_class, model_group_aliases,
                   created_at, updated_at)
VALUES (@id, @org_id, @name, @limits, false, @metadata, @traffic_class, @model_group_aliases,
        @created_at, @created_at);

-- name: TeamGet :one
SELECT * FROM teams
WHERE id = @id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR id = sqlc.narg(team_id));

-- name: TeamGetForUpdate :one
SELECT * FROM teams
WHERE id = @id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR id = sqlc.narg(team_id))
FOR UPDATE;

-- name: TeamList :many
SELECT * FROM teams
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR id = sqlc.narg(team_id))
  AND starts_with(name, @name_prefix)
  AND (sqlc.narg(blocked)::boolean IS NULL OR blocked = sqlc.narg(blocked))
ORDER BY id
LIMIT @lim;

-- name: TeamUpdate :exec
UPDATE teams SET name = @name, limits = @limits, metadata = @metadata, traffic_class = @traffic_class,
                 model_group_aliases = @model_group_aliases, updated_at = @updated_at
WHERE org_id = @org_id AND id = @id;

-- name: TeamSetBlocked :exec
UPDATE teams SET blocked = @blocked, updated_at = @updated_at WHERE org_id = @org_id AND id = @id;

-- name: TeamDelete :exec
DELETE FROM teams WHERE org_id = @org_id AND id = @id;

-- TeamChildren counts what keeps a team from being deleted (memberships
-- cascade and revoked admin tokens are deleted with it, so they are not
-- counted).
-- name: TeamChildren :one
SELECT (SELECT count(*) FROM keys k WHERE k.org_id = @org_id AND k.team_id = @id::text)::bigint AS keys,
       (SELECT count(*) FROM admin_tokens a
        WHERE a.org_id = @org_id AND a.team_id = @id::text AND a.revoked_at IS NULL)::bigint AS admin_tokens;
