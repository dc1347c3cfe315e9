-- Model groups and their deployments (SPEC §7.2). Platform objects: no
-- org_id; every admin token may read them, platform tokens change them.

-- name: ModelGroupInsert :exec
INSERT INTO model_groups (name, description, platform_wide, routing, created_at, updated_at)
VALUES (@name, @description, @platform_wide, @routing, @created_at, @created_at);

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
UPDATE model_groups SET description = @description, platform_wide = @platform_wide, routing = @routing, updated_at = @updated_at WHERE name = @name;

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

-- name: ModelGroupGrantInsert :exec
INSERT INTO model_group_grants (model_group, org_id, created_at, created_by)
VALUES (@model_group, @org_id, @created_at, @created_by);

-- name: ModelGroupGrantDelete :execrows
DELETE FROM model_group_grants WHERE model_group = @model_group AND org_id = @org_id;

-- name: ModelGroupGrantOrgs :many
SELECT org_id FROM model_group_grants WHERE model_group = @model_group ORDER BY org_id;

-- name: ModelGroupGrantAll :many
SELECT * FROM model_group_grants ORDER BY model_group, org_id;

-- name: ModelGroupGrantList :many
-- Keyset on (model_group, org_id); filters optional.
SELECT * FROM model_group_grants
WHERE (sqlc.narg(model_group)::text IS NULL OR model_group = sqlc.narg(model_group))
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (model_group, org_id) > (@after_group::text, @after_org::text)
ORDER BY model_group, org_id
LIMIT @lim;

-- name: ModelGroupVisibleList :many
-- The groups org_id may see: platform-wide or granted to it.
SELECT g.* FROM model_groups g
WHERE g.name > @after_name
  AND (g.platform_wide OR EXISTS (SELECT 1 FROM model_group_grants m WHERE m.model_group = g.name AND m.org_id = @org_id))
ORDER BY g.name
LIMIT @lim;

-- name: ModelGroupVisibleTo :one
SELECT (g.platform_wide OR EXISTS (SELECT 1 FROM model_group_grants m WHERE m.model_group = g.name AND m.org_id = @org_id))::boolean
FROM model_groups g WHERE g.name = @name;
