-- Distribution epochs (SPEC §6, docs/distribution.md "Backup and
-- restore"): when the leader finds JetStream ahead of this database (the
-- database was restored from a backup, or replaced by another one, while
-- NATS kept its data), it starts a new epoch instead of publishing numbers
-- the data planes already ran past.
--
-- An epoch numbers above everything JetStream held: snapshot versions go
-- on above version_floor, outbox (event) sequences above events_floor, and
-- each region's stream continues after the stream's last message. Its
-- first compiled version (first_version, NULL until compiled) becomes
-- current in every region, staged ones included: older versions belong to
-- the abandoned history and can be neither promoted nor rolled back to.
-- No row: epoch 0, the database's own history from its first version.
CREATE TABLE distribution_epochs (
    epoch          bigint PRIMARY KEY CHECK (epoch > 0),
    started_at     timestamptz NOT NULL,
    version_floor  bigint NOT NULL CHECK (version_floor >= 0),
    events_floor   bigint NOT NULL CHECK (events_floor >= 0),
    first_version  bigint CHECK (first_version > version_floor),
    -- why: what JetStream held that this database did not know.
    reason         text NOT NULL,
    -- what JetStream and the database held when the epoch started, and the
    -- revocations of the abandoned history re-applied here.
    detail         jsonb NOT NULL DEFAULT '{}'
);

-- data_planes.rejecting: the snapshot pointer a data plane has been
-- refusing, from its heartbeat (NULL: none). JSON: {"version":N,
-- "running_version":M,"reason":"...","since":"RFC3339","past_bound":bool}.
ALTER TABLE data_planes ADD COLUMN rejecting jsonb;
