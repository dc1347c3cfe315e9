-- name: UserInsert :exec
INSERT INTO users (id, org_id, email, display_name, limits, blocked, metadata, created_at, updated_at)
VALUES (@id, @org_id, @email, @display_name, @limits, false, @metadata, @created_at, @created_at);

-- name: UserGet :one
SELECT * FROM users
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: UserGetForUpdate :one
SELECT * FROM users
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
FOR UPDATE;

-- name: UserList :many
SELECT * FROM users
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND starts_with(email, @email_prefix)
  AND (sqlc.narg(blocked)::boolean IS NULL OR blocked = sqlc.narg(blocked))
ORDER BY id
LIMIT @lim;

-- name: UserUpdate :exec
UPDATE users SET email = @email, display_name = @display_name, limits = @limits, metadata = @metadata,
                 updated_at = @updated_at
WHERE id = @id;

-- name: UserSetBlocked :exec
UPDATE users SET blocked = @blocked, updated_at = @updated_at WHERE id = @id;

-- name: UserKeyCount :one
SELECT count(*)::bigint FROM keys WHERE org_id = @org_id AND user_id = @user_id::text;

-- name: UserTeamIDs :many
SELECT team_id FROM team_members WHERE org_id = @org_id AND user_id = @id ORDER BY team_id;

-- name: UserDelete :exec
DELETE FROM users WHERE id = @id;
