-- Data planes: the fleet view, one row per instance from its latest
-- heartbeat (SPEC §6).

-- name: DataPlaneUpsert :exec
INSERT INTO data_planes (instance_id, region, applied_version, events_seq, region_seq, health,
                         in_flight, staleness_seconds, rejected, last_seen, rejecting, ejected, admission_backlog)
VALUES (@instance_id, @region, @applied_version, @events_seq, @region_seq, @health,
        @in_flight, @staleness_seconds, @rejected, @last_seen, @rejecting, @ejected, @admission_backlog)
ON CONFLICT (instance_id) DO UPDATE
SET region = EXCLUDED.region, applied_version = EXCLUDED.applied_version,
    events_seq = EXCLUDED.events_seq, region_seq = EXCLUDED.region_seq, health = EXCLUDED.health,
    in_flight = EXCLUDED.in_flight, staleness_seconds = EXCLUDED.staleness_seconds,
    rejected = EXCLUDED.rejected, last_seen = EXCLUDED.last_seen, rejecting = EXCLUDED.rejecting,
    ejected = EXCLUDED.ejected, admission_backlog = EXCLUDED.admission_backlog;

-- name: DataPlaneList :many
SELECT * FROM data_planes
WHERE (sqlc.narg(region)::text IS NULL OR region = sqlc.narg(region))
ORDER BY region, instance_id;
