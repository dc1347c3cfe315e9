-- Model groups and their deployments (SPEC §7.2). Platform objects: no
-- org_id; every admin token may read them, platform tokens change them.

-- name: ModelGroupInsert :exec
INSERT INTO model_groups (name, description, created_at, updated_at)
VALUES (@name, @description, @created_at, @created_at);

-- name: ModelGroupGet :one
SELECT * FROM model_groups WHERE name = @name;

-- name: ModelGroupGetForUpdate :one
SELECT * FROM model_groups WHERE name = @name FOR UPDATE;

-- name: ModelGroupList :many
SELECT * FROM model_groups
WHERE name > @after_name
ORDER BY name
LIMIT @lim;

-- name: ModelGroupUpdate :exec
UPDATE model_groups SET description = @description, updated_at = @updated_at WHERE name = @name;

-- name: ModelGroupDeploymentCount :one
SELECT count(*)::bigint FROM deployments WHERE model_group = @name;

-- name: ModelGroupDelete :exec
DELETE FROM model_groups WHERE name = @name;

-- name: ModelGroupAll :many
SELECT * FROM model_groups ORDER BY name;

-- name: DeploymentInsert :exec
INSERT INTO deployments (id, model_group, api_base, upstream_model, credential_ciphertext, weight,
    max_concurrency, capabilities, tags, input_price, output_price, cached_input_price, free,
    created_at, updated_at)
VALUES (@id, @model_group, @api_base, @upstream_model, @credential_ciphertext, @weight,
    @max_concurrency, @capabilities, @tags, @input_price, @output_price, @cached_input_price, @free,
    @created_at, @created_at);

-- name: DeploymentGet :one
SELECT * FROM deployments WHERE id = @id;

-- name: DeploymentGetForUpdate :one
SELECT * FROM deployments WHERE id = @id FOR UPDATE;

-- name: DeploymentList :many
SELECT * FROM deployments
WHERE id > @after_id
  AND (sqlc.narg(model_group)::text IS NULL OR model_group = sqlc.narg(model_group))
ORDER BY id
LIMIT @lim;

-- name: DeploymentUpdate :exec
UPDATE deployments SET api_base = @api_base, upstream_model = @upstream_model,
    credential_ciphertext = @credential_ciphertext, weight = @weight, max_concurrency = @max_concurrency,
    capabilities = @capabilities, tags = @tags, input_price = @input_price, output_price = @output_price,
    cached_input_price = @cached_input_price, free = @free, updated_at = @updated_at
WHERE id = @id;

-- name: DeploymentDelete :exec
DELETE FROM deployments WHERE id = @id;

-- name: DeploymentAll :many
SELECT * FROM deployments ORDER BY id;
