-- Distribution epochs (docs/distribution.md "Backup and restore"): a new
-- numbering of snapshot versions and event sequences above what JetStream
-- held when this database turned out to be behind it.

-- name: EpochLatest :one
SELECT * FROM distribution_epochs ORDER BY epoch DESC LIMIT 1;

-- name: EpochLatestForUpdate :one
SELECT * FROM distribution_epochs ORDER BY epoch DESC LIMIT 1 FOR UPDATE;

-- name: EpochList :many
SELECT * FROM distribution_epochs ORDER BY epoch;

-- name: EpochInsert :exec
INSERT INTO distribution_epochs (epoch, started_at, version_floor, events_floor, reason, detail)
VALUES (@epoch, @started_at, @version_floor, @events_floor, @reason, @detail);

-- name: EpochSetFirstVersion :exec
UPDATE distribution_epochs SET first_version = @first_version WHERE epoch = @epoch;

-- name: EpochSetDetail :exec
UPDATE distribution_epochs SET detail = @detail WHERE epoch = @epoch;

-- name: ConfigVersionFloor :one
SELECT greatest(
    (SELECT coalesce(max(version), 0) FROM config_versions),
    (SELECT coalesce(max(version_floor), 0) FROM distribution_epochs))::bigint;

-- name: ConfigVersionDigest :one
SELECT digest FROM config_versions WHERE version = @version;

-- name: EpochOutboxAdvance :exec
UPDATE chain_head SET outbox_seq = greatest(outbox_seq, @floor::bigint) WHERE id = 1;

-- name: EpochOutboxDrop :execrows
UPDATE outbox SET published_at = @published_at WHERE published_at IS NULL;

-- name: ConfigPendingOutbox :many
SELECT seq, kind, object_type, object_id FROM outbox WHERE published_at IS NULL ORDER BY seq LIMIT @lim;
