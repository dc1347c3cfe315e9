-- name: LabelScopeInsert :exec
INSERT INTO label_scopes (id, org_id, kind, name, limits, created_at, updated_at)
VALUES (@id, @org_id, @kind, @name, @limits, @created_at, @created_at);

-- name: LabelScopeGet :one
SELECT * FROM label_scopes
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: LabelScopeGetForUpdate :one
SELECT * FROM label_scopes
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
FOR UPDATE;

-- name: LabelScopeList :many
SELECT * FROM label_scopes
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(kind)::text IS NULL OR kind = sqlc.narg(kind))
  AND starts_with(name, @name_prefix)
ORDER BY id
LIMIT @lim;

-- name: LabelScopeUpdate :exec
UPDATE label_scopes SET limits = @limits, updated_at = @updated_at
WHERE id = @id;

-- name: LabelScopeDelete :exec
DELETE FROM label_scopes WHERE id = @id;
