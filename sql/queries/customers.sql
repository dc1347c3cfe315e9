-- name: CustomerInsert :exec
INSERT INTO customers (id, org_id, external_id, display_name, limits, blocked, metadata, created_at, updated_at)
VALUES (@id, @org_id, @external_id, @display_name, @limits, false, @metadata, @created_at, @created_at);

-- name: CustomerGet :one
SELECT * FROM customers
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: CustomerGetForUpdate :one
SELECT * FROM customers
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
FOR UPDATE;

-- name: CustomerList :many
SELECT * FROM customers
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND starts_with(external_id, @external_id_prefix)
  AND (sqlc.narg(blocked)::boolean IS NULL OR blocked = sqlc.narg(blocked))
ORDER BY id
LIMIT @lim;

-- name: CustomerUpdate :exec
UPDATE customers SET display_name = @display_name, limits = @limits, metadata = @metadata, updated_at = @updated_at
WHERE id = @id;

-- name: CustomerSetBlocked :exec
UPDATE customers SET blocked = @blocked, updated_at = @updated_at WHERE id = @id;

-- name: CustomerDelete :exec
DELETE FROM customers WHERE id = @id;
