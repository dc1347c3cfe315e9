-- The fleet view: each data plane's admission backlog per traffic class, as
-- of its latest heartbeat (JSON list of {traffic_class, in_flight, queued,
-- shed}); the console's Health & queues page shows it.
ALTER TABLE data_planes ADD COLUMN admission_backlog jsonb NOT NULL DEFAULT '[]';
