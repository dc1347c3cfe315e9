-- name: OrgInsert :exec
INSERT INTO orgs (id, name, limits, blocked, metadata, created_at, updated_at)
VALUES (@id, @name, @limits, false, @metadata, @created_at, @created_at);

-- name: OrgGet :one
SELECT * FROM orgs
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR id = sqlc.narg(org_id));

-- name: OrgGetForUpdate :one
SELECT * FROM orgs
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR id = sqlc.narg(org_id))
FOR UPDATE;

-- name: OrgList :many
SELECT * FROM orgs
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR id = sqlc.narg(org_id))
  AND starts_with(name, @name_prefix)
  AND (sqlc.narg(blocked)::boolean IS NULL OR blocked = sqlc.narg(blocked))
ORDER BY id
LIMIT @lim;

-- name: OrgUpdate :exec
UPDATE orgs SET name = @name, limits = @limits, metadata = @metadata, updated_at = @updated_at
WHERE id = @id;

-- name: OrgSetBlocked :exec
UPDATE orgs SET blocked = @blocked, updated_at = @updated_at WHERE id = @id;

-- name: OrgDelete :exec
DELETE FROM orgs WHERE id = @id;

-- name: OrgChildren :one
SELECT (SELECT count(*) FROM teams t WHERE t.org_id = @id)::bigint AS teams,
       (SELECT count(*) FROM users u WHERE u.org_id = @id)::bigint AS users,
       (SELECT count(*) FROM keys k WHERE k.org_id = @id)::bigint AS keys,
       (SELECT count(*) FROM customers c WHERE c.org_id = @id)::bigint AS customers,
       (SELECT count(*) FROM label_scopes s WHERE s.org_id = @id)::bigint AS label_scopes,
       (SELECT count(*) FROM admin_tokens a WHERE a.org_id = @id AND a.revoked_at IS NULL)::bigint AS admin_tokens;
