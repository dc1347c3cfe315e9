-- Config distribution (SPEC §6): regions and their rollout policy, compiled
-- config versions, and the fleet of data planes.

-- regions: every region has its own JetStream event stream. region_seq is
-- the last sequence published to that stream (equal to the stream's own
-- sequence: the publisher appends with an expected-last-sequence check).
-- current_version is the config version the region is told to run.
CREATE TABLE regions (
    name             text PRIMARY KEY CHECK (name ~ '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$'),
    policy           text NOT NULL CHECK (policy IN ('auto', 'staged')),
    region_seq       bigint NOT NULL DEFAULT 0,
    current_version  bigint NOT NULL DEFAULT 0,
    rollback         boolean NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
INSERT INTO regions (name, policy) VALUES ('default', 'auto');

-- config_versions: compiled snapshots (bodies live in the JetStream object
-- store under object). events_seq is the last outbox seq included.
CREATE TABLE config_versions (
    version     bigint PRIMARY KEY CHECK (version > 0),
    events_seq  bigint NOT NULL,
    digest      bytea NOT NULL CHECK (length(digest) = 32),
    size_bytes  bigint NOT NULL,
    object      text NOT NULL,
    created_at  timestamptz NOT NULL
);

-- config_version_regions: for each version, each region's stream position
-- when it was compiled. A data plane that loads the version replays the
-- region's events after that position (skipping those the snapshot holds).
CREATE TABLE config_version_regions (
    version     bigint NOT NULL REFERENCES config_versions (version) ON DELETE CASCADE,
    region      text NOT NULL REFERENCES regions (name) ON DELETE CASCADE,
    region_seq  bigint NOT NULL,
    PRIMARY KEY (version, region)
);

-- data_planes: the fleet view, from heartbeats.
CREATE TABLE data_planes (
    instance_id        text PRIMARY KEY,
    region             text NOT NULL,
    applied_version    bigint NOT NULL DEFAULT 0,
    events_seq         bigint NOT NULL DEFAULT 0,
    region_seq         bigint NOT NULL DEFAULT 0,
    health             text NOT NULL DEFAULT '',
    in_flight          bigint NOT NULL DEFAULT 0,
    staleness_seconds  double precision NOT NULL DEFAULT 0,
    rejected           jsonb NOT NULL DEFAULT '[]',
    last_seen          timestamptz NOT NULL
);
CREATE INDEX data_planes_region_idx ON data_planes (region, instance_id);

-- outbox_notify wakes the publisher as soon as a change commits.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sluice_outbox', NEW.seq::text);
    RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_notify();
