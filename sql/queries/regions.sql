-- Regions (rollout policy and the config version each is told to run) and
-- the compiled config versions they point at (SPEC §6).

-- name: RegionGet :one
SELECT * FROM regions WHERE name = @name;

-- name: RegionGetForUpdate :one
SELECT * FROM regions WHERE name = @name FOR UPDATE;

-- name: RegionList :many
SELECT * FROM regions ORDER BY name;

-- name: RegionInsert :exec
INSERT INTO regions (name, policy, created_at, updated_at)
VALUES (@name, @policy, @created_at, @created_at);

-- name: RegionSetPolicy :exec
UPDATE regions SET policy = @policy, updated_at = @updated_at WHERE name = @name;

-- name: RegionSetVersion :exec
UPDATE regions SET current_version = @current_version, rollback = @rollback, updated_at = @updated_at
WHERE name = @name;

-- name: ConfigVersionGet :one
SELECT * FROM config_versions WHERE version = @version;

-- name: ConfigVersionLatest :one
SELECT * FROM config_versions ORDER BY version DESC LIMIT 1;

-- name: ConfigVersionRegionGet :one
SELECT * FROM config_version_regions WHERE version = @version AND region = @region;
