-- Queries of the config publisher: snapshot compilation, outbox
-- publication, regions' stream positions and versions.

-- name: ConfigOrgs :many
SELECT * FROM orgs ORDER BY id;

-- name: ConfigTeams :many
SELECT * FROM teams ORDER BY id;

-- name: ConfigUsers :many
SELECT * FROM users ORDER BY id;

-- name: ConfigMembers :many
SELECT * FROM team_members ORDER BY team_id, user_id;

-- name: ConfigCustomers :many
SELECT * FROM customers ORDER BY id;

-- name: ConfigKeys :many
SELECT * FROM keys ORDER BY id;

-- name: ConfigOldHashes :many
SELECT * FROM key_old_hashes ORDER BY key_id, valid_until;

-- name: ConfigKey :one
SELECT * FROM keys WHERE id = @id;

-- name: ConfigKeyOldHashes :many
SELECT * FROM key_old_hashes WHERE key_id = @key_id ORDER BY valid_until;

-- name: ConfigMember :one
SELECT * FROM team_members WHERE team_id = @team_id AND user_id = @user_id;

-- name: ConfigOutboxPending :many
SELECT * FROM outbox WHERE published_at IS NULL ORDER BY seq LIMIT @lim FOR UPDATE;

-- name: ConfigOutboxMarkPublished :exec
UPDATE outbox SET published_at = @published_at WHERE published_at IS NULL AND seq <= @up_to;

-- name: ConfigRegionsLock :many
SELECT * FROM regions ORDER BY name FOR UPDATE;

-- name: ConfigRegions :many
SELECT * FROM regions ORDER BY name;

-- name: ConfigRegionSetSeq :exec
UPDATE regions SET region_seq = @region_seq WHERE name = @name;

-- name: ConfigRegionSetCurrent :exec
UPDATE regions SET current_version = @current_version, rollback = false, updated_at = @updated_at
WHERE name = @name;

-- name: ConfigVersionMax :one
SELECT coalesce(max(version), 0)::bigint FROM config_versions;

-- name: ConfigVersionInsert :exec
INSERT INTO config_versions (version, events_seq, digest, size_bytes, object, created_at)
VALUES (@version, @events_seq, @digest, @size_bytes, @object, @created_at);

-- name: ConfigVersionRegionInsert :exec
INSERT INTO config_version_regions (version, region, region_seq) VALUES (@version, @region, @region_seq);

-- name: ConfigVersionByNumber :one
SELECT * FROM config_versions WHERE version = @version;

-- name: ConfigVersionRegionSeq :one
SELECT region_seq FROM config_version_regions WHERE version = @version AND region = @region;

-- name: ConfigLabelScopes :many
SELECT * FROM label_scopes ORDER BY id;
